"""``kvroute gateway``'s process: its listening sockets and its start-up failures."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from gateway.main import listen
from gateway.tokenization import bundled_test_tokenizer
from loadtest.harness import ChildProcess, RedisServer, free_port


def test_listen_binds_the_port_and_refuses_one_taken() -> None:
    (sock,) = listen("127.0.0.1", 0, reuse_port=False)
    try:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        assert not sock.getblocking()  # the event loop's to serve
        with socket.create_connection((host, port), timeout=2):
            pass  # listening: the kernel completes the handshake from the backlog
        with pytest.raises(OSError, match="in use"):
            listen("127.0.0.1", port, reuse_port=False)
        # N gateway processes on one port: each binds with SO_REUSEPORT
        (a,) = listen("127.0.0.1", 0, reuse_port=True)
        (b,) = listen("127.0.0.1", a.getsockname()[1], reuse_port=True)
        assert a.getsockname() == b.getsockname()
        a.close()
        b.close()
    finally:
        sock.close()


def test_listen_closes_what_it_bound_when_one_address_fails(monkeypatch) -> None:
    """``localhost`` may resolve to two addresses; if the second cannot be bound the first
    must not stay open (a restart would find the port taken by a leaked socket)."""
    infos = socket.getaddrinfo("127.0.0.1", 0, type=socket.SOCK_STREAM)
    opened: list[socket.socket] = []
    real = socket.socket

    def tracking(*args: object) -> socket.socket:
        s = real(*args)  # type: ignore[arg-type]
        opened.append(s)
        return s

    bad = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", 0))  # not this host's
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [infos[0], bad])
    monkeypatch.setattr(socket, "socket", tracking)
    with pytest.raises(OSError):
        listen("localhost", 0, reuse_port=False)
    assert len(opened) == 2 and all(s.fileno() == -1 for s in opened)


def test_a_gateway_on_a_taken_port_exits_and_says_why(
    logs: Path, redis_server: RedisServer
) -> None:
    config = logs / "gw.yaml"
    config.write_text(
        yaml.safe_dump({"pools": [{"model": "m", "tokenizer": str(bundled_test_tokenizer())}]})
    )
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        gw = ChildProcess.kvroute(
            ["gateway", "--config", str(config), "--port", str(port), "--redis", redis_server.url],
            "gw",
            logs,
        ).start()
        assert gw.proc is not None and gw.proc.wait(timeout=60) != 0
    text = gw.log_path.read_text()
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in text, text
    assert "Traceback" not in text and "kvroute gateway ready" not in text
