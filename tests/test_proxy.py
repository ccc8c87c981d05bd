"""The proxy's upstream session: how it reaches workers named by hostname."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, ClassVar

import aiohttp
import pytest
from aiohttp.abc import AbstractResolver

from gateway.config import ProxySettings
from gateway.proxy import Proxy, TimedResolver
from loadtest.harness import free_port


class _Hanging(AbstractResolver):
    """A DNS server that never answers (CoreDNS overloaded, a dropped UDP packet)."""

    asked: ClassVar[list[str]] = []

    async def resolve(self, host: str, port: int = 0, family: Any = socket.AF_INET) -> Any:
        self.asked.append(host)
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


async def test_a_hanging_dns_lookup_fails_over_like_a_refused_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker named by hostname whose lookup never answers fails as a connection error
    (the proxy's "connect" retry: another worker takes the request) after connect_timeout,
    not after first_byte_timeout (120 s); an IP literal never asks the resolver."""
    monkeypatch.setattr(aiohttp, "DefaultResolver", _Hanging)
    _Hanging.asked = []
    proxy = Proxy(ProxySettings(connect_timeout=0.2), registry=None, metrics=None)  # type: ignore[arg-type]
    await proxy.start()
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()
        with pytest.raises(aiohttp.ClientConnectorError, match=r"no answer in 0\.2s"):
            await proxy.session.post("http://worker-0.engines.test:8000/v1/completions", data=b"{}")
        assert 0.2 <= loop.time() - t0 < 5.0
        assert _Hanging.asked == ["worker-0.engines.test"]
        with pytest.raises(aiohttp.ClientConnectorError) as refused:  # nothing listens there
            await proxy.session.post(f"http://127.0.0.1:{free_port()}/v1/completions", data=b"{}")
        assert not isinstance(refused.value, aiohttp.ClientConnectorDNSError)
        assert _Hanging.asked == ["worker-0.engines.test"]
    finally:
        await proxy.close()


async def test_timed_resolver_answers_through_the_default_one() -> None:
    resolver = TimedResolver(2.0)
    try:
        (first, *_) = await resolver.resolve("localhost", 80, socket.AF_INET)
        assert first["host"] == "127.0.0.1" and first["port"] == 80
    finally:
        await resolver.close()


async def test_drain_reads_a_finished_stream_to_its_end_and_gives_up_on_a_trickle() -> None:
    """After a stream's last event the proxy reads the body's end, so the connection is kept;
    a worker that keeps the body open past ``timeout`` is left (its connection closed)."""
    from aiohttp import web

    from gateway.proxy import _drain

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        if request.query["trickle"] == "1":
            with contextlib.suppress(ConnectionResetError):  # the client leaves
                for _ in range(100):  # more bytes now and then, never the end
                    await asyncio.sleep(0.05)
                    await resp.write(b": still here\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession() as session:
            for trickle in (False, True):
                async with session.get(f"http://127.0.0.1:{port}/?trickle={int(trickle)}") as r:
                    assert (await r.content.readany()).startswith(b"data: [DONE]")
                    t0 = loop.time()
                    await _drain(r.content, 0.3)
                    took = loop.time() - t0
                    assert r.content.at_eof() is not trickle
                    assert (0.3 <= took < 2.0) if trickle else took < 0.3
    finally:
        await runner.cleanup()
