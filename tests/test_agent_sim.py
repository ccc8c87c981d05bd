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

from gateway.contract.wire import key_digest
from gateway.routing.keys import BlockKeyer
from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import (
    KV_GROUP_PRESETS,
    CacheConfig,
    EventsConfig,
    SimConfig,
    TimingConfig,
)
from loadtest.enginesim.kvcache import unpack_tokens
from loadtest.harness import RedisServer

KEYER = BlockKeyer(AGENT_SEED, 16)


def cached_keys(worker: Any) -> set[int]:
    """Canonical keys of every prefix the simulated cache holds (a bigram cache holds
    ``t_i || t_i+1`` atoms: slot i holds token ``t_i``)."""
    out: set[int] = set()
    bigram = worker.config.cache.bigram_keys
    for full, _, _ in worker.core.cache.nodes():
        tokens = unpack_tokens(full)
        out.update(KEYER.keys(tokens[::2] if bigram else tokens))
    return out


async def request(worker: Any, prompt: list[int]) -> None:
    gen = worker.submit(prompt, 4, stream=False)
    while not gen.finished and gen.error is None:
        await gen.wait()


@pytest.mark.parametrize(("flavor", "block_size", "encoding", "model"), [
    ("vllm", 16, "map", "dense"),
    ("sglang", 1, "map", "dense"),
    ("vllm", 64, "array", "dense"),
    ("vllm", 16, "map", "deepseek-v3"),  # one MLA group
    ("vllm", 32, "array", "gpt-oss"),  # a sliding-window group 0, full attention group 1
    ("vllm", 16, "map", "gemma-3-27b"),  # six sliding-window groups first
    ("sglang", 16, "map", "mtp"),  # DeepSeek MTP on SGLang: bigram token pairs
    ("sglang", 4, "array", "mtp"),
])  # fmt: skip
async def test_sim_workers_index_equals_mirrors(
    redis_server: RedisServer, flavor: str, block_size: int, encoding: str, model: str
) -> None:
    """Every model shape as the engines publish it: the index, by key digest, equals the
    mirrors, and each mirror the canonical keys of what the engine's cache holds."""
    groups = KV_GROUP_PRESETS["dense" if model == "mtp" else model]
    cfg = SimConfig(
        workers=2,
        flavor=flavor,  # type: ignore[arg-type]
        cache=CacheConfig(
            kv_blocks=2048 // block_size,
            block_size=block_size,
            kv_groups=list(groups),
            bigram_keys=model == "mtp",
        ),
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
            for a in agents:
                wid = a.config.worker_id
                assert key_digest(consumer.index.worker_keys(wid)) == key_digest(a.mirror_keys())
            removed = sum(a.metrics.value("canonical_blocks_total", op="removed") for a in agents)
            assert removed > 0  # evictions ran
            for a in agents:
                assert a.metrics.value("events_bad_total", reason="tokens") == 0
                assert a.metrics.value("events_bad_total", reason="wrong_type") == 0
            dropped = sum(a.metrics.value("blocks_dropped_total", reason="group") for a in agents)
            assert (dropped > 0) == (len(groups) > 1)  # only the other groups' copies
        finally:
            for s in agent_stacks:
                await s.aclose()


async def test_long_replay_through_a_lossy_replay_socket_resumes_and_loses_nothing(
    redis_server: RedisServer,
) -> None:
    """vLLM 0.23's and SGLang 0.5.23's replay sockets drop every message past ~1,000 queued
    (the end marker too). An agent started beside an engine with a long buffer, and one that
    meets a long live gap, must resume from the first missing batch until it has the whole
    range, and clear nothing, because the engine still holds it."""
    bound = 40
    cfg = SimConfig(
        workers=1,
        cache=CacheConfig(kv_blocks=4096, block_size=16),
        timing=TimingConfig(speedup=1000.0),
        events=EventsConfig(buffer_steps=5000, replay_queue_bound=bound),
    )
    rng = random.Random(7)
    async with contextlib.AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(SimCluster(cfg, tokenizer=None))
        (w,) = cluster.workers
        assert w.publisher is not None

        async def traffic(batches: int) -> None:
            target = w.publisher.next_seq + batches  # type: ignore[union-attr]
            while w.publisher.next_seq < target:  # type: ignore[union-attr]
                await request(w, [rng.randrange(1, 30_000) for _ in range(rng.randint(16, 80))])

        await traffic(5 * bound)  # buffered before the agent starts: five replies' worth
        consumer = await stack.enter_async_context(running_consumer(redis_server.url))
        agent = await stack.enter_async_context(
            running_agent(agent_config(None, worker="w0", engine_url=w.http_url), redis_server.url)
        )
        await poll(lambda: agent.mirror_keys() == cached_keys(w), 15, "initial replay")
        m = agent.metrics
        assert m.value("replays_total", result="initial") == 1
        assert m.value("replays_total", result="resumed") >= 4
        w.publisher.drop_next(3 * bound)  # a long gap on the live path
        await traffic(3 * bound + 2)
        await poll(lambda: agent.mirror_keys() == cached_keys(w), 15, "gap replayed")
        assert m.value("sequence_gaps_total") == 1
        assert m.value("replays_total", result="ok") == 1
        assert m.value("replays_total", result="resumed") >= 6
        assert m.value("clears_total", reason="replay_unavailable") == 0
        assert w.publisher.replay_dropped > 0  # the socket really lost messages
        await settle(consumer, [agent], 15)
