"""The process harness the other end-to-end tests stand on."""

from __future__ import annotations

import socket
import sys

import pytest
import redis

from loadtest.harness import ChildProcess, HarnessError, RedisServer, free_ports


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


def test_child_process_log_and_failure(logs) -> None:
    ok = ChildProcess(
        [sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(30)"],
        "ok",
        logs,
    )
    ok.start()
    assert ok.wait_for_log("ready") == "ready"
    assert ok.stop() is not None and not ok.alive()
    bad = ChildProcess([sys.executable, "-c", "raise SystemExit(3)"], "bad", logs).start()
    with pytest.raises(HarnessError, match="exited"):
        bad.wait_for_log("never")
