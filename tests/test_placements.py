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
    Journal,
    Placement,
    Placements,
    decode_placements,
    encode_placements,
)
from gateway.placements import PlacementFeed
from gateway.routing.adapters import AdapterCatalog
from gateway.routing.index import ShadowIndex
from gateway.routing.policy import make_policy
from gateway.routing.remote import RemoteRequests
from gateway.routing.router import END, FIRST, START, Router
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
        enc.encode([PROTOCOL_VERSION, "gw-a", [], [["p", [[0, 1, "w1", 5]]]]]),  # short note
        enc.encode([PROTOCOL_VERSION, "gw-a", [], [["p", [[0, "x", "w1", 5, 0, -1]]]]]),
    ]
    journal = Journal("p", [(START, 1, "w1", 5, 0, -1), (END, 1, "", 0, 0, 0)])
    with_load = Placements(PROTOCOL_VERSION, "gw-a", [], [journal])
    assert decode_placements(encode_placements(with_load)) == with_load
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
    feed = Gateway(_config(), bus=MemoryBus()).placements
    assert isinstance(feed, PlacementFeed) and set(feed.routers) == {"m", "m/decode"}
    feed = Gateway(_config(share_load=False), bus=MemoryBus()).placements
    assert feed is not None and feed.routers == {}
    assert Gateway(_config(share_placements=False), bus=MemoryBus()).placements is None
    assert Gateway(_config()).placements is None  # static workers, no bus
    bad_settings = (
        {"interval": 0.0}, {"max_pending": 0}, {"remote_ttl": 0.0}, {"start_gap": -0.001},
        {"start_gap": 0.05},  # longer than the period it cuts short
    )  # fmt: skip
    for bad in bad_settings:
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


# -- shared load: each replica's requests counted in the others' load views ---------------------


def _router(index: ShadowIndex, *workers: str) -> Router:
    router = Router(make_policy("prefix"), block_size=1, index=index)
    for w in workers:
        router.add_worker(w)
    return router


def test_a_routers_journal_records_its_requests_and_the_prefix_they_shared() -> None:
    """Every start carries the popularity key its route observed (-1: no shared prefix; -2:
    not a routed request, e.g. a warm-up), then its first token and end; off by default."""
    index = _index("w1", "w2")
    router = _router(index, "w1", "w2")
    d = router.route([500, 501], 2, now=1.0)
    router.finished(router.started(d, 2, 1.0), 1.5)  # journal off: nothing kept
    assert router.journal is None
    router.journal = []
    index.stored("w1", None, CHAIN[:4])
    d = router.route(CHAIN, len(CHAIN), now=2.0)
    warm = router.route(CHAIN[:2], 2, now=2.0, dry_run=True)
    t_warm = router.started(warm, 2, 2.0)  # a decision the route did not observe
    t = router.started(d, len(CHAIN), 2.0)
    router.first_token(t, 2.1)
    router.first_token(t, 2.2)  # twice: journalled once
    router.finished(t, 2.3)
    router.finished(t_warm, 2.3)
    cold = router.route([999], 1, now=3.0)
    router.started(cold, 1, 3.0)
    (w, s, f, e, ew, c) = router.journal
    assert w[0] == START and w[5] == -2 and ew == (END, t_warm.rid, "", 0, 0, 0)
    assert s == (START, t.rid, d.worker, len(CHAIN) - d.matched_tokens, d.matched_tokens,
                 CHAIN[3])  # fmt: skip
    assert f == (FIRST, t.rid, "", 0, 0, 0) and e == (END, t.rid, "", 0, 0, 0)
    assert c[0] == START and c[5] == -1


