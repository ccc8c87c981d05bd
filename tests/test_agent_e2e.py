"""The agent end to end: engine ZMQ frames → agent → redis-server → consumer index.

Real sockets on loopback and a real redis-server; every wait polls a condition.
"""

from __future__ import annotations

import pytest
from agent_helpers import (
    AGENT_SEED,
    FakeEngine,
    agent_config,
    drive,
    join,
    running_agent,
    running_consumer,
    settle,
    wait_until,
)

from gateway.routing.keys import BlockKeyer
from loadtest.harness import RedisServer

KEYER = BlockKeyer(AGENT_SEED, 16)


@pytest.mark.parametrize(
    ("flavor", "block_size"),
    [("vllm-0.23", 16), ("vllm-0.33", 64), ("sglang-0.5.15", 1), ("sglang-0.5.23", 1)],
)
async def test_engine_versions_end_to_end(
    redis_server: RedisServer, flavor: str, block_size: int
) -> None:
    engine = FakeEngine(flavor, block_size=block_size, seed=hash(flavor) % 100)
    try:
        async with (
            running_consumer(redis_server.url) as consumer,
            running_agent(agent_config(engine), redis_server.url) as agent,
        ):
            await drive(engine, 40)
            expected = engine.expected_keys(KEYER)
            await wait_until(lambda: agent.mirror_keys() == expected, 10, "mirror == engine")
            await settle(consumer, [agent])
            assert expected  # the run did store something
            assert agent.metrics.value("events_bad_total") == 0
    finally:
        await engine.close()


async def test_bytes_hashes(redis_server: RedisServer) -> None:
    engine = FakeEngine("vllm-0.33", bytes_hashes=True)
    try:
        async with running_agent(agent_config(engine), redis_server.url) as agent:
            await drive(engine, 20)
            expected = engine.expected_keys(KEYER)
            await wait_until(lambda: agent.mirror_keys() == expected, 10, "mirror == engine")
    finally:
        await engine.close()


async def test_gap_is_replayed(redis_server: RedisServer) -> None:
    engine = FakeEngine("vllm-0.33")
    try:
        async with running_agent(agent_config(engine), redis_server.url) as agent:
            await drive(engine, 5)
            await wait_until(lambda: agent.metrics.value("frames_received_total") >= 5)
            for _ in range(3):  # lost on the live path, still in the replay buffer
                await engine.publish(engine.store_events(engine.random_tokens([])), send=False)
            await drive(engine, 2)
            expected = engine.expected_keys(KEYER)
            await wait_until(lambda: agent.mirror_keys() == expected, 10, "replayed")
            assert agent.metrics.value("sequence_gaps_total") == 1
            assert agent.metrics.value("replays_total", result="ok") == 1
            assert agent.metrics.value("clears_total", reason="replay_unavailable") == 0
    finally:
        await engine.close()


@pytest.mark.parametrize("replay", [False, True])
async def test_unrecoverable_gap_clears_and_resyncs(
    redis_server: RedisServer, replay: bool
) -> None:
    # replay=True: the replay buffer is too short ("too old"); False: no replay socket
    engine = FakeEngine("sglang-0.5.23", block_size=1, replay=replay, buffer_steps=2)
    try:
        async with (
            running_consumer(redis_server.url) as consumer,
            running_agent(agent_config(engine), redis_server.url) as agent,
        ):
            await join(engine, agent)
            await drive(engine, 5)
            for _ in range(4):
                await engine.publish(engine.store_events(engine.random_tokens([])), send=False)
            tokens = engine.random_tokens([])
            await engine.publish(engine.store_events(tokens))
            await wait_until(
                lambda: agent.metrics.value("clears_total", reason="replay_unavailable") == 1,
                10,
                "clear",
            )
            result = "too_old" if replay else "unavailable"
            assert agent.metrics.value("replays_total", result=result) == 1
            # after the clear the agent holds only what it saw since: a subset, never stale
            assert agent.mirror_keys() <= engine.expected_keys(KEYER)
            assert set(KEYER.keys(tokens)) <= agent.mirror_keys()
            await settle(consumer, [agent])
    finally:
        await engine.close()


async def test_engine_restart_clears(redis_server: RedisServer) -> None:
    engine = FakeEngine("vllm-0.33")
    try:
        async with (
            running_consumer(redis_server.url) as consumer,
            running_agent(agent_config(engine), redis_server.url) as agent,
        ):
            await drive(engine, 10)
            await wait_until(lambda: agent.mirror_keys() == engine.expected_keys(KEYER))
            old = agent.mirror_keys()
            engine.restart()  # sequence goes back to 0, the cache is empty
            await drive(engine, 3)
            expected = engine.expected_keys(KEYER)
            await wait_until(lambda: agent.mirror_keys() == expected, 10, "restarted")
            assert agent.metrics.value("clears_total", reason="restart") == 1
            assert not (old & agent.mirror_keys())
            await settle(consumer, [agent])
    finally:
        await engine.close()


async def test_bad_frames_are_counted_and_skipped(redis_server: RedisServer) -> None:
    engine = FakeEngine("vllm-0.33")
    try:
        async with (
            running_consumer(redis_server.url) as consumer,
            running_agent(agent_config(engine), redis_server.url) as agent,
        ):
            await drive(engine, 3)
            await engine.send_raw([b"", b"short"])  # wrong frame count
            await engine.send_raw([b"", b"123", b"payload"])  # bad seq frame
            wrong = [{"type": "BlockStored", "block_hashes": [1], "token_ids": "x"}] * 3
            await engine.publish([*wrong, {"type": "Nope"}, 7])  # bad events, batch kept
            await drive(engine, 3)
            expected = engine.expected_keys(KEYER)
            await wait_until(lambda: agent.mirror_keys() == expected, 10, "still running")
            m = agent.metrics
            assert m.value("events_bad_total", reason="frame_count") == 1
            assert m.value("events_bad_total", reason="seq_frame") == 1
            assert m.value("events_bad_total", reason="wrong_type") == 3
            assert m.value("events_bad_total", reason="unknown_type") == 1
            assert m.value("events_bad_total", reason="event_shape") == 1
            # an undecodable batch may have held removals: the rank is cleared
            await engine.publish_payload(b"\xc1\xc1 not msgpack")
            await wait_until(lambda: m.value("clears_total", reason="lost_batch") == 1)
            assert agent.mirror_keys() == set()
            await drive(engine, 2)
            await settle(consumer, [agent])
    finally:
        await engine.close()


