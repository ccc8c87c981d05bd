"""``kvroute sim`` as a process (port layout, ready line, clean stop), configuration
precedence, and a smoke run of ``kvroute bench sim``."""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

from gateway.contract.settings import ConfigError
from loadtest.benchmarks import sim as bench_sim
from loadtest.compare import CompareConfig, _cluster
from loadtest.enginesim import cli
from loadtest.harness import ChildProcess
from loadtest.stack import Stack, StackConfig


def contiguous_free_ports(n: int) -> int:
    """A base port with ``n`` consecutive free ports after it (held together while checked)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no run of free ports found")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_sim_process_port_layout_and_clean_stop(logs: Path) -> None:
    base = contiguous_free_ports(6)
    argv = ["sim", "--workers", "2", "--base-port", str(base), "--flavor", "sglang",
            "--tokenizer", "none", "--speedup", "100"]  # fmt: skip
    proc = ChildProcess.kvroute(argv, "sim", logs).start()
    try:
        proc.wait_for_log("sim ready", timeout=30)
        text = proc.log_path.read_text()
        lines = re.findall(r"worker (\d): http=\S+:(\d+) events=\S+:(\d+) replay=\S+:(\d+)", text)
        assert [tuple(map(int, x)) for x in lines] == [
            (0, base, base + 2, base + 4),
            (1, base + 1, base + 3, base + 5),
        ]
        with urllib.request.urlopen(f"http://127.0.0.1:{base + 1}/server_info", timeout=5) as r:
            info = json.load(r)
        assert info["kv_events"]["endpoint_port_base"] == base + 3
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        req = urllib.request.Request(f"http://127.0.0.1:{base}/generate", body.encode())
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.load(r)["meta_info"]["completion_tokens"] == 2
        proc.signal(signal.SIGTERM)
        assert proc.proc is not None and proc.proc.wait(timeout=10) == 0
    finally:
        proc.stop()


def test_port_in_use_is_a_clean_error(logs: Path) -> None:
    base = contiguous_free_ports(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base))
        taken.listen()
        proc = ChildProcess.kvroute(
            ["sim", "--base-port", str(base), "--tokenizer", "none"], "sim", logs
        ).start()
        assert proc.proc is not None and proc.proc.wait(timeout=20) == 1
    assert "address already in use" in proc.log_path.read_text()


def test_config_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_SIM_CACHE__KV_BLOCKS", "100")
    monkeypatch.setenv("KVROUTE_SIM_TIMING__PRESET", "seed-70b")
    assert cli.build_config(parse([])).cache.kv_blocks == 100
    cfg = cli.build_config(parse(["--set", "cache.kv_blocks=200", "--no-events"]))
    assert cfg.cache.kv_blocks == 200 and cfg.timing.preset == "seed-70b"
    assert not cfg.events.enabled
    cfg = cli.build_config(parse(["--set", "cache.kv_blocks=200", "--kv-blocks", "300"]))
    assert cfg.cache.kv_blocks == 300
    with pytest.raises(ConfigError, match="kv_blocks"):
        cli.build_config(parse(["--set", "cache.kv_blocks=-3"]))
    assert cli.run(parse(["--set", "cache.nonsense=1"])) == 2


def test_attention_reaches_every_engine_the_comparison_runs(tmp_path: Path) -> None:
    """``attention`` set on a comparison reaches its offline cluster (bounds, capacity) and
    the live sim processes (their ``--attention`` flag); a bad value is a config error."""
    cfg = cli.build_config(parse(["--timing", "seed-70b", "--attention", "sequence"]))
    assert cfg.timing.attention == "sequence"
    assert cli.build_config(parse([])).timing.attention == "batch"
    with pytest.raises(ConfigError, match="attention"):
        cli.build_config(parse(["--set", "timing.attention=tokens"]))
    args = Stack(StackConfig(attention="sequence", log_dir=tmp_path))._sim_args(2, 0, 0)
    assert args[args.index("--attention") + 1] == "sequence"
    compare_cfg = CompareConfig(timing="seed-70b", attention="sequence")
    assert _cluster(compare_cfg).timing_model().attention == "sequence"
    with pytest.raises(ValueError, match="attention"):
        _cluster(CompareConfig(attention="tokens")).timing_model()


def test_bench_sim_smoke() -> None:
    parser = argparse.ArgumentParser()
    bench_sim.add_arguments(parser)
    args = parser.parse_args(
        ["--workers", "2", "--requests", "40", "--concurrency", "8", "--core-requests", "300"]
    )
    out = bench_sim.run(args)
    assert out["req_per_s"] > 0 and out["cpu_ms_per_req"] > 0 and out["core_us_per_req"] > 0
    assert [r["scenario"] for r in out["table"]] == [
        "live, streamed",
        "live, non-streamed",
        "core only, virtual time",
    ]


def test_tokenizer_cache_is_bounded_by_its_setting() -> None:
    """The simulator tokenizes chats with the gateway's incremental cache; a long-running
    sim (soak, demo) must hold it to ``tokenizer_cache_tokens``, not grow without end."""
    from loadtest.enginesim.text import load_tokenizer

    cfg = cli.build_config(parse(["--set", "tokenizer_cache_tokens=3000"]))
    assert cfg.tokenizer_cache_tokens == 3000
    with pytest.raises(ConfigError, match="tokenizer_cache_tokens"):
        cli.build_config(parse(["--set", "tokenizer_cache_tokens=0"]))
    tk = load_tokenizer(None, None, cfg.tokenizer_cache_tokens)
    assert tk is not None
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "kv", "route", "cache"]
    for conv in range(40):  # many distinct conversations: far more tokens than the bound
        text = " ".join(rng.choice(words) for _ in range(200))
        tk.encode_chat(
            [{"role": "system", "content": f"conv {conv}"}, {"role": "user", "content": text}]
        )
    stats = tk.stats
    assert 0 < stats.tokens_cached <= 3000 and stats.evictions > 0
