"""The ``kvroute`` command as a process: stopping a command stops what it started."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from loadtest.harness import ChildProcess


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_to_the_demo_stops_every_process_it_started(tmp_path: Path) -> None:
    demo = ChildProcess.kvroute(
        ["demo", "--workers", "2", "--duration", "60", "--out-dir", str(tmp_path / "out")],
        "demo",
        tmp_path,
    ).start()
    try:
        demo.wait_for_log("kvroute @", timeout=90)  # the stack is up and load is running
        assert demo.proc is not None
        started = _children(demo.proc.pid)
        assert len(started) >= 4, started  # redis, the simulator, agents, the gateway
        os.kill(demo.proc.pid, signal.SIGTERM)  # the demo alone, as a supervisor would
        assert demo.proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while left := [p for p in started if _running(p)]:
            assert time.monotonic() < deadline, f"left running: {left}"
            time.sleep(0.1)
    finally:
        demo.kill()


def test_demo_table_and_verdict_keep_a_failed_system() -> None:
    """A system whose run failed (a peer that would not start) is a row saying so, not a
    crash of the whole demo."""
    from loadtest.demo import _side_by_side, _verdict

    ok = {"system": "kvroute", "hit_rate": 0.8, "ttft_p50_ms": 50.0, "ttft_p99_ms": 500.0,
          "throughput_rps": 1.0, "goodput": 1.0, "max_mean_load": 1.1, "failed": 0}  # fmt: skip
    bad = {"system": "vllm-router-kv_aware", "error": "ValueError: no"}
    rows = _side_by_side([ok, bad])
    assert rows[0]["hit rate"] == 0.8 and "run failed" in rows[1]["failed"]
    assert "the run failed (ValueError: no)" in _verdict(ok, [bad])
