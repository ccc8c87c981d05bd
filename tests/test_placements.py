"""Gateway replicas share their placements (gateway/placements.py): the wire format refuses
garbage, one replica's speculative insert reaches the other's index over a real Redis, and a
Redis outage or a garbage batch loses hints, never the feed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from gateway.config import ConfigError, GatewayConfig, PoolSettings, ReplicaSettings, StaticWorker
from gateway.contract.bus import EventBus, MemoryBus
from gateway.contract.redis_bus import RedisBus
from gateway.contract.wire import (
    PROTOCOL_VERSION,
    Placement,
    Placements,
    decode_placements,
    encode_placements,
)
from gateway.placements import PlacementFeed
from gateway.routing.index import ShadowIndex
from gateway.server import Gateway
from gateway.tokenization import bundled_test_tokenizer
from loadtest.harness import RedisServer

CHAIN = [(1 << 63) + i for i in range(12)]  # keys use all 64 bits


def test_placements_round_trip_and_refuse_garbage() -> None:
    batch = Placements(
        PROTOCOL_VERSION, "gw-a", [Placement("w1", None, CHAIN), Placement("w2", 7, [8])]
    )
    assert decode_placements(encode_placements(batch)) == batch
    enc = msgspec.msgpack.Encoder()
    bad = [
        b"junk",
        b"",
        enc.encode([PROTOCOL_VERSION + 1, "gw-a", []]),  # a newer protocol
        enc.encode([PROTOCOL_VERSION, "gw-a", [["w1", None, [-5]]]]),  # a negative key
        enc.encode([PROTOCOL_VERSION, "gw-a", [["w1", -1, [1]]]]),  # negative parent
        enc.encode([PROTOCOL_VERSION, "gw-a", [["w1", None, ["x"]]]]),
    ]
    for data in bad:
        with pytest.raises(ValueError):
            decode_placements(data)


def _index(*workers: str) -> ShadowIndex:
    index = ShadowIndex(speculative_ttl=5.0)
    for w in workers:
        index.add_worker(w)
    return index


async def test_alone_a_replica_sends_only_its_presence_then_shares_with_a_peer() -> None:
    """A replica that has heard no other sends an empty batch each heartbeat and empties its
    outbox unsent; once it reads another's batch it sends its placements, which the other
    adopts (and the sender skips when it reads them back); a silent peer lapses."""
    now = [100.0]
    bus = MemoryBus()
    a = PlacementFeed(bus, _index("w1"), origin="a", clock=lambda: now[0])
    b = PlacementFeed(bus, _index("w1"), origin="b", clock=lambda: now[0])
    a.index.outbox = []
    a.index.speculate("w1", CHAIN, now=now[0])
    await a.flush()
    assert (a.stats.unshared, a.stats.heartbeats, a.stats.published) == (1, 1, 0)
    await a.flush()  # nothing to send, the next heartbeat not due
    [(sid, origin, data)] = await bus.read_placements("0-0")
    assert origin == "a" and decode_placements(data).items == [] and not b.peers()
    assert b.adopt(data, origin) == 0 and b.peers() and b.index.match(CHAIN) == {}
    await b.flush()  # b's presence
    [(sid, origin, data)] = await bus.read_placements(sid)
    assert a.adopt(data, origin) == 0 and a.peers()
    a.index.speculate("w1", CHAIN, now=now[0])
    await a.flush()
    assert a.stats.published == 1 and a.stats.batches_published == 1 and a.index.outbox == []
    [(sid, origin, data)] = await bus.read_placements(sid)
    assert a.adopt(data, origin) == 0 and a.stats.own_skipped == 1  # by the stream's origin
    assert a.adopt(data) == 0 and a.stats.own_skipped == 2  # by the batch's own
    assert b.adopt(data, origin) == 1 and b.index.match(CHAIN) == {"w1": len(CHAIN)}
    assert b.stats.adopted_blocks == len(CHAIN) and await bus.placements_tail() == sid
    assert b.adopt(b"junk") == 0 and b.stats.garbage == 1
    now[0] += 3.5  # b silent for longer than peer_ttl: a is alone again
    assert not a.peers()
    a.index.speculate("w1", [77], now=now[0])
    await a.flush()
    assert a.stats.unshared == 2 and a.stats.heartbeats == 2


async def test_pending_placements_are_bounded_newest_kept() -> None:
    feed = PlacementFeed(MemoryBus(), _index("w1"), max_pending=2)
    feed.index.outbox = []
    for i in range(5):
        feed.index.speculate("w1", [100 + i], now=float(i))
    taken = feed.take()
    assert [p.keys for p in taken] == [[103], [104]] and feed.stats.dropped == 3
    assert feed.take() == [] and feed.index.outbox == []
    for bad in ({"interval": 0}, {"heartbeat_s": 0}, {"peer_ttl": 1.0}):
        with pytest.raises(ValueError):
            PlacementFeed(MemoryBus(), _index(), **bad)  # type: ignore[arg-type]


async def until(cond: Callable[[], bool], limit: float = 10.0) -> None:
    """Wait until ``cond()`` holds (the feeds run on this loop and on Redis), or fail."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition never held")
        await asyncio.sleep(0.005)