def test_remote_requests_load_a_worker_until_their_end_silence_or_ttl() -> None:
    """Remote starts count in the local load view (and popularity) like local ones; FIRST and
    END follow them; a request whose END is lost ends by the TTL or its origin's silence; an
    unknown worker, a duplicate START, an END never started change nothing."""
    router = _router(_index("w1", "w2"), "w1", "w2")
    remote = RemoteRequests(ttl=10.0)
    notes = [
        (START, 1, "w1", 500, 100, CHAIN[3]),
        (START, 1, "w1", 500, 100, CHAIN[3]),  # a duplicate: counted once
        (START, 2, "w1", 300, 0, -1),
        (START, 3, "gone", 300, 0, -1),  # a worker this replica does not know
        (START, 4, "w2", 50, 0, -2),  # a warm-up: load, not an arrival
    ]
    remote.apply("a", "pool", router, notes, now=1.0)
    assert router.loads.inflight("w1") == 2 and router.loads.inflight("w2") == 1
    assert router.loads.view("w1").queued_prefill_tokens >= 800
    assert router.ctx.popularity.weight(CHAIN[3], 1.0) == 2.0
    assert (remote.stats.started, remote.stats.arrivals, len(remote)) == (3, 4, 3)
    remote.apply("a", "pool", router, [(FIRST, 1, "", 0, 0, 0), (END, 2, "", 0, 0, 0)], 2.0)
    assert router.loads.inflight("w1") == 1 and router.loads.view("w1").queued_prefill_tokens == 0
    remote.apply("a", "pool", router, [(END, 99, "", 0, 0, 0), (FIRST, 98, "", 0, 0, 0)], 2.0)
    assert remote.stats.unknown == 2 and remote.stats.ended == 1
    assert remote.forget("a") == 2 and router.loads.inflight_total() == 0
    remote.apply("b", "pool", router, [(START, 1, "w2", 10, 0, -1)], now=5.0)
    assert remote.expire(14.9) == 0 and router.loads.inflight("w2") == 1
    assert remote.expire(15.0) == 1 and router.loads.inflight("w2") == 0
    assert remote.stats.expired == 3 and len(remote) == 0


async def test_replicas_count_each_others_requests_until_they_end() -> None:
    """Two feeds on one bus: a request b routes loads a's view of its worker from the next
    batch until its END arrives; a replica that falls silent has its requests forgotten; a
    lone replica journals nothing; a pool the reader does not serve is skipped."""
    now = [100.0]
    bus = MemoryBus()
    ra, rb = _router(_index("w1", "w2"), "w1", "w2"), _router(_index("w1", "w2"), "w1", "w2")
    a = PlacementFeed(bus, ra.index, origin="a", clock=lambda: now[0], routers={"p": ra})
    b = PlacementFeed(bus, rb.index, origin="b", clock=lambda: now[0],
                      routers={"p": rb, "other": _router(_index())})  # fmt: skip
    for f in (a, b):
        f.index.outbox = []
    rb.journal = []  # as if b had had a peer: a lone replica stops journaling at its flush
    position = "0-0"

    async def deliver() -> None:
        nonlocal position
        for sid, origin, data in await bus.read_placements(position):
            position = sid
            a.adopt(data, origin)
            b.adopt(data, origin)

    d = rb.route(CHAIN, len(CHAIN), now=now[0])
    ticket = rb.started(d, len(CHAIN), now[0])
    await b.flush()  # alone: the journal goes unsent, and journaling stops
    assert b.stats.notes_dropped == 1 and rb.journal is None
    rb.finished(rb.started(d, len(CHAIN), now[0]), now[0])  # journals nothing
    await a.flush()
    await deliver()  # each hears the other now
    await b.flush()  # b journals again (a has not flushed since: a journals nothing yet)
    assert rb.journal == [] and ra.journal is None and b.stats.notes_published == 0
    ticket = rb.started(d, len(CHAIN), now[0])
    await b.flush()
    await deliver()
    assert b.stats.notes_published == 1 and ra.loads.inflight(d.worker) == 1
    assert ra.loads.view(d.worker).queued_prefill_tokens == len(CHAIN)
    assert rb.loads.inflight(d.worker) == 2  # its own two, never its own notes read back
    rb.first_token(ticket, now[0])
    rb.finished(ticket, now[0])
    await b.flush()
    await deliver()
    assert ra.loads.inflight_total() == 0 and a.remote.stats.ended == 1
    rb.started(d, len(CHAIN), now[0])
    await b.flush()
    await deliver()
    assert ra.loads.inflight_total() == 1
    now[0] += 3.5  # b silent past peer_ttl: a forgets its requests
    await a.flush()
    assert ra.loads.inflight_total() == 0 and a.remote.stats.expired == 1


