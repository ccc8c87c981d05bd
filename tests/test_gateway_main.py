"""``kvroute gateway``'s process: its listening sockets and its start-up failures."""

from __future__ import annotations

import asyncio
import gc
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import GatewayConfig
from gateway.contract.settings import load_config
from gateway.main import listen, serve
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


class _NoLoopResolver(asyncio.SelectorEventLoop):
    """A loop on which a start-up that resolves or binds through the loop fails."""

    async def getaddrinfo(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"resolved through the loop: {args}")

    async def create_server(self, *args: Any, sock: Any = None, **kwargs: Any) -> Any:
        assert sock is not None, "the loop was asked to bind"
        return await super().create_server(*args, sock=sock, **kwargs)


def test_serve_opens_its_ports_without_the_loops_resolver(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The ready line must not wait on the loop's resolver (uvloop runs it on libuv's thread
    pool, even for 127.0.0.1): ``serve`` binds its sockets itself, API and metrics alike,
    and answers on both."""
    port, metrics_port = free_port(), free_port()
    file = tmp_path / "gw.yaml"
    file.write_text(
        yaml.safe_dump(
            {
                "server": {"port": port, "metrics_port": metrics_port},
                "redis": {"url": redis_server.url},
                "pools": [{"model": "m", "tokenizer": str(bundled_test_tokenizer())}],
            }
        )
    )
    cfg = load_config(GatewayConfig, file=file)
    cfg.validate()

    async def status(p: int, path: str) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", p)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        line = await reader.readline()
        writer.close()
        return int(line.split()[1])

    async def main() -> tuple[int, int]:
        stop = asyncio.Event()
        served = asyncio.create_task(serve(cfg, stop=stop))
        try:
            for _ in range(200):  # the port opens once start-up is done
                if served.done():
                    served.result()  # start-up failed: its error
                try:
                    return await status(port, "/health"), await status(metrics_port, "/metrics")
                except ConnectionRefusedError:
                    await asyncio.sleep(0.05)
            raise AssertionError("the gateway never opened its port")
        finally:
            stop.set()
            await served

    with asyncio.Runner(loop_factory=_NoLoopResolver) as runner:
        assert runner.run(main()) == (200, 200)
    assert gc.get_freeze_count() == 0  # a caller's process is left as it was


def test_the_gateways_process_freezes_its_start_up_heap(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """``serve(freeze_heap=True)`` (the gateway's own process) takes what start-up built (the
    tokenizer's tables, the app) out of the cyclic collector's view once it can answer, so a
    full collection walks only what serving created, and serves with the collector's young
    threshold of its settings (``server.gc_young_threshold``)."""
    port = free_port()
    file = tmp_path / "gw.yaml"
    file.write_text(
        yaml.safe_dump(
            {
                "server": {"port": port, "gc_young_threshold": 4321},
                "redis": {"url": redis_server.url},
                "pools": [{"model": "m", "tokenizer": str(bundled_test_tokenizer())}],
            }
        )
    )
    cfg = load_config(GatewayConfig, file=file)
    cfg.validate()

    async def main() -> tuple[int, tuple[int, ...]]:
        stop = asyncio.Event()
        served = asyncio.create_task(serve(cfg, stop=stop, freeze_heap=True))
        try:
            for _ in range(200):
                if served.done():
                    served.result()
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except ConnectionRefusedError:
                    await asyncio.sleep(0.05)
                    continue
                writer.close()
                return gc.get_freeze_count(), gc.get_threshold()
            raise AssertionError("the gateway never opened its port")
        finally:
            stop.set()
            await served

    assert gc.get_freeze_count() == 0
    before = gc.get_threshold()
    try:
        frozen, threshold = asyncio.run(main())
        assert frozen > 10_000  # the app, the tokenizer's templates and tables: tens of thousands
        assert threshold == (4321, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)  # the test process's own collector, as it was
