"""The simulator's configuration: one dataclass tree, loaded by ``gateway.config``.

Precedence is the project's: defaults < YAML file < environment (``KVROUTE_SIM_*``, e.g.
``KVROUTE_SIM_CACHE__KV_BLOCKS=4096``) < command-line flags. The engine core reads only
``CacheConfig`` and ``SchedulerConfig``; the rest is for the live server.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gateway.contract.settings import ConfigError, load_config
from loadtest.enginesim.lora import LoraConfig
from loadtest.enginesim.timing import Attention

__all__ = [
    "ENV_PREFIX",
    "KV_GROUP_KINDS",
    "KV_GROUP_PRESETS",
    "SLIDING_KINDS",
    "CacheConfig",
    "EventsConfig",
    "KvGroup",
    "LoraConfig",
    "SchedulerConfig",
    "SimConfig",
    "TimingConfig",
    "load_sim_config",
]

ENV_PREFIX = "KVROUTE_SIM_"


def _positive(where: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{where}.{name} must be > 0, got {value}")


# vLLM's ``KVCacheSpecKind`` values (vllm/v1/kv_cache_interface.py, 0.23 and 0.33).
KV_GROUP_KINDS = (
    "full_attention",
    "mla_attention",
    "sliding_window",
    "sliding_window_mla",
    "mamba",
    "chunked_local_attention",
    "sink_full_attention",
    "encoder_only_attention",
    "cross_attention",
    "unknown",
)
# Kinds whose spec is a ``SlidingWindowSpec``: they carry ``kv_cache_spec_sliding_window``.
SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla"})


@dataclass(frozen=True)
class KvGroup:
    """One vLLM KV-cache group: what its BlockStored events report as ``kv_cache_spec_kind``
    (and ``kv_cache_spec_sliding_window``, for the sliding kinds, where it is required)."""

    kind: str = "full_attention"
    sliding_window: int | None = None  # tokens

    def __post_init__(self) -> None:
        if self.kind not in KV_GROUP_KINDS:
            raise ValueError(f"kind must be one of {', '.join(KV_GROUP_KINDS)}, got {self.kind!r}")
        if self.kind in SLIDING_KINDS:
            if self.sliding_window is None or self.sliding_window < 1:
                raise ValueError(f"a {self.kind} group needs sliding_window >= 1 (tokens)")
        elif self.sliding_window is not None:
            raise ValueError(f"sliding_window is only for sliding kinds, not {self.kind}")


def _gemma3(window: int, sliding_groups: int) -> list[KvGroup]:
    return [KvGroup("sliding_window", window)] * sliding_groups + [KvGroup()]


# Group lists of known models, in vLLM's group order (layer 0's type first; research notes
# for issue 12). ``cache.kv_groups`` takes these lists; they are here for tests and docs.
KV_GROUP_PRESETS: dict[str, list[KvGroup]] = {
    "dense": [KvGroup()],
    "deepseek-v3": [KvGroup("mla_attention")],  # also R1 and V3.2 (one MLA group)
    "gpt-oss": [KvGroup("sliding_window", 128), KvGroup()],
    "gemma-3-1b": _gemma3(512, 6),
    "gemma-3-4b": _gemma3(1024, 6),
    "gemma-3-12b": _gemma3(1024, 5),
    "gemma-3-27b": _gemma3(1024, 6),
}


@dataclass
class CacheConfig:
    """The KV pool: ``kv_blocks`` blocks of ``block_size`` tokens (SGLang: the page size)."""

    kv_blocks: int = 16384
    block_size: int = 16
    # "block": trim the LRU leaf block by block (vLLM); "node": evict whole leaf nodes
    # (SGLang); "auto": by flavor.
    eviction: Literal["auto", "block", "node"] = "auto"
    # Cache full blocks of generated tokens when a request finishes (both engines do).
    cache_outputs: bool = True
    # vLLM only: the model's KV-cache groups in vLLM's group order. Every BlockStored and
    # BlockRemoved is published once per group (same hashes); sliding-window and Mamba
    # groups also drop blocks outside their window early (see events.py). YAML:
    # ``kv_groups: [{kind: sliding_window, sliding_window: 128}, {kind: full_attention}]``.
    kv_groups: list[KvGroup] = field(default_factory=lambda: [KvGroup()])
    # SGLang only: EAGLE/EAGLE3/NEXTN (DeepSeek MTP) speculative decoding, whose radix tree
    # is keyed by token bigrams (t_i, t_i+1): at most N-2 of N prompt tokens are reused, and
    # events publish ``token_ids`` as pairs.
    bigram_keys: bool = False

    def __post_init__(self) -> None:
        _positive("cache", kv_blocks=self.kv_blocks, block_size=self.block_size)
        if not self.kv_groups:
            raise ConfigError("cache.kv_groups must list at least one group")

    @property
    def atom_bytes(self) -> int:
        """Bytes per radix-tree key atom: a uint32 token, or a (t_i, t_i+1) pair of them."""
        return 8 if self.bigram_keys else 4


@dataclass
class SchedulerConfig:
    """Continuous batching limits (vLLM's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    max_model_len: int = 32768
    default_max_tokens: int = 64  # when a request does not say

    def __post_init__(self) -> None:
        _positive(
            "scheduler",
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            default_max_tokens=self.default_max_tokens,
        )


@dataclass
class TimingConfig:
    preset: str = "mocker"  # see timing.PRESETS
    speedup: float = 1.0  # divides every step time
    attention: Attention = "batch"  # what the quadratic prefill term is paid on (timing.py)

    def __post_init__(self) -> None:
        _positive("timing", speedup=self.speedup)


@dataclass
class EventsConfig:
    """KV events as the engine of ``SimConfig.flavor`` publishes them."""

    enabled: bool = True
    # "map": vLLM >= 0.24 / SGLang >= 0.5.20 (fields of vLLM 0.33 / SGLang 0.5.23);
    # "array": older tagged arrays (fields of vLLM 0.23 / SGLang 0.5.15).
    encoding: Literal["map", "array"] = "map"
    hash_format: Literal["int", "bytes"] = "int"  # vLLM only: uint64 (default) or raw digest
    # Replay reply frames: "topic" = [topic, seq, payload] (vLLM >= 0.26, SGLang >= 0.5.22),
    # "legacy" = [seq, payload]; "auto" follows the encoding (map -> topic).
    replay_layout: Literal["auto", "legacy", "topic"] = "auto"
    topic: str = ""
    buffer_steps: int = 10000  # replay buffer, in batches
    hwm: int = 100000
    # Replay replies lose every message past this many (vLLM 0.23 / SGLang 0.5.23 send the
    # whole buffer through a default ~1,000-message send queue); None: nothing is lost.
    replay_queue_bound: int | None = None

    def __post_init__(self) -> None:
        _positive("events", buffer_steps=self.buffer_steps, hwm=self.hwm)
        if self.replay_queue_bound is not None:
            _positive("events", replay_queue_bound=self.replay_queue_bound)

    @property
    def replay_topic_frame(self) -> bool:
        if self.replay_layout == "auto":
            return self.encoding == "map"
        return self.replay_layout == "topic"


@dataclass
class PdConfig:
    """Prefill/decode disaggregation: this process's workers are prefill or decode engines
    that speak their flavor's protocol (vLLM's KV-connector ``kv_transfer_params``, SGLang's
    bootstrap host/port/room). A decode engine pulls the prompt's KV that it does not hold
    from the prefill engine, taking ``transfer_overhead_ms`` plus ``transfer_us_per_token``
    per token moved (both divided by ``timing.speedup``)."""

    role: Literal["", "prefill", "decode"] = ""
    transfer_us_per_token: float = 5.0  # ~160 KiB/token (70B FP8) over ~32 GB/s
    transfer_overhead_ms: float = 2.0
    wait_timeout: float = 30.0  # a decode engine waits this long for the prefill's KV

    def __post_init__(self) -> None:
        if self.role not in ("", "prefill", "decode"):
            raise ConfigError(f"pd.role must be prefill, decode or empty, got {self.role!r}")
        _positive("pd", wait_timeout=self.wait_timeout)
        if self.transfer_us_per_token < 0 or self.transfer_overhead_ms < 0:
            raise ConfigError("pd transfer costs must be >= 0")


@dataclass
class SimConfig:
    """``workers`` simulated engines in one process.

    Ports: with ``base_port`` P, N workers and D data-parallel ranks, worker i serves HTTP on
    P+i, rank r publishes KV events on P+N+i*D+r and answers replay on P+N+N*D+i*D+r (with
    D = 1: P+N+i and P+2N+i). ``base_port`` 0 picks free ports.
    """

    workers: int = 1
    dp_size: int = 1  # data-parallel ranks per worker: each its own core, cache and publisher
    host: str = "127.0.0.1"
    base_port: int = 0
    admin_port: int | None = None  # cluster admin API (faults by worker index); 0 = any port
    flavor: Literal["vllm", "sglang"] = "vllm"
    model: str = "kvroute-sim"
    tokenizer: str | None = None  # tokenizer.json; None = the bundled test tokenizer
    chat_template: str | None = None  # name or path; None = the tokenizer's own or deepseek-v3
    tokenizer_cache_tokens: int = 4_000_000  # the incremental tokenizer cache's bound (token ids)
    output_text: str = " the"  # what generated tokens spell, repeated
    max_body_bytes: int = 32 * 1024 * 1024
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    pd: PdConfig = field(default_factory=PdConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.lora.adapters and self.flavor == "sglang" and self.events.encoding == "array":
            raise ConfigError(
                "lora.adapters: SGLang publishes lora_name from 0.5.22 on (map encoding); "
                "with events.encoding: array its LoRA blocks could not be told apart"
            )
        if self.model in self.lora.adapters:
            raise ConfigError(f"lora.adapters: {self.model!r} is the base model's name")
        _positive(
            "sim",
            workers=self.workers,
            dp_size=self.dp_size,
            max_body_bytes=self.max_body_bytes,
            tokenizer_cache_tokens=self.tokenizer_cache_tokens,
        )
        if not 0 <= self.base_port <= 65535 - (1 + 2 * self.dp_size) * self.workers:
            raise ValueError(
                f"base_port {self.base_port} leaves no room for {self.workers} workers"
            )
        if self.flavor == "sglang" and self.cache.kv_groups != [KvGroup()]:
            raise ConfigError(
                "cache.kv_groups is vLLM-only: SGLang has no KV-cache groups "
                "(use flavor: vllm, or leave cache.kv_groups unset)"
            )
        if self.flavor == "vllm" and self.cache.bigram_keys:
            raise ConfigError(
                "cache.bigram_keys is SGLang-only (EAGLE/MTP bigram radix keys); "
                "use flavor: sglang, or leave cache.bigram_keys unset"
            )

    @property
    def evict_whole_nodes(self) -> bool:
        if self.cache.eviction == "auto":
            return self.flavor == "sglang"
        return self.cache.eviction == "node"


def load_sim_config(
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SimConfig:
    """``SimConfig`` from a YAML file, ``KVROUTE_SIM_*`` variables and dotted overrides."""
    return load_config(
        SimConfig,
        file=file,
        env=os.environ if env is None else env,
        env_prefix=ENV_PREFIX,
        overrides=overrides,
    )
