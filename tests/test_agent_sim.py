"""Simulated engines (loadtest.enginesim) → agents (discovering the engines over HTTP) →
redis-server → consumer: after a random run of requests, evictions, engine restarts and an
agent restart, the consumer's index equals the agents' mirrors, and each mirror equals the
canonical keys of what the simulated cache holds."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import pytest
from agent_helpers import AGENT_SEED, agent_config, running_agent, running_consumer, settle
from agent_helpers import wait_until as poll

from gateway.routing.keys import BlockKeyer
from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import CacheConfig, EventsConfig, SimConfig, TimingConfig
from loadtest.enginesim.kvcache import unpack_tokens
from loadtest.harness import RedisServer

KEYER = BlockKeyer(AGENT_SEED, 16)


def cached_keys(worker: Any) -> set[int]:
    """Canonical keys of every prefix the simulated cache holds."""
    out: set[int] = set()
    for full, _, _ in worker.core.cache.nodes():
        out.update(KEYER.keys(unpack_tokens(full)))
    return out


async def request(worker: Any, prompt: list[int]) -> None:
    gen = worker.submit(prompt, 4, stream=False)
    while not gen.finished and gen.error is None:
        await gen.wait()


@pytest.mark.parametrize(("flavor", "block_size", "encoding"), [
    ("vllm", 16, "map"), ("sglang", 1, "map"), ("vllm", 64, "array"),
])  # fmt: skip
async def test_sim_workers_index_equals_mirrors(
    redis_server: RedisServer, flavor: str, block_size: int, encoding: str
) -> None:
    cfg = SimConfig(
        workers=2,
        flavor=flavor,  # type: ignore[arg-type]
        cache=CacheConfig(kv_blocks=2048 // block_size, block_size=block_size),
        timing=TimingConfig(speedup=1000.0),
        events=EventsConfig(encoding=encoding),  # type: ignore[arg-type]
    )
    rng = random.Random(block_size)
    url = redis_server.url
    async with contextlib.AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(SimCluster(cfg, tokenizer=None))
        consumer = await stack.enter_async_context(running_consumer(url))
        configs = [
            agent_config(None, worker=f"sim{i}", engine_url=w.http_url)
            for i, w in enumerate(cluster.workers)
        ]
        for c in configs:
            c.engine.kind = flavor
        agent_stacks = [contextlib.AsyncExitStack() for _ in configs]
        agents = [
            await s.enter_async_context(running_agent(c, url))
            for s, c in zip(agent_stacks, configs, strict=True)
        ]
        try:
            systems = [
                [rng.randrange(1, 30_000) for _ in range(rng.randint(20, 120))] for _ in range(6)
            ]
            for step in range(30):
                i = rng.randrange(len(cluster.workers))
                w = cluster.workers[i]
                if step in (10, 20) and i == 0:
                    await w.restart()  # sequence from 0, empty cache
                if step == 15:  # an agent restart: new epoch, relearned by replay
                    await agent_stacks[1].aclose()
                    agent_stacks[1] = contextlib.AsyncExitStack()
                    agents[1] = await agent_stacks[1].enter_async_context(
                        running_agent(configs[1], url)
                    )
                prompts = [
                    rng.choice(systems)
                    + [rng.randrange(1, 30_000) for _ in range(rng.randint(1, 200))]
                    for _ in range(rng.randint(1, 6))
                ]
                await asyncio.gather(*(request(w, p) for p in prompts))
            for a, w in zip(agents, cluster.workers, strict=True):
                await poll(
                    lambda a=a, w=w: a.mirror_keys() == cached_keys(w), 15, "mirror == cache"
                )
            await settle(consumer, agents, 15)
            assert all(a.mirror_keys() for a in agents)
            removed = sum(a.metrics.value("canonical_blocks_total", op="removed") for a in agents)
            assert removed > 0  # evictions ran
        finally:
            for s in agent_stacks:
                await s.aclose()
