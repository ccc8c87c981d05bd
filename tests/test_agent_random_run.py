"""The key end-to-end property: after a random run of stores, evictions, engine restarts,
agent restarts and a Redis restart, every consumer's index equals the agents' mirrors
exactly — including a consumer that bootstraps late from snapshots."""

from __future__ import annotations

import contextlib
import random
from typing import Any

from agent_helpers import (
    AGENT_SEED,
    FakeEngine,
    agent_config,
    drive,
    running_agent,
    running_consumer,
    settle,
    wait_until,
)

from gateway.routing.keys import BlockKeyer
from loadtest.harness import RedisServer

KEYER = BlockKeyer(AGENT_SEED, 16)
SETUPS = [("vllm-0.33", 16), ("vllm-0.23", 64), ("sglang-0.5.23", 1)]


async def test_random_run_index_equals_mirrors(redis_server: RedisServer) -> None:
    rng = random.Random(2026)
    engines = [FakeEngine(f, block_size=bs, seed=i) for i, (f, bs) in enumerate(SETUPS)]
    configs = [agent_config(e, worker=f"w{i}") for i, e in enumerate(engines)]
    url = redis_server.url
    async with contextlib.AsyncExitStack() as stack:
        for e in engines:
            stack.push_async_callback(e.close)
        consumer = await stack.enter_async_context(running_consumer(url))
        agents: list[Any] = []
        agent_stacks: list[contextlib.AsyncExitStack] = []
        for cfg in configs:
            s = contextlib.AsyncExitStack()
            agents.append(await s.enter_async_context(running_agent(cfg, url)))
            agent_stacks.append(s)
        try:
            for step in range(60):
                i = rng.randrange(len(engines))
                action = rng.random()
                if action < 0.08:
                    engines[i].restart()
                elif action < 0.14:  # agent restart: a new epoch, state relearned by replay
                    await agent_stacks[i].aclose()
                    agent_stacks[i] = contextlib.AsyncExitStack()
                    agents[i] = await agent_stacks[i].enter_async_context(
                        running_agent(configs[i], url)
                    )
                elif step in (20, 45):  # Redis dies and comes back empty
                    redis_server.kill()
                    for e in engines:
                        await drive(e, 3)
                    redis_server.start()
                for e in engines:
                    await drive(e, rng.randint(1, 4))
            for a, e in zip(agents, engines, strict=True):
                expected = e.expected_keys(KEYER)
                await wait_until(lambda a=a, x=expected: a.mirror_keys() == x, 15, "mirror")
            await settle(consumer, agents, 15)
            for a in agents:
                w = a.config.worker_id
                assert consumer.index.worker_keys(w) == a.mirror_keys()
            # a replica that starts now: snapshot + tail gives the same index
            async with running_consumer(url) as late:
                await settle(late, agents, 15)
            assert sum(len(a.mirror_keys()) for a in agents) > 0
            consumer.index.check_invariants()
        finally:
            for s in agent_stacks:
                await s.aclose()
