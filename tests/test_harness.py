"""The process harness the other end-to-end tests stand on."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from unittest import mock

import pytest
import redis
import yaml

from gateway.tokenization import bundled_test_tokenizer
from loadtest import harness
from loadtest.harness import ChildProcess, HarnessError, RedisServer, free_port, free_ports


def test_redis_server_kill_and_restart_keeps_port(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    assert r.ping()
    r.set("x", "1")
    redis_server.kill()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(redis_server.url, socket_connect_timeout=0.5).ping()
    redis_server.start()
    assert r.ping()
    assert r.get("x") is None  # nothing persisted: a kill loses everything


def test_redis_password(tmp_path) -> None:
    with RedisServer(password="s3cret", workdir=tmp_path) as srv:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=srv.port).ping()
        assert redis.Redis.from_url(srv.url).ping()


def test_free_ports_distinct() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_free_ports_stay_out_of_the_ephemeral_range() -> None:
    """Ports for child servers come from below the kernel's ephemeral range (where outgoing
    connections and bind(0) cannot take them before the child binds), skip a port in use,
    and fall back to the kernel's choice when that range is unknown."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(10_000 <= p < low for p in free_ports(20))
    busy = free_port()
    with (
        socket.socket() as held,
        mock.patch.object(harness, "_listen_range", return_value=range(busy, busy + 1)),
    ):
        held.bind(("127.0.0.1", busy))  # the only candidate is in use: the kernel's choice
        port = free_port()
        assert port != busy and port >= low
    with mock.patch.object(harness, "_listen_range", return_value=range(0)):
        assert free_port() >= low
    ports = free_ports(30)  # distinct because each call passes the others as `taken`
    assert len(set(ports)) == 30


def test_child_process_log_and_failure(logs) -> None:
    ok = ChildProcess(
        [sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(30)"],
        "ok",
        logs,
    )
    ok.start()
    assert ok.wait_for_log("ready") == "ready"
    assert ok.stop() is not None and not ok.alive()
    # two replicas sharing a log can write their lines into one (PYTHONUNBUFFERED: a print's
    # text and newline are two writes): each occurrence counts
    shared = ChildProcess(
        [sys.executable, "-c", "print('up 1up 2\\n'); import time; time.sleep(30)"],
        "shared",
        logs,
    ).start()
    assert shared.wait_for_log("up", count=2) == "up 1up 2"
    with pytest.raises(HarnessError, match="logged 'up' 2 of 3 times"):
        shared.wait_for_log("up", count=3, timeout=0.3)
    shared.stop()
    bad = ChildProcess([sys.executable, "-c", "raise SystemExit(3)"], "bad", logs).start()
    with pytest.raises(HarnessError, match="exited"):
        bad.wait_for_log("never")


def test_a_kvroute_process_that_misses_its_deadline_reports_its_stacks(
    logs: Path, redis_server: RedisServer
) -> None:
    """A start-up that hangs is diagnosed from CI's log alone: the error carries the stuck
    kvroute process's thread stacks (its SIGUSR1 handler), and a command that is not kvroute
    is not sent that signal (by default it would die of it)."""
    config = logs / "gw.yaml"
    pool = {"model": "m", "tokenizer": str(bundled_test_tokenizer())}
    config.write_text(yaml.safe_dump({"pools": [pool]}))
    gw = ChildProcess.kvroute(
        [
            "gateway",
            "--config",
            str(config),
            "--port",
            str(free_port()),
            "--redis",
            redis_server.url,
        ],
        "gw",
        logs,
    ).start()
    try:
        gw.wait_for_log("kvroute gateway ready", timeout=60)
        with pytest.raises(HarnessError) as err:
            gw.wait_for_log("a line it never writes", timeout=0.5)
        text = str(err.value)
        stacks = text.split("its stacks:")[1]
        assert "most recent call first" in stacks and "in _run_loop" in stacks, text
        # where each task waits, down to the innermost await: serve waits for its stop
        assert "main.py" in stacks and " in serve" in stacks and " in wait" in stacks, text
        assert gw.alive()  # the dump does not stop it
    finally:
        gw.stop()
    other = ChildProcess(
        [sys.executable, "-c", "print('up', flush=True); import time; time.sleep(30)"],
        "other",
        logs,
    ).start()
    try:
        other.wait_for_log("up")
        with pytest.raises(HarnessError) as err:
            other.wait_for_log("never", timeout=0.2)
        assert "stacks" not in str(err.value) and other.alive()
    finally:
        other.stop()


def test_a_gateway_that_never_gets_ready_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway that misses its ready line is not yet one of the stack's processes, so the
    stack's stop() cannot reach it: start_gateway must stop it itself (one had kept running,
    a supervisor and its two replicas, through the rest of a test run)."""
    from loadtest.stack import Stack, StackConfig

    with Stack(StackConfig(workers=1, speedup=100, log_dir=tmp_path)) as stack:
        started: list[ChildProcess] = []
        real_start = ChildProcess.start

        def start(self: ChildProcess) -> ChildProcess:
            started.append(self)
            return real_start(self)

        def never(self: ChildProcess, needle: str, timeout: float = 20.0, count: int = 1) -> str:
            raise HarnessError(f"{self.name} never logged {needle!r}")

        monkeypatch.setattr(ChildProcess, "start", start)
        monkeypatch.setattr(ChildProcess, "wait_for_log", never)
        with pytest.raises(HarnessError, match="never logged"):
            stack.start_gateway(1)
        (gw,) = started
        assert gw.proc is not None and gw.proc.poll() is not None  # stopped, not left running
        assert len(stack.gateways) == 1
