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


async def wait_ready(s: aiohttp.ClientSession, url: str, router: ChildProcess) -> None:
    """Until the router reports both workers (bounded; fails if the router dies)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert router.alive(), router.tail()
        try:
            async with s.get(url + "/workers") as r:
                if r.status == 200 and (await r.text()).count("http://127.0.0.1") >= 2:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("sglang-router did not register the workers:\n" + router.tail())


async def test_sglang_router_routes_to_sim_workers(tokenizer: Tokenizer, logs: Path) -> None:
    cfg = SimConfig(workers=2, flavor="sglang", timing=TimingConfig(speedup=200.0))
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster:
        port = free_port()
        urls = [w.http_url for w in cluster.workers]
        router = ChildProcess(
            [str(ROUTER), "launch", "--worker-urls", *urls, "--policy", "round_robin",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
             # its metrics on a free loopback port, not the default 29000 any process may hold
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--tokenizer-path", str(bundled_test_tokenizer())],
            "sglang-router", logs,
        ).start()  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as s:
                await wait_ready(s, base, router)
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