async def test_redis_outage_is_buffered_without_loss(redis_server: RedisServer) -> None:
    engine = FakeEngine("vllm-0.33")
    try:
        async with (
            running_consumer(redis_server.url) as consumer,
            running_agent(agent_config(engine), redis_server.url) as agent,
        ):
            await drive(engine, 10)
            await wait_until(lambda: agent.mirror_keys() == engine.expected_keys(KEYER))
            await settle(consumer, [agent])
            redis_server.kill()
            await drive(engine, 20)
            expected = engine.expected_keys(KEYER)
            await wait_until(lambda: agent.mirror_keys() == expected, 10, "agent kept up")
            await wait_until(lambda: agent.metrics.value("redis_connected") == 0, 5, "outage")
            assert consumer.index.worker_keys("w1")  # the consumer keeps its last index
            redis_server.start()
            await settle(consumer, [agent], 10)
            assert agent.metrics.value("buffer_overflows_total") == 0
            assert agent.metrics.value("clears_total", reason="overflow") == 0
            assert "w1" in consumer.workers()
    finally:
        await engine.close()


async def test_redis_outage_overflow_publishes_clear_and_snapshot(
    redis_server: RedisServer,
) -> None:
    engine = FakeEngine("vllm-0.33")
    cfg = agent_config(engine, max_buffer_events=50)
    try:
        async with (
            running_consumer(redis_server.url) as consumer,
            running_agent(cfg, redis_server.url) as agent,
        ):
            await drive(engine, 5)
            await wait_until(lambda: agent.mirror_keys() == engine.expected_keys(KEYER))
            await settle(consumer, [agent])
            redis_server.kill()
            await drive(engine, 40)
            await wait_until(lambda: agent.metrics.value("buffer_overflows_total") >= 1, 10)
            redis_server.start()
            await settle(consumer, [agent], 10)
            assert agent.metrics.value("clears_total", reason="overflow") >= 1
        # a consumer that starts now bootstraps from the fresh snapshot
        async with (
            running_agent(cfg, redis_server.url) as agent2,
            running_consumer(redis_server.url) as late,
        ):
            await drive(engine, 2)
            await settle(late, [agent2])
    finally:
        await engine.close()


async def test_agent_restart_new_epoch_drops_old_state(redis_server: RedisServer) -> None:
    engine = FakeEngine("vllm-0.33", replay=False)
    try:
        async with running_consumer(redis_server.url) as consumer:
            async with running_agent(agent_config(engine), redis_server.url) as first:
                await join(engine, first)
                await drive(engine, 10)
                await wait_until(lambda: first.mirror_keys() == engine.expected_keys(KEYER))
                await settle(consumer, [first])
                old_epoch = first.epoch
                assert consumer.index.worker_keys("w1")
            async with running_agent(agent_config(engine), redis_server.url) as second:
                assert second.epoch > old_epoch
                # without replay the new run knows nothing of the old cache: the index drops it
                await wait_until(lambda: consumer.index.worker_keys("w1") == set(), 2, "dropped")
                await join(engine, second)
                tokens = engine.random_tokens([])
                await engine.publish(engine.store_events(tokens))
                await settle(consumer, [second])
                await wait_until(lambda: consumer.workers()["w1"].epoch == second.epoch)
    finally:
        await engine.close()


async def test_graceful_stop_deregisters(redis_server: RedisServer) -> None:
    engine = FakeEngine("vllm-0.33")
    try:
        async with running_consumer(redis_server.url) as consumer:
            async with running_agent(agent_config(engine), redis_server.url) as agent:
                await drive(engine, 3)
                await settle(consumer, [agent])
                info = consumer.workers()["w1"]
                assert info.epoch == agent.epoch and info.block_size == 16
                assert info.engine == "vllm" and info.url == "http://127.0.0.1:9"
            # deregistered at once (well before the 1 s TTL and the consumer's grace)
            await wait_until(lambda: "w1" not in consumer.workers(), 5, "deregistered")
            assert "w1" not in consumer.index
    finally:
        await engine.close()


async def test_restarted_engine_that_outran_us_is_detected(redis_server: RedisServer) -> None:
    """The new engine's seq passed the one we expected before we saw it: a plain gap by
    numbers, but the replayed batch at our last seq is not the one we applied."""
    engine = FakeEngine("vllm-0.33")
    try:
        async with running_agent(agent_config(engine), redis_server.url) as agent:
            await drive(engine, 3)
            await wait_until(lambda: agent.mirror_keys() == engine.expected_keys(KEYER))
            seen = engine.seq
            engine.restart()
            for _ in range(seen + 3):  # the new engine publishes past `seen`, all lost
                await engine.publish(engine.store_events(engine.random_tokens([])), send=False)
            await drive(engine, 1)
            expected = engine.expected_keys(KEYER)
            await wait_until(lambda: agent.mirror_keys() == expected, 10, "new history")
            assert agent.metrics.value("clears_total", reason="restart") == 1
    finally:
        await engine.close()