async def test_replicas_share_placements_over_redis_and_survive_an_outage(
    redis_server: RedisServer,
) -> None:
    buses: list[EventBus] = [
        RedisBus(redis_server.url, prefix="t:", socket_timeout=2.0) for _ in range(2)
    ]
    a = PlacementFeed(buses[0], _index("w1", "w2"), origin="a", retry_s=0.05)
    b = PlacementFeed(buses[1], _index("w1", "w2"), origin="b", retry_s=0.05)
    await a.start()
    await b.start()
    try:
        await until(lambda: a.peers() and b.peers())  # each read the other's presence
        a.index.speculate("w1", CHAIN, now=a.clock())
        await until(lambda: b.index.match(CHAIN) == {"w1": len(CHAIN)})
        b.index.speculate("w2", CHAIN[:4], now=b.clock())
        await until(lambda: a.index.match(CHAIN[:4]) == {"w1": 4, "w2": 4})
        await until(lambda: a.stats.own_skipped >= 1 and b.stats.own_skipped >= 1)
        assert a.stats.adopted == b.stats.adopted == 1 and b.index.blocks("w1") == 0

        # garbage on the stream is counted; the next batch is still adopted
        await buses[0].publish_placements("x", b"junk")
        a.index.speculate("w2", [200, 201, 202, 203], now=a.clock())
        await until(
            lambda: b.stats.garbage >= 1 and b.index.match([200, 201, 202, 203]) == {"w2": 4}
        )

        # Redis gone: placements are dropped (counted), reads fail and retry
        redis_server.kill()
        a.index.speculate("w1", [9, 10], now=a.clock())
        await until(lambda: a.stats.dropped >= 1 and b.stats.read_errors >= 1)
        assert b.index.match([9, 10]) == {}

        # Redis back (empty): sharing resumes from the new stream's tail
        redis_server.start()
        back = a.clock()
        # both read again: each has read a batch (a heartbeat) of the other since the restart
        await until(lambda: a._peer_at > back and b._peer_at > back, limit=20.0)
        a.index.speculate("w1", [11, 12, 13], now=a.clock())
        await until(lambda: b.index.match([11, 12, 13]) == {"w1": 3}, limit=20.0)
    finally:
        await a.stop()
        await b.stop()
        for bus in buses:
            await bus.close()
    assert a.index.outbox is None and b.index.outbox is None


def _config(**replicas: object) -> GatewayConfig:
    pool = PoolSettings(
        model="m",
        tokenizer=str(bundled_test_tokenizer()),
        static_workers=[StaticWorker("http://127.0.0.1:9", "w1")],
    )
    return GatewayConfig(pools=[pool], replicas=ReplicaSettings(**replicas))  # type: ignore[arg-type]


def test_a_gateway_shares_placements_when_its_bus_carries_them() -> None:
    assert isinstance(Gateway(_config(), bus=MemoryBus()).placements, PlacementFeed)
    assert Gateway(_config(share_placements=False), bus=MemoryBus()).placements is None
    assert Gateway(_config()).placements is None  # static workers, no bus
    for bad in ({"interval": 0.0}, {"max_pending": 0}):
        with pytest.raises(ConfigError, match="replicas"):
            _config(**bad).validate()


class _Exploding:
    """An index whose ``adopt`` fails (a bug in it must not end the feed)."""

    outbox: list[tuple[str, int | None, list[int]]] | None = None

    def adopt(self, worker: str, parent: int | None, keys: list[int], now: float) -> int:
        raise RuntimeError("boom")


async def test_a_failing_adopt_is_counted_and_reading_goes_on() -> None:
    bus = MemoryBus()
    feed = PlacementFeed(bus, _Exploding(), origin="b")  # type: ignore[arg-type]
    await feed.start()
    try:
        batch = encode_placements(Placements(PROTOCOL_VERSION, "a", [Placement("w1", None, [1])]))
        # sent until two were read (the read loop starts from the tail, whenever it reads it)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while feed.stats.garbage < 2:
            assert loop.time() < deadline, "the feed stopped reading"
            await bus.publish_placements("a", batch)
            await asyncio.sleep(0.01)
        assert feed.stats.adopted == 0
    finally:
        await feed.stop()


class _Deaf(MemoryBus):
    """A bus whose reads swallow their cancellation, as redis-py's can when a connection
    breaks under a cancel."""

    async def read_placements(
        self, after: str, count: int = 256, block_ms: int | None = None
    ) -> list[tuple[str, str, bytes]]:
        try:
            return await super().read_placements(after, count, block_ms)
        except asyncio.CancelledError:
            return []


async def test_stop_ends_a_feed_whose_read_swallows_its_cancellation() -> None:
    feed = PlacementFeed(_Deaf(), _index("w1"), origin="a")
    await feed.start()
    await until(lambda: feed.stats.heartbeats == 1)
    tasks = list(feed._tasks)
    await asyncio.wait_for(feed.stop(), 10)
    assert all(t.done() for t in tasks) and feed.index.outbox is None
