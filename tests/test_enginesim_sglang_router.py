"""A real peer in front of the simulator: ``sglang-router`` (bench extra) probes the sim
workers (``/health``, ``/server_info``, ``/model_info``) and routes requests to them."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from gateway.tokenization import Tokenizer, bundled_test_tokenizer
from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import SimConfig, TimingConfig
from loadtest.enginesim.text import load_tokenizer
from loadtest.harness import ChildProcess, free_port

ROUTER = Path(sys.executable).with_name("sglang-router")

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="sglang-router (bench extra) missing")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tk = load_tokenizer(None, None)
    assert tk is not None
    return tk


async def wait_ready(s: aiohttp.ClientSession, url: str, router: ChildProcess) -> bool:
    """Until the router reports both workers (bounded; fails if the router dies). False when
    it exited because one of its two ports was taken (see :func:`launch`)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not router.alive():
            if PORT_TAKEN in router.tail():
                return False
            raise AssertionError(router.tail())
        try:
            async with s.get(url + "/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200 and (await r.text()).count("http://127.0.0.1") >= 2:
                    return True
        except (aiohttp.ClientConnectionError, TimeoutError):
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("sglang-router did not register the workers:\n" + router.tail())


#: the router's error when a port it was given is bound by the time it starts
PORT_TAKEN = "Address already in use"


async def launch(
    s: aiohttp.ClientSession, urls: list[str], logs: Path, attempts: int = 3
) -> tuple[ChildProcess, str]:
    """sglang-router on two free loopback ports (its API, its metrics), once it lists both
    workers. A port picked free can be bound by a test in the other pytest worker before the
    router binds it (CI, 2026-12-07: "Address already in use", the router gone); the router
    takes port numbers, not sockets, so that race is closed by new ports, ``attempts`` times
    at most. Any other failure fails at once."""
    for _ in range(attempts):
        port = free_port()
        router = ChildProcess(
            [str(ROUTER), "launch", "--worker-urls", *urls, "--policy", "round_robin",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
             # its metrics on a free loopback port, not the default 29000 any process may hold
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--tokenizer-path", str(bundled_test_tokenizer())],
            "sglang-router", logs,
        ).start()  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            if await wait_ready(s, base, router):
                return router, base
        except BaseException:
            router.stop()
            raise
        router.stop()
    raise AssertionError(f"sglang-router lost its ports {attempts} times:\n" + router.tail())


async def test_sglang_router_routes_to_sim_workers(tokenizer: Tokenizer, logs: Path) -> None:
    cfg = SimConfig(workers=2, flavor="sglang", timing=TimingConfig(speedup=200.0))
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster:
        urls = [w.http_url for w in cluster.workers]
        async with aiohttp.ClientSession() as s:
            router, base = await launch(s, urls, logs)
            try:
                for i in range(6):
                    body = {"model": cfg.model, "prompt": f"Request {i}: tell me a story.",
                            "max_tokens": 4}  # fmt: skip
                    async with s.post(base + "/v1/completions", json=body) as r:
                        out = await r.json()
                        assert r.status == 200, out
                        assert out["choices"][0]["text"] == " the" * 4
                gen = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2}}
                async with s.post(base + "/generate", json=gen) as r:
                    assert (
                        r.status == 200 and (await r.json())["meta_info"]["completion_tokens"] == 2
                    )
            finally:
                router.stop()
        served = [w.core.stats.finished for w in cluster.workers]
        assert sum(served) == 7 and min(served) >= 3  # round robin used both sim workers


async def test_a_router_whose_port_was_taken_is_launched_again(
    tokenizer: Tokenizer, logs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first port handed out is held by another listener when the router starts: it exits
    with "Address already in use", and ``launch`` starts it again on new ports."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # bound, not listening: a connection to it is refused
    picks = [held.getsockname()[1]]
    real = free_port
    monkeypatch.setattr(
        sys.modules[__name__], "free_port", lambda: picks.pop() if picks else real()
    )
    cfg = SimConfig(workers=2, flavor="sglang", timing=TimingConfig(speedup=200.0))
    try:
        async with SimCluster(cfg, tokenizer=tokenizer) as cluster:
            urls = [w.http_url for w in cluster.workers]
            async with aiohttp.ClientSession() as s:
                router, base = await launch(s, urls, logs)
                try:
                    assert not picks and base != f"http://127.0.0.1:{held.getsockname()[1]}"
                    async with s.get(base + "/workers") as r:
                        assert r.status == 200
                finally:
                    router.stop()
    finally:
        held.close()
