"""The proxy's upstream session (how it reaches workers named by hostname) and the end of a
relayed stream (the worker's body read to its end; a client that leaves once answered)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from chat_helpers import text

from gateway.config import GatewayConfig, PoolSettings, ProxySettings, StaticWorker
from gateway.proxy import Proxy, TimedResolver
from gateway.server import Gateway, build_app
from gateway.tokenization import bundled_test_tokenizer
from loadtest.harness import free_port


class _Hanging(AbstractResolver):
    """A DNS server that never answers (CoreDNS overloaded, a dropped UDP packet)."""

    asked: ClassVar[list[str]] = []

    async def resolve(self, host: str, port: int = 0, family: Any = socket.AF_INET) -> Any:
        self.asked.append(host)
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


@pytest.mark.alone
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


@pytest.mark.alone
async def test_drain_reads_a_finished_stream_to_its_end_and_gives_up_on_a_trickle() -> None:
    """After a stream's last event the proxy reads the body's end, so the connection is kept;
    a worker that keeps the body open past ``timeout`` is left (its connection closed)."""
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


async def test_a_client_that_leaves_after_its_whole_streamed_answer_was_served() -> None:
    """The client reads its stream to ``[DONE]`` and closes its connection while the worker
    still holds the body open (its chunked end not sent yet): aiohttp cancels the handler in
    the proxy's drain. The request was served: its usage is still observed (the worker's
    precision), as when the client stays; before, the observation was lost. Here the whole
    answer comes in the worker's first chunk, which ends the client's body at once too (it
    used to wait for the worker's end)."""
    held = asyncio.Event()

    async def completion(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
                 "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
        for event in (
            {"choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]},
            {"choices": [], "usage": usage},
        ):
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        held.set()
        with contextlib.suppress(ConnectionResetError):
            await asyncio.sleep(3)  # the body's end comes late (a busy engine)
            await resp.write_eof()
        return resp

    gw, port, runners = await _gateway_over(completion)
    loop = asyncio.get_running_loop()
    try:
        body = {"model": "m", "prompt": "hello there", "max_tokens": 1, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
            assert resp.status == 200, await resp.text()
            seen = b""
            while b"data: [DONE]" not in seen:
                seen += await resp.content.readany()
            assert held.is_set() and b'"usage"' in seen
            resp.close()  # the client leaves: its connection closes with the body still open
        deadline = loop.time() + 2.0  # before the engine ends its body (3 s)
        while "w1" not in gw.registry.trust.tallies:
            assert loop.time() < deadline, "the served request was never observed"
            await asyncio.sleep(0.01)
        assert gw.registry.trust.tallies["w1"].reported_any is False  # cached 0, predicted 0
    finally:
        for r in runners:
            await r.cleanup()


async def test_an_sglang_pair_whose_client_leaves_after_its_answer_still_reads_the_prefill() -> (
    None
):
    """SGLang's prefill server ends its answer after the KV transfer, so the decode half can
    finish first. When the client's handler is cancelled once the decode half has answered
    (the client had everything and left), the prefill half is not cancelled with it: it is
    read to its end off the client's path (it carries that worker's reuse), and the
    cancellation still reaches the caller. When the decode half has not answered, both halves
    are cancelled."""
    from types import SimpleNamespace

    proxy = Proxy(ProxySettings(), registry=None, metrics=None)  # type: ignore[arg-type]
    proxy.registry = SimpleNamespace(  # type: ignore[assignment]
        workers={
            "p1": SimpleNamespace(
                url="http://127.0.0.1:1", info=SimpleNamespace(bootstrap_port=8998)
            )
        }
    )
    release, waiting = asyncio.Event(), asyncio.Event()
    halves: dict[str, str] = {}
    caller: list[asyncio.Task[Any]] = []

    async def prefill(
        pool: Any, prep: Any, path: str, pair: bytes, headers: Any, d: Any
    ) -> dict[str, Any]:
        assert json.loads(pair)["bootstrap_port"] == 8998
        try:
            await release.wait()
        except asyncio.CancelledError:
            halves["prefill"] = "cancelled"
            raise
        halves["prefill"] = "read to its end"
        return {}

    async def decode(*args: Any) -> str:
        if halves.get("mode") == "answered":
            caller[0].cancel()  # the client leaves as its answer completes
            return "answer"
        waiting.set()
        await asyncio.Event().wait()  # the client leaves before any answer
        raise AssertionError("unreachable")

    proxy._prefill = prefill  # type: ignore[method-assign]
    proxy._decode = decode  # type: ignore[method-assign]
    decision = SimpleNamespace(worker="p1")

    def pair() -> asyncio.Task[Any]:
        return asyncio.ensure_future(
            proxy._pair_sglang(None, None, None, None, "/v1/completions", b'{"prompt": "x"}',  # type: ignore[arg-type]
                               {}, decision, decision, False)  # type: ignore[arg-type]
        )  # fmt: skip

    halves["mode"] = "answered"
    caller.append(pair())
    with pytest.raises(asyncio.CancelledError):
        await caller[0]
    assert "prefill" not in halves and len(proxy._prefills) == 1  # still being read
    (left,) = proxy._prefills
    release.set()
    await left
    assert halves["prefill"] == "read to its end" and not proxy._prefills

    halves.clear()
    release.clear()
    caller[:] = [pair()]
    await waiting.wait()  # the decode half waits for its answer (the prefill half started first)
    caller[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller[0]
    assert halves == {"prefill": "cancelled"} and not proxy._prefills


async def test_a_client_that_leaves_mid_stream_is_no_gateway_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client closes its connection while the worker is still streaming. When the
    proxy's next write to it fails before aiohttp cancels the handler (a race under load;
    made certain here by running without handler cancellation), that is the client leaving:
    the worker's side is closed at once (the engine stops generating), the request leaves
    the load view, the worker is not blamed, and nothing is logged as a gateway error (it
    was an ERROR with a traceback from aiohttp, measured on the trace-production preset)."""
    engine_saw_the_end = asyncio.Event()

    async def completion(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        event = {"choices": [{"index": 0, "text": "token ", "finish_reason": None}]}
        try:
            for _ in range(2000):  # bounded: 20 s at most
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await asyncio.sleep(0.01)
        except ConnectionResetError:  # the gateway closed its side: stop generating
            engine_saw_the_end.set()
        return resp

    gw, port, runners = await _gateway_over(completion, handler_cancellation=False)
    try:
        body = {"model": "m", "prompt": "hello there", "max_tokens": 2000, "stream": True}
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
            assert resp.status == 200, await resp.text()
            assert b"data: " in await resp.content.readany()
            resp.close()  # the client leaves mid-stream
        await asyncio.wait_for(engine_saw_the_end.wait(), 5.0)
        router = gw.pools[0].router
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while router.loads.inflight_total():
            assert loop.time() < deadline, "the request never left the load view"
            await asyncio.sleep(0.01)
        assert gw.registry.workers["w1"].circuit.failures == 0
        exposition = gw.metrics.exposition().decode()
        assert 'code="5xx"' not in exposition and 'code="4xx"' not in exposition
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
    finally:
        for r in runners:
            await r.cleanup()


async def _gateway_over(
    completion: Callable[[web.Request], Awaitable[web.StreamResponse]],
    *,
    handler_cancellation: bool = True,
) -> tuple[Gateway, int, list[web.AppRunner]]:
    """An engine answering ``/v1/completions`` with ``completion`` and a gateway in front of
    it (handler cancellation on, as ``kvroute gateway`` runs), both on loopback: the gateway,
    its port, and the runners to clean up (the gateway's first)."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    engine = web.Application()
    engine.router.add_post("/v1/completions", completion)
    engine.router.add_get("/health", health)
    engine_runner = web.AppRunner(engine)
    await engine_runner.setup()
    engine_port = free_port()
    await web.TCPSite(engine_runner, "127.0.0.1", engine_port).start()
    pool = PoolSettings(
        model="m",
        tokenizer=str(bundled_test_tokenizer()),
        static_workers=[StaticWorker(f"http://127.0.0.1:{engine_port}", "w1")],
    )
    gw = Gateway(GatewayConfig(pools=[pool]))
    runner = web.AppRunner(build_app(gw), handler_cancellation=handler_cancellation)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return gw, port, [runner, engine_runner]


async def test_a_connection_reset_while_the_client_is_connected_is_still_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only a reset of the client's own closing connection is the client leaving: one from
    anywhere else, with the client still there, is answered 500 and logged."""

    async def reset(request: web.Request) -> web.Response:
        raise ConnectionResetError("a peer of the gateway reset its connection")

    pool = PoolSettings(
        model="m",
        tokenizer=str(bundled_test_tokenizer()),
        static_workers=[StaticWorker(f"http://127.0.0.1:{free_port()}", "w1")],
    )
    app = build_app(Gateway(GatewayConfig(pools=[pool])))
    app.router.add_get("/v1/boom", reset)  # behind the gateway's middleware
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/v1/boom") as resp,
        ):
            assert resp.status == 500
        assert any(r.levelno >= logging.ERROR for r in caplog.records)
    finally:
        await runner.cleanup()


async def test_precision_counts_only_the_predictions_the_engine_answered() -> None:
    """Index precision is agreed over predicted tokens of the requests whose usage the
    engine reported. A client that leaves mid-stream takes the answer with it: its
    prediction is routed (``kvroute_predicted_matched_tokens_total``) but never checked, and
    counting it read as imprecision (0.81 on a trace past capacity, where the load driver
    cancels the runs' last requests)."""
    calls: list[str] = []

    async def completion(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        calls.append(body["prompt"])
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        event = {"choices": [{"index": 0, "text": "token ", "finish_reason": None}]}
        if len(calls) == 2:  # the second request streams until its client leaves
            with contextlib.suppress(ConnectionResetError):
                for _ in range(2000):  # bounded: 20 s at most
                    await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    await asyncio.sleep(0.01)
            return resp
        usage = {"prompt_tokens": 4096, "completion_tokens": 1, "total_tokens": 4097,
                 "prompt_tokens_details": {"cached_tokens": 0 if len(calls) == 1 else 4096}}  # fmt: skip
        for e in (event, {"choices": [], "usage": usage}):
            await resp.write(b"data: " + json.dumps(e).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    gw, port, runners = await _gateway_over(completion)

    def series(name: str) -> float:
        total = 0.0
        for line in gw.metrics.exposition().decode().splitlines():
            if line.startswith(name + "{") and 'worker="w1"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    predicted = "kvroute_predicted_matched_tokens_total"
    checked = "kvroute_checked_predicted_tokens_total"
    agreed = "kvroute_agreed_cached_tokens_total"
    prompt = " ".join(f"word{i}" for i in range(600))
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status == 200 and b'"usage"' in await r.read()
            # the gateway speculated the first prompt onto w1: the second is predicted cached
            resp = await session.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
            assert resp.status == 200 and b"data: " in await resp.content.readany()
            resp.close()  # the client leaves mid-stream: no usage
            deadline = loop.time() + 5.0
            while gw.pools[0].router.loads.inflight_total():
                assert loop.time() < deadline, "the request never left the load view"
                await asyncio.sleep(0.01)
            left = series(predicted)
            assert left > 0 and series(checked) == 0 == series(agreed)
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status == 200 and b'"usage"' in await r.read()
        assert series(predicted) > left  # the third was predicted cached too
        assert series(checked) == series(predicted) - left == series(agreed)  # precision 1
        assert gw.registry.trust.precision("w1", gw.clock()) == 1.0
        assert len(calls) == 3
    finally:
        for r in runners:
            await r.cleanup()


async def test_the_wait_for_an_overlapped_prompts_exact_ids_is_measured() -> None:
    """A cold completion prompt is routed on its first piece while the rest is encoded; its
    first chunk is held until the exact ids are there. That hold is the overlap's price in
    latency, observed per request (0 when the ids were ready before the first token)."""
    encoded, answered = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def completion(request: web.Request) -> web.StreamResponse:
        await request.read()
        if len(order) == 1:  # the second request: answered once its ids are encoded
            await asyncio.wait_for(encoded.wait(), 5.0)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        event = {"choices": [{"index": 0, "text": "token ", "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        order.append("answered")
        answered.set()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    gw, port, runners = await _gateway_over(completion)
    tok = gw.pools[0].tokenizer
    encode = tok.aencode_planned

    async def slow_first(*args: Any, **kwargs: Any) -> Any:
        if not order:  # the first request: its rest is encoded after its first chunk came
            await asyncio.wait_for(answered.wait(), 5.0)
            await asyncio.sleep(0.05)  # held: the wait below is at least this long
        ids = await encode(*args, **kwargs)
        encoded.set()
        return ids

    tok.aencode_planned = slow_first  # type: ignore[method-assign]

    def wait_series(suffix: str, label: str = "", base: str = "overlap_wait_seconds") -> float:
        name = "kvroute_tokenization_" + base + suffix
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in gw.metrics.exposition().decode().splitlines()
            if line.startswith(name + "{") and label in line
        )

    try:
        async with aiohttp.ClientSession() as session:
            for seed in (1, 2):  # two cold prompts, nothing shared
                prompt = text(random.Random(seed), 900)  # cut in pieces: routed on the first
                body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200 and b"token" in await r.read()
                if seed == 1:
                    assert wait_series("_count") == 1 and wait_series("_sum") >= 0.05
                    answered.clear()
                    encoded.clear()  # the second is answered after its own encode
        assert wait_series("_total", base="overlapped") == 2  # both routed on a first piece
        assert wait_series("_count") == 2  # both overlapped, both observed
        assert wait_series("_bucket", 'le="0.0"') == 1  # the second never waited
        assert 0.05 <= wait_series("_sum") < 5.0
    finally:
        for r in runners:
            await r.cleanup()
