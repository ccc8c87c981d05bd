"""The warmer (gateway/warmup.py) against a real HTTP upstream on loopback: what it sends,
what it counts, and every way a warm-up fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from gateway.config import WarmupSettings
from gateway.metrics import GatewayMetrics
from gateway.pool import Pool
from gateway.routing.load import LoadTracker
from gateway.routing.replication import WarmupIntent
from gateway.warmup import Target, Warmer
from loadtest.harness import free_port

W = "worker-0"


class Upstream:
    """A worker's /v1/completions: answers ``status``, or holds the request until released."""

    def __init__(self) -> None:
        self.status = 200
        self.hold = False
        self.bodies: list[dict[str, Any]] = []
        self.rank_headers: list[str | None] = []
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.url = ""

    async def completions(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        self.rank_headers.append(request.headers.get("X-data-parallel-rank"))
        self.arrived.set()
        if self.hold:
            await self.release.wait()
        return web.json_response({"choices": [{"text": "x"}]}, status=self.status)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    app = web.Application()
    app.router.add_post("/v1/completions", up.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    up.url = f"http://127.0.0.1:{port}"
    yield up
    up.release.set()
    await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def fake_pool() -> Pool:
    loads = LoadTracker()
    loads.add_worker(W)
    return cast(Pool, SimpleNamespace(name="m", router=SimpleNamespace(loads=loads)))


def warmer(
    session: aiohttp.ClientSession, url: str | None, target: Target | None = None, **settings: Any
) -> tuple[Warmer, GatewayMetrics]:
    m = GatewayMetrics()
    to = target or (Target(url) if url is not None else None)
    w = Warmer(WarmupSettings(**settings), lambda: session, lambda _: to, m, {"x-k": "v"})
    return w, m


def count(m: GatewayMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(f"{name}_total", {"pool": "m", "worker": W, **labels}) or 0


def intent(key: int = 1, tokens: int = 4) -> WarmupIntent:
    return WarmupIntent(W, key, 1, tokens, 0.0)


async def drained(w: Warmer, deadline: float = 10.0) -> None:
    t0 = time.monotonic()
    while w.inflight:
        assert time.monotonic() - t0 < deadline, "warm-up still in flight"
        await asyncio.sleep(0.01)


async def test_a_warmup_is_the_prefix_with_one_token_counted_as_load_and_cost(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    upstream.hold = True
    w, m = warmer(session, upstream.url)
    pool = fake_pool()
    assert w.submit(pool, intent(), [5, 6, 7, 8])
    await asyncio.wait_for(upstream.arrived.wait(), 10)
    assert upstream.bodies == [{"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 1,
                                "stream": False}]  # fmt: skip
    loads = pool.router.loads
    assert loads.inflight(W) == 1 and loads.view(W).queued_prefill_tokens == 4  # load
    upstream.release.set()
    await drained(w)
    assert loads.inflight(W) == 0
    assert count(m, "kvroute_warmups_sent") == 1
    assert count(m, "kvroute_warmup_tokens") == 4
    assert m.registry.get_sample_value("kvroute_warmups_failed_total", {}) is None


async def test_refusals_are_counted_not_queued(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    upstream.hold = True
    w, m = warmer(session, upstream.url, max_inflight=2)
    pool = fake_pool()
    assert w.submit(pool, intent(1), [1, 2, 3, 4])
    assert not w.submit(pool, intent(1), [1, 2, 3, 4])  # one per (prefix, worker)
    assert w.submit(pool, intent(2), [1, 2, 3, 4])
    assert not w.submit(pool, intent(3), [1, 2, 3, 4])  # max_inflight
    assert not w.submit(pool, intent(4, tokens=9), [1, 2, 3, 4])  # ids do not cover it
    assert count(m, "kvroute_warmups_failed", reason="duplicate") == 1
    assert count(m, "kvroute_warmups_failed", reason="busy") == 1
    assert count(m, "kvroute_warmups_failed", reason="bad_prefix") == 1
    assert w.inflight == 2
    await w.close()  # shutdown cancels what is in flight
    assert w.inflight == 0 and pool.router.loads.inflight(W) == 0
    off, m2 = warmer(session, upstream.url, enabled=False)
    assert not off.submit(pool, intent(), [1, 2, 3, 4])
    assert count(m2, "kvroute_warmups_failed", reason="disabled") == 1


@pytest.mark.parametrize("case", ["http_503", "connection", "timeout", "gone"])
async def test_a_failed_warmup_is_counted_once_and_not_retried(
    upstream: Upstream, session: aiohttp.ClientSession, case: str
) -> None:
    url: str | None = upstream.url
    settings: dict[str, Any] = {}
    if case == "http_503":
        upstream.status = 503
    elif case == "connection":
        url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    elif case == "timeout":
        upstream.hold = True  # never answers
        settings["timeout"] = 0.2
    else:
        url = None  # the worker left the registry
    w, m = warmer(session, url, **settings)
    pool = fake_pool()
    assert w.submit(pool, intent(), [1, 2, 3, 4])
    await drained(w)
    assert count(m, "kvroute_warmups_failed", reason=case) == 1
    assert pool.router.loads.inflight(W) == 0  # its load is released
    expected_posts = 0 if case in ("connection", "gone") else 1
    assert len(upstream.bodies) == expected_posts  # sent at most once: no retry


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_warmup_for_a_data_parallel_rank_is_pinned_to_it(
    upstream: Upstream, session: aiohttp.ClientSession, engine: str
) -> None:
    """A rank's warm-up must land on that rank (vLLM: a header; SGLang: body fields), not
    on whichever rank the engine's own balancer picks."""
    w, _ = warmer(session, None, Target(upstream.url, engine, 3))
    assert w.submit(fake_pool(), intent(), [5, 6, 7, 8])
    await drained(w)
    (body,) = upstream.bodies
    assert body["prompt"] == [5, 6, 7, 8] and body["max_tokens"] == 1
    if engine == "vllm":
        assert upstream.rank_headers == ["3"] and "routed_dp_rank" not in body
    else:
        assert upstream.rank_headers == [None]
        assert body["routed_dp_rank"] == 3 and body["data_parallel_rank"] == 3


@pytest.mark.parametrize(
    ("engine", "role", "fake"),
    [("sglang", "prefill", True), ("sglang", "", False), ("vllm", "prefill", False)],
)
async def test_a_warmup_of_an_sglang_prefill_worker_names_the_fake_decode(
    upstream: Upstream, session: aiohttp.ClientSession, engine: str, role: str, fake: bool
) -> None:
    """An SGLang prefill engine refuses a request that no decode engine pairs (no bootstrap
    room); a warm-up alone names SGLang's fake decode address so the prefill engine computes
    and caches the prefix without waiting for a KV pull. Other workers get the plain body."""
    w, m = warmer(session, None, Target(upstream.url, engine, None, role, 8998))
    assert w.submit(fake_pool(), intent(), [5, 6, 7, 8])
    await drained(w)
    (body,) = upstream.bodies
    assert body["prompt"] == [5, 6, 7, 8] and body["max_tokens"] == 1
    if fake:
        assert body["bootstrap_host"] == "2.2.2.2" and body["bootstrap_port"] == 8998
        assert isinstance(body["bootstrap_room"], int) and 0 <= body["bootstrap_room"] < 2**63
    else:
        assert not {"bootstrap_host", "bootstrap_port", "bootstrap_room"} & body.keys()
    assert count(m, "kvroute_warmups_sent") == 1
