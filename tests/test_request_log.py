"""The gateway's request log: what a record holds, and that writing never blocks or fails a
request (bounded queue, write errors counted, a clear error for an unwritable path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gateway.config import RequestLogSettings
from gateway.metrics import GatewayMetrics
from gateway.proxy import Usage
from gateway.request_log import RequestLog, RequestLogError, process_path
from gateway.routing.policy import Decision

DECISION = Decision("worker-1", "prefix", "cache", 32, None)


def until(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def make(path: str, **kw: object) -> tuple[RequestLog, GatewayMetrics]:
    m = GatewayMetrics()
    return RequestLog(RequestLogSettings(path=path, **kw), "seed", m), m  # type: ignore[arg-type]


def counter(m: GatewayMetrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels or None)
    return v or 0.0


def record(rl: RequestLog, keys: list[int], session: str | None = None) -> None:
    rl.record(
        "sim-model", 16, keys, 40, DECISION, ["worker-0", "worker-1"], 0.0,
        Usage(40, 32, 7), 200, session,
    )  # fmt: skip


def test_a_record_holds_rehashed_keys_lengths_and_the_decision_never_text(tmp_path: Path) -> None:
    path = tmp_path / "req.jsonl"
    rl, m = make(str(path))
    rl.open()
    record(rl, [11, 22], session="alice@example.com")
    record(rl, [11, 33])
    rl.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    a, b = (json.loads(x) for x in lines)
    assert a["keys"][0] == b["keys"][0] != a["keys"][1] != b["keys"][1]  # the chain survives
    assert all(len(k) == 16 and int(k, 16) not in (11, 22, 33) for k in a["keys"] + b["keys"])
    assert (a["prompt_tokens"], a["output_tokens"], a["cached_tokens"]) == (40, 7, 32)
    assert (a["worker"], a["policy"], a["reason"], a["matched_tokens"]) == (
        "worker-1", "prefix", "cache", 32,
    )  # fmt: skip
    assert a["workers"] == ["worker-0", "worker-1"] and a["pool"] == "sim-model"
    assert abs(a["t"] - time.time()) < 60
    assert "alice" not in lines[0] and a["session"] and b["session"] is None
    assert counter(m, "kvroute_request_log_records_total") == 2
    # another salt: keys that do not join with this log's (nor with the live index)
    other = RequestLog(RequestLogSettings(path=str(path), salt="other"), "seed")
    other.open()
    record(other, [11, 22])
    other.close()
    c = json.loads(path.read_text().splitlines()[2])
    assert set(c["keys"]).isdisjoint(a["keys"])


@pytest.mark.alone
def test_a_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    rl, m = make(str(tmp_path / "q.jsonl"), queue_size=2)  # writer not started: nothing drains
    t0 = time.perf_counter()
    for _ in range(5):
        record(rl, [1, 2])
    assert time.perf_counter() - t0 < 0.5
    assert rl.dropped["queue_full"] == 3
    assert counter(m, "kvroute_request_log_dropped_total", cause="queue_full") == 3


def test_write_errors_are_counted_and_the_writer_keeps_going() -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    rl, m = make("/dev/full")  # opens fine, every write fails with ENOSPC (a full disk)
    rl.open()
    for _ in range(3):
        record(rl, [1, 2])
    until(lambda: rl.dropped["write_error"] >= 1)
    record(rl, [3])  # still accepted, never raises
    rl.close()
    assert rl.written == 0
    assert counter(m, "kvroute_request_log_dropped_total", cause="write_error") >= 1


def test_an_unwritable_path_is_a_clear_error(tmp_path: Path) -> None:
    rl, _ = make(str(tmp_path / "missing-dir" / "req.jsonl"))
    with pytest.raises(RequestLogError, match=r"request_log\.path: cannot append to .*missing-dir"):
        rl.open()


def test_rotation_keeps_backups(tmp_path: Path) -> None:
    path = tmp_path / "rot.jsonl"
    rl, _ = make(str(path), max_bytes=300, backups=2)
    rl.open()
    for i in range(12):
        record(rl, [i, i + 1])
        until(lambda i=i: rl.written == i + 1)
    rl.close()
    assert Path(f"{path}.1").exists() and Path(f"{path}.2").exists()
    assert not Path(f"{path}.3").exists()
    total = sum(len(p.read_text().splitlines()) for p in tmp_path.glob("rot.jsonl*"))
    assert 0 < total <= 12


def test_sampling_and_per_process_files(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    rl, _ = make(str(path), sample=0.0)
    rl.open()
    record(rl, [1])
    rl.close()
    assert path.read_text() == ""
    assert process_path("x.jsonl", None) == "x.jsonl"
    assert process_path("x.jsonl", 3) == "x.jsonl.3"


def test_gateway_refuses_to_start_with_an_unwritable_request_log(tmp_path: Path) -> None:
    cfg = {
        "pools": [{"model": "m", "tokenizer": "unused", "static_workers": [{"url": "http://x"}]}],
        "request_log": {"path": str(tmp_path / "nope" / "req.jsonl")},
    }
    conf = tmp_path / "gw.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    res = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "gateway", "--config", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "request_log.path: cannot append to" in res.stderr