async def test_a_requests_start_reaches_the_other_replicas_without_waiting_for_the_period(
    redis_server: RedisServer,
) -> None:
    """Over a real Redis with a 30 s batching period: a request's start goes out at once
    (the others route on top of it until they count it), and starts made together share one
    batch; placements and ends still wait for the period, and so do starts while Redis is
    down."""
    buses: list[EventBus] = [
        RedisBus(redis_server.url, prefix="t:", socket_timeout=2.0) for _ in range(2)
    ]
    ra, rb = _router(_index("w1", "w2"), "w1", "w2"), _router(_index("w1", "w2"), "w1", "w2")
    kw = {"interval": 30.0, "start_gap": 0.002, "heartbeat_s": 0.01, "peer_ttl": 60.0}
    a = PlacementFeed(buses[0], ra.index, origin="a", routers={"p": ra}, **kw)  # type: ignore[arg-type]
    b = PlacementFeed(buses[1], rb.index, origin="b", routers={"p": rb}, **kw)  # type: ignore[arg-type]
    await a.start()
    await b.start()
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + 10.0
        while not (a.peers() and b.peers() and rb.journal is not None):
            # each loop sent its first batch before the other read: presence by hand
            assert loop.time() < deadline, "the replicas never heard each other"
            await a.flush()
            await b.flush()  # once b hears a it journals (its loop waits 30 s)
            await asyncio.sleep(0.01)
        assert rb.journal == [] and rb.on_start is not None
        batches = b.stats.batches_published
        d = rb.route(CHAIN, len(CHAIN), now=b.clock())
        t0 = loop.time()
        tickets = [rb.started(d, len(CHAIN), b.clock()) for _ in range(3)]
        await until(lambda: ra.loads.inflight(d.worker) == 3, limit=5.0)
        assert loop.time() - t0 < 5.0  # not the period's 30 s
        assert b.stats.batches_published == batches + 1 and b.stats.notes_published == 3
        for t in tickets:
            rb.finished(t, b.clock())  # an end does not cut the period short
        assert rb.journal is not None and len(rb.journal) == 3

        # Redis gone: the first start's batch is refused (its notes counted dropped); later
        # starts wait for the period instead of an XADD each
        redis_server.kill()
        rb.started(d, len(CHAIN), b.clock())
        await until(lambda: b.stats.notes_dropped == 4)
        for _ in range(5):
            rb.started(d, len(CHAIN), b.clock())
            assert not b._started.is_set()  # the publisher is not woken
        assert b.stats.notes_dropped == 4 and len(rb.journal) == 5
    finally:
        await a.stop()
        await b.stop()
        for bus in buses:
            await bus.close()
    assert rb.on_start is None and rb.journal is None


class _OldJournal(msgspec.Struct, array_like=True):
    """``Journal`` as replicas before the adapters' slots sent and read it."""

    name: str
    notes: list[tuple[int, int, str, int, int, int]]


class _OldPlacements(msgspec.Struct, array_like=True):
    v: int
    origin: str
    items: list[Placement]
    journals: list[_OldJournal] = []


def _lora_router(*workers: str) -> Router:
    """A router whose workers serve adapters and keep two loaded at once (vLLM's report)."""
    adapters = AdapterCatalog(["sql", "legal", "chat", "x", "y"])
    router = Router(make_policy("prefix"), block_size=1, index=_index(*workers), adapters=adapters)
    for w in workers:
        router.add_worker(w)
        adapters.report(w, [], slots=2)
    return router


