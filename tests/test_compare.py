"""``kvroute loadtest compare`` on a small live cluster: every system's row, the report on
disk after every run, a failed system recorded without losing the others, and worker caches
reset only once the workers are idle."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from loadtest import compare
from loadtest.compare import CompareConfig, run_compare
from loadtest.stack import Stack, StackConfig


def small(tmp_path: Path, systems: list[str]) -> CompareConfig:
    return CompareConfig(
        workload="shared_prefix",
        params={
            "groups": 4,
            "prompts_per_group": 30,
            "prefix_tokens": 400,
            "question_tokens": 30,
            "output_tokens": 8,
        },
        loads=[0.5],
        capacity_rps=12.0,
        systems=systems,
        workers=2,
        kv_blocks=2048,
        speedup=10.0,
        duration=4.0,
        mode="completion",
        out_dir=str(tmp_path / "out"),
        progress=False,
    )


def test_compare_runs_kvroute_and_sglang_router_on_one_cluster(tmp_path: Path) -> None:
    report = run_compare(
        small(tmp_path, ["kvroute", "sglang-cache_aware"]), bound_hit_rate=0.9, reference=None
    )
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"kvroute", "sglang-cache_aware"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["failed"] == 0 and r["requests"] > 10 and r["load"] == 0.5 and r["rate"] == 6.0
        assert 0 < r["hit_rate"] <= 1 and r["ttft_p50_ms"] > 0 and r["max_mean_load"] >= 1
        assert sum(w["requests"] for w in r["per_worker"].values()) >= r["requests"]
    out = Path(report["config"]["out_dir"])
    on_disk = json.loads((out / "compare.json").read_text())
    assert [r["system"] for r in on_disk["results"]] == ["kvroute", "sglang-cache_aware"]
    assert on_disk["bound_hit_rate"] == 0.9
    md = (out / "compare.md").read_text()
    assert "| kvroute " in md and "| sglang-cache_aware " in md
    assert report["plots"] and all(Path(p).stat().st_size > 0 for p in report["plots"])


def test_a_failing_system_is_recorded_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("sglang-router: command not found")

    monkeypatch.setattr(compare, "sglang_router", missing)
    report = run_compare(
        small(tmp_path, ["sglang-cache_aware", "kvroute-round_robin"]), reference=None
    )
    failed, ok = report["results"]
    assert failed["system"] == "sglang-cache_aware" and "command not found" in failed["error"]
    assert ok["system"] == "kvroute-round_robin" and "error" not in ok and ok["failed"] == 0
    out = Path(report["config"]["out_dir"])
    assert "run failed: FileNotFoundError" in (out / "compare.md").read_text()
    assert len(json.loads((out / "compare.json").read_text())["results"]) == 2


def test_caches_are_reset_only_once_the_workers_are_idle(tmp_path: Path) -> None:
    """The engines refuse a prefix-cache reset while requests run (as vLLM does), and a
    request still running would cache blocks again: after an overloaded run the reset
    waits for the backlog to drain."""
    cfg = StackConfig(workers=2, speedup=1.0, kv_blocks=2048, log_dir=tmp_path)
    with Stack(cfg) as stack:
        body = json.dumps({"model": cfg.model, "prompt": "word " * 300, "max_tokens": 150})
        req = urllib.request.Request(
            stack.gateway_urls[0] + "/v1/completions",
            data=body.encode(),
            headers={"content-type": "application/json"},
        )
        done: list[int] = []

        def send() -> None:
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()
                done.append(resp.status)

        t = threading.Thread(target=send)
        t.start()
        deadline = time.monotonic() + 30
        while compare._busy_requests(stack.worker_urls) == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        compare._reset_workers(stack, timeout=60)
        assert done == [200]  # the reset waited for the running request
        assert all(w["index_blocks"] == 0 for w in stack.workers())
        t.join(5)