def test_remote_requests_fill_their_adapters_slots_until_they_end() -> None:
    """A remote START for a LoRA adapter occupies that adapter's slot on its worker here
    (vLLM keeps a third adapter waiting there), so this replica sends a third adapter
    elsewhere; the slot frees at the request's END, its TTL or its origin's silence."""
    router = _lora_router("w1", "w2")
    remote = RemoteRequests(ttl=10.0)
    notes = [(START, 1, "w1", 16, 0, -1), (START, 2, "w1", 16, 0, -1), (START, 3, "w2", 16, 0, -1)]
    remote.apply("a", "pool", router, notes, 1.0, [(1, "sql"), (2, "legal")])
    assert router.adapters.crowded("chat", ["w1", "w2"]) == {"w1"}
    assert router.adapters.crowded("sql", ["w1", "w2"]) == set()  # its own slot is taken
    router.index.stored("w1", None, CHAIN)  # w1 holds chat's whole prompt: still left out
    for t in range(5):
        d = router.route(CHAIN, len(CHAIN), 1.0 + t, adapter="chat", dry_run=True)
        assert d.worker == "w2"
    remote.apply("a", "pool", router, [(END, 2, "", 0, 0, 0)], 2.0)
    assert router.adapters.crowded("chat", ["w1", "w2"]) == set()
    remote.apply("b", "pool", router, [(START, 7, "w2", 16, 0, -1), (START, 8, "w2", 16, 0, -1)],
                 3.0, [(7, "x"), (8, "y"), (99, "z")])  # fmt: skip
    assert router.adapters.crowded("chat", ["w1", "w2"]) == {"w2"}
    assert remote.forget("b") == 2  # b fell silent: its slots free
    assert router.adapters.crowded("chat", ["w1", "w2"]) == set()
    assert remote.expire(11.0) == 2  # a's START 1 (sql) and 3, their ENDs lost
    assert not router.adapters._workers["w1"].busy and not router.adapters._workers["w2"].busy


async def test_replicas_share_the_adapter_slots_their_requests_fill() -> None:
    """End to end over two feeds: b's requests for two adapters fill w1's two slots in a's
    view from the next batch; b's journal carries them beside the notes; at their end a
    sends a third adapter to w1 again. A batch of the older shape (no adapters) still reads,
    and a reader of the older shape still reads the notes of a new batch."""
    now = [100.0]
    bus = MemoryBus()
    ra, rb = _lora_router("w1", "w2"), _lora_router("w1", "w2")
    a = PlacementFeed(bus, ra.index, origin="a", clock=lambda: now[0], routers={"p": ra})
    b = PlacementFeed(bus, rb.index, origin="b", clock=lambda: now[0], routers={"p": rb})
    rb.journal = []
    d = rb.route([], 16, now=now[0], exclude=["w2"])
    tickets = [rb.started(d, 16, now[0], adapter) for adapter in ("sql", "legal")]
    rb.started(rb.route([], 16, now=now[0], exclude=["w1"]), 16, now[0])  # no adapter
    assert rb.journal_adapters == [(tickets[0].rid, "sql"), (tickets[1].rid, "legal")]
    (journal,) = b.take_journals()
    assert journal.adapters == [(tickets[0].rid, "sql"), (tickets[1].rid, "legal")]
    assert rb.journal == [] and rb.journal_adapters == []
    a.adopt(encode_placements(Placements(PROTOCOL_VERSION, "b", [], [journal])), "b")
    assert ra.adapters.crowded("chat", ["w1", "w2"]) == {"w1"}
    ra.index.stored("w1", None, CHAIN)
    assert ra.route(CHAIN, len(CHAIN), now[0], adapter="chat", dry_run=True).worker == "w2"

    for t in tickets:
        rb.finished(t, now[0])
    (ends,) = b.take_journals()
    new = encode_placements(Placements(PROTOCOL_VERSION, "b", [], [ends]))
    old = msgspec.msgpack.decode(new, type=_OldPlacements)
    assert old.journals[0].notes == ends.notes  # an older replica reads the notes
    a.adopt(msgspec.msgpack.encode(old), "b")  # a batch of the older shape
    assert ra.adapters.crowded("chat", ["w1", "w2"]) == set() and a.remote.stats.ended == 2
    assert ra.route(CHAIN, len(CHAIN), now[0], adapter="chat", dry_run=True).worker == "w1"
