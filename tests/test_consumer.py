"""The gateway's consumer: the pure applier, and the service on the in-memory bus."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable
from typing import Any, cast

import pytest
from agent_helpers import wait_until

from gateway.consumer import Applied, Consumer, ConsumerConfig, StreamApplier
from gateway.contract.bus import BusError, MemoryBus, StreamRead
from gateway.contract.wire import (
    PROTOCOL_VERSION,
    Cleared,
    EngineReport,
    Entry,
    Event,
    Removed,
    Snapshot,
    Stored,
    WorkerInfo,
)
from gateway.routing.index import ShadowIndex
from worker_agent.mirror import WorkerMirror, build_chains


class Writer:
    """A minimal agent: a mirror, sequenced entries of one epoch, snapshots."""

    def __init__(self, worker: str, epoch: int = 1, seed: int = 0) -> None:
        self.worker = worker
        self.epoch = epoch
        self.seq = 0
        self.mirror = WorkerMirror()
        self.rng = random.Random(seed)
        self.next_key = seed * 1_000_000 + 1
        self.last_id = "0-0"

    def entry(self, events: list[Event]) -> Entry:
        self.seq += 1
        return Entry(PROTOCOL_VERSION, self.epoch, self.seq, 0.0, 0.0, [], events)

    def random_events(self, n: int = 5) -> list[Event]:
        out: list[Event] = []
        for _ in range(n):
            keys = list(self.mirror.parent)
            r = self.rng.random()
            if r < 0.55 or not keys:
                parent = self.rng.choice(keys) if keys and self.rng.random() < 0.7 else None
                chain = list(range(self.next_key, self.next_key + self.rng.randint(1, 6)))
                self.next_key += len(chain)
                out.extend(self.mirror.add([(parent, chain)]))
            elif r < 0.97:
                out.extend(self.mirror.drop(self.rng.sample(keys, min(len(keys), 3))))
            else:
                out.extend(self.mirror.clear())
        return out

    def snapshot(self) -> Snapshot:
        chains = build_chains(dict(self.mirror.parent))
        return Snapshot(PROTOCOL_VERSION, self.epoch, self.seq, self.last_id, 0.0, chains)

    async def publish(self, bus: MemoryBus, entries: Iterable[Entry]) -> list[str]:
        ids = await bus.append(self.worker, list(entries))
        self.last_id = ids[-1]
        return ids


# -- the pure applier ------------------------------------------------------------------------


def test_applier_applies_in_order_and_batches_removes() -> None:
    calls: list[int] = []

    class CountingIndex:  # a wrapper: the compiled ShadowIndex takes no Python subclass
        def __init__(self) -> None:
            self.index = ShadowIndex()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.index, name)

        def removed(self, worker: str, keys: Iterable[int]) -> None:
            keys = list(keys)
            calls.append(len(keys))
            self.index.removed(worker, keys)

    app = StreamApplier(cast(ShadowIndex, CountingIndex()))
    e1 = Entry(1, 5, 1, 0, 0, [], [Stored(None, [1, 2, 3]), Stored(3, [4])])
    e2 = Entry(1, 5, 2, 0, 0, [], [Removed([4]), Removed([3]), Stored(2, [9]), Removed([9])])
    assert app.apply("w", "1-0", e1) is Applied.APPLIED
    assert app.apply("w", "2-0", e2) is Applied.APPLIED
    assert calls == [2, 1]
    assert app.index.worker_keys("w") == {1, 2}
    assert app.apply("w", "2-0", e2) is Applied.DUPLICATE
    assert app.cursors["w"].stream_id == "2-0"


def test_applier_epochs() -> None:
    app = StreamApplier(ShadowIndex())
    app.apply("w", "1-0", Entry(1, 5, 1, 0, 0, [], [Stored(None, [1])]))
    assert app.apply("w", "2-0", Entry(1, 4, 9, 0, 0, [], [Stored(None, [2])])) is Applied.STALE
    assert app.index.worker_keys("w") == {1}
    # a new agent run: its first entry clears the old run's state
    assert app.apply("w", "3-0", Entry(1, 6, 1, 0, 0, [], [Cleared(), Stored(None, [3])]))
    assert app.index.worker_keys("w") == {3}
    # the registry can announce the new epoch first: state is dropped at once
    assert app.new_epoch("w", 7) and app.index.worker_keys("w") == set()
    assert not app.new_epoch("w", 7)


def test_applier_gap_waits_for_a_covering_snapshot() -> None:
    app = StreamApplier(ShadowIndex())
    app.apply("w", "1-0", Entry(1, 5, 1, 0, 0, [], [Stored(None, [1])]))
    assert app.apply("w", "3-0", Entry(1, 5, 3, 0, 0, [], [Stored(None, [3])])) is Applied.GAP
    assert app.apply("w", "4-0", Entry(1, 5, 4, 0, 0, [], [])) is Applied.WAITING
    assert app.index.worker_keys("w") == {1}  # the last state is kept meanwhile
    old = Snapshot(1, 5, 1, "1-0", 0, [(None, [1])])
    assert not app.covers("w", old)
    good = Snapshot(1, 5, 3, "3-0", 0, [(None, [1]), (None, [2]), (None, [3])])
    assert app.covers("w", good)
    app.bootstrap("w", good)
    assert app.index.worker_keys("w") == {1, 2, 3}
    assert app.apply("w", "4-0", Entry(1, 5, 4, 0, 0, [], [Removed([2])])) is Applied.APPLIED
    assert app.index.worker_keys("w") == {1, 3}
    assert app.apply("w", "5-0", None) is Applied.CORRUPT
    assert app.cursors["w"].waiting


def test_applier_without_snapshot_needs_the_epoch_start() -> None:
    app = StreamApplier(ShadowIndex())
    app.bootstrap("w", None)
    assert app.apply("w", "1-0", Entry(1, 5, 2, 0, 0, [], [])) is Applied.GAP
    app.bootstrap("v", None)
    assert app.apply("v", "1-0", Entry(1, 5, 1, 0, 0, [], [Cleared()])) is Applied.APPLIED


def test_snapshot_plus_tail_equals_reading_everything() -> None:
    w = Writer("w", seed=3)
    entries = [w.entry(w.random_events()) for _ in range(200)]
    full = StreamApplier(ShadowIndex())
    for i, e in enumerate(entries):
        full.apply("w", f"{i + 1}-0", e)
    assert full.index.worker_keys("w") == w.mirror.keys()
    # snapshot at entry 120 (rebuild the mirror state there), then the tail
    w2 = Writer("w", seed=3)
    for _ in range(120):
        w2.entry(w2.random_events())
    w2.last_id = "120-0"
    boot = StreamApplier(ShadowIndex())
    boot.bootstrap("w", w2.snapshot())
    for i, e in enumerate(entries[120:], start=120):
        assert boot.apply("w", f"{i + 1}-0", e) is Applied.APPLIED
    assert boot.index.worker_keys("w") == full.index.worker_keys("w")


# -- the service on the memory bus -----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fast() -> ConsumerConfig:
    return ConsumerConfig(block_ms=20, poll_interval=0.02, snapshot_retry=0.02, expiry_grace=0)


async def test_consumer_bootstraps_and_follows() -> None:
    bus = MemoryBus()
    writers = [Writer(f"w{i}", seed=i) for i in range(3)]
    for w in writers:
        await w.publish(bus, [w.entry([Cleared()])])
        await w.publish(bus, [w.entry(w.random_events()) for _ in range(30)])
        await bus.write_snapshot(w.worker, w.snapshot())
        await w.publish(bus, [w.entry(w.random_events()) for _ in range(10)])
        await bus.register(WorkerInfo(w.worker, "http://x", "m", epoch=1), ttl=60)
    events: list[tuple[str, str]] = []
    async with Consumer(bus, config=fast()) as c:
        c.subscribe(lambda kind, worker: events.append((kind, worker)))
        await c.wait_synced(5)
        for w in writers:
            await w.publish(bus, [w.entry(w.random_events()) for _ in range(10)])

        def equal() -> bool:
            return all(c.index.worker_keys(w.worker) == w.mirror.keys() for w in writers)

        await wait_until(equal, 5, "consumer == writers")
        await bus.publish_report("w1", EngineReport(running=3, ts=1.0), ttl=60)
        await wait_until(lambda: c.report("w1") is not None, 5, "report")
        assert c.report("w1") == EngineReport(running=3, ts=1.0)
        assert set(c.workers()) == {"w0", "w1", "w2"}
        assert ("report", "w1") in events
        assert c.stats.apply.bootstraps == 3 and c.stats.resyncs == 0


class PartitionedBus(MemoryBus):
    """Readers cut off while writers still work (a consumer that falls behind)."""

    reads_down = False

    async def read(self, *args: Any, **kwargs: Any) -> list[StreamRead]:
        if self.reads_down:
            raise BusError("partitioned")
        return await super().read(*args, **kwargs)


class OddlyFailingBus(MemoryBus):
    """Reads that fail once with an error that is not a BusError (a client library's own)."""

    fail_next = False

    async def read(self, *args: Any, **kwargs: Any) -> list[StreamRead]:
        if self.fail_next:
            self.fail_next = False
            raise IndexError("list index out of range")
        return await super().read(*args, **kwargs)


async def test_a_read_failing_with_any_error_does_not_stop_the_consumer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A read that raises something other than a BusError is a failed read: counted,
    logged with its traceback, retried; the consumer goes on applying what follows (its read
    task ending there froze the index for good in a Redis Cluster failover)."""
    bus = OddlyFailingBus()
    w = Writer("w", seed=1)
    await w.publish(bus, [w.entry([Cleared()])])
    await bus.register(WorkerInfo("w", "http://x", "m", epoch=1), ttl=60)
    async with Consumer(bus, config=fast()) as c:
        await wait_until(lambda: c.applier.cursors.get("w") is not None, 5, "bootstrap")
        errors = c.stats.bus_errors
        bus.fail_next = True
        await wait_until(lambda: not bus.fail_next, 5, "the failing read")
        for _ in range(3):
            await w.publish(bus, [w.entry(w.random_events())])
        await wait_until(lambda: c.index.worker_keys("w") == w.mirror.keys(), 5, "caught up")
        assert c.stats.bus_errors == errors + 1
        assert any(
            "failed unexpectedly" in r.message
            and r.exc_info is not None
            and r.exc_info[0] is IndexError
            for r in caplog.records
        )


async def _missed_behind_a_trim(
    bus: PartitionedBus, w: Writer, missed: int, snapshot: bool = True
) -> None:
    """Cut the consumer's reads while ``w`` publishes ``missed`` entries (then a snapshot
    covering them, unless not), and trim them from the stream: what it missed is gone. The
    caller turns the reads back on."""
    bus.reads_down = True
    ids = []
    for _ in range(missed):
        ids += await w.publish(bus, [w.entry(w.random_events())])
    if snapshot:
        await bus.write_snapshot(w.worker, w.snapshot())
    await bus.trim(w.worker, ids[-1])


async def test_consumer_behind_a_trim_rebootstraps() -> None:
    bus = PartitionedBus()
    w = Writer("w", seed=1)
    await w.publish(bus, [w.entry([Cleared()])])
    await bus.register(WorkerInfo("w", "http://x", "m", epoch=1), ttl=60)
    async with Consumer(bus, config=fast()) as c:
        await wait_until(lambda: c.applier.cursors.get("w") is not None, 5, "bootstrap")
        await _missed_behind_a_trim(bus, w, 20)
        for _ in range(5):
            await w.publish(bus, [w.entry(w.random_events())])
        bus.reads_down = False
        await wait_until(lambda: c.index.worker_keys("w") == w.mirror.keys(), 5, "resync")
        assert c.stats.resyncs == 1 and c.stats.apply.gaps == 1


@pytest.mark.parametrize("heal", ["snapshot", "new_epoch"])
async def test_the_gateways_trust_follows_a_stream_gap_at_the_event_not_at_a_tick(
    heal: str,
) -> None:
    """The gap's opening and its heal (by a covering snapshot, or by the agent's next run
    starting a new epoch) change the worker's trust verdict when the consumer sees them:
    between the two, routing must not believe the stale entries, and after the heal it must
    not ignore the healed ones (a request routed then, by load alone, predicted nothing on a
    worker that held its prefix). The gateway's tick is not running here, so only the events
    can have changed the verdicts each listener call observes."""
    from gateway.config import GatewayConfig, PoolSettings, RedisSettings
    from gateway.server import Gateway
    from gateway.tokenization import bundled_test_tokenizer

    bus = PartitionedBus()
    pools = [PoolSettings("m", str(bundled_test_tokenizer()), chat_template="deepseek-v3")]
    cfg = GatewayConfig(pools=pools, redis=RedisSettings("redis://127.0.0.1:9"))
    cfg.index.verify_engine_tokenizer = False
    cfg.validate()
    gw = Gateway(cfg, bus=bus)
    c = gw.consumer
    assert c is not None
    c.config = fast()
    seen: list[tuple[str, dict[str, str]]] = []
    c.subscribe(gw._on_bus_change)
    c.subscribe(lambda kind, worker: seen.append((kind, dict(gw.registry.trust.why))))
    w = Writer("w", seed=3)
    await w.publish(bus, [w.entry([Cleared()])])
    await bus.register(WorkerInfo("w", "http://x", "m", epoch=1), ttl=60)
    async with c:
        await wait_until(lambda: c.applier.cursors.get("w") is not None, 5, "bootstrap")
        await _missed_behind_a_trim(bus, w, 10, snapshot=heal == "snapshot")
        if heal == "new_epoch":  # no snapshot covers the gap: the agent's next run closes it
            w = Writer("w", epoch=2, seed=4)
            await w.publish(bus, [w.entry([Cleared()])])
        await w.publish(bus, [w.entry(w.random_events())])
        bus.reads_down = False
        await wait_until(lambda: ("healed", {}) in seen, 5, "healed")
        assert c.index.worker_keys("w") == w.mirror.keys()
    kinds = [k for k, _ in seen if k in ("gap", "healed")]
    assert kinds == ["gap", "healed"], seen
    assert ("gap", {"w": "stream_gap"}) in seen, seen
    assert gw.registry.trust.why == {}


async def test_consumer_expires_workers_and_keeps_index_through_outages() -> None:
    clock = Clock()
    bus = MemoryBus(clock=clock)
    w = Writer("w")
    await w.publish(bus, [w.entry([Cleared(), Stored(None, [1, 2])])])
    await bus.register(WorkerInfo("w", "http://x", "m", epoch=1), ttl=3)
    removed: list[str] = []
    async with Consumer(bus, config=fast()) as c:
        c.subscribe(lambda kind, worker: removed.append(worker) if kind == "removed" else None)
        await wait_until(lambda: c.index.worker_keys("w") == {1, 2}, 5, "applied")
        bus.set_down(True)
        await wait_until(lambda: not c.stats.connected, 5, "outage seen")
        clock.t += 10  # registrations lapse during the outage...
        await wait_until(lambda: c.stats.bus_errors > 3, 5, "retries")
        assert c.index.worker_keys("w") == {1, 2}  # ...but nothing is dropped while down
        bus.set_down(False)
        await w.publish(bus, [w.entry([Removed([1])])])
        await bus.register(WorkerInfo("w", "http://x", "m", epoch=1), ttl=3)
        await wait_until(lambda: c.index.worker_keys("w") == {2}, 5, "caught up")
        clock.t += 10  # now the worker really goes away
        await wait_until(lambda: "w" not in c.workers(), 5, "expiry")
        assert removed == ["w"] and "w" not in c.index
        assert c.stats.workers_expired == 1


class CountingBus(MemoryBus):
    """Counts registry reads, so a test can wait for the consumer's next polls."""

    registry_reads = 0

    async def workers(self) -> dict[str, WorkerInfo]:
        out = await super().workers()
        self.registry_reads += 1
        return out


async def test_consumer_gives_agents_a_grace_after_redis_comes_back_empty() -> None:
    """A restarted Redis has lost every registration; agents re-register within a heartbeat.
    Until the grace after the reconnection is over, nobody is expired (no 503 blip)."""
    clock = Clock()
    bus = CountingBus(clock=clock)
    w = Writer("w")
    await w.publish(bus, [w.entry([Cleared(), Stored(None, [1, 2])])])
    await bus.register(WorkerInfo("w", "http://x", "m", epoch=1), ttl=3)
    grace = 0.5
    config = ConsumerConfig(
        block_ms=20, poll_interval=0.02, snapshot_retry=0.02, expiry_grace=grace
    )
    removed: list[str] = []
    async with Consumer(bus, config=config) as c:
        c.subscribe(lambda kind, worker: removed.append(worker) if kind == "removed" else None)
        await wait_until(lambda: c.index.worker_keys("w") == {1, 2}, 5, "applied")
        bus.set_down(True)
        await wait_until(lambda: not c.stats.connected, 5, "outage seen")
        clock.t += 10  # the registration is gone when Redis comes back (restarted empty)
        # the outage outlasts the grace: what is tested is that the grace counts from the
        # reconnection, so real time must pass here
        await asyncio.sleep(grace * 1.5)
        bus.set_down(False)
        await wait_until(lambda: c.stats.connected, 5, "reconnected")
        reads = bus.registry_reads
        await wait_until(lambda: bus.registry_reads >= reads + 5, 5, "polls after reconnect")
        assert "w" in c.workers() and removed == []
        await bus.register(WorkerInfo("w", "http://x", "m", epoch=1), ttl=3)  # the heartbeat
        reads = bus.registry_reads
        await wait_until(lambda: bus.registry_reads >= reads + 2, 5, "re-registration seen")
        await asyncio.sleep(grace * 1.5)  # past the grace: still there, because registered
        assert "w" in c.workers() and removed == [] and c.index.worker_keys("w") == {1, 2}


async def test_consumer_drops_old_epoch_on_agent_restart() -> None:
    bus = MemoryBus()
    old = Writer("w", epoch=1)
    await old.publish(bus, [old.entry([Cleared(), Stored(None, [1, 2])])])
    await bus.register(WorkerInfo("w", "http://x", "m", epoch=1), ttl=60)
    async with Consumer(bus, config=fast()) as c:
        await wait_until(lambda: c.index.worker_keys("w") == {1, 2}, 5, "applied")
        new = Writer("w", epoch=2)
        await new.publish(bus, [new.entry([Cleared(), Stored(None, [7])])])
        await old.publish(bus, [old.entry([Stored(2, [3])])])  # a late write of the old run
        await wait_until(lambda: c.index.worker_keys("w") == {7}, 5, "new epoch")
        await wait_until(lambda: c.stats.apply.entries_stale == 1, 5, "stale dropped")
        assert c.index.worker_keys("w") == {7}


async def test_a_fleets_reports_are_applied_in_steps_that_let_requests_run() -> None:
    """Thousands of load reports per poll are handed to the listeners in chunks, yielding to
    the event loop between them, so a large fleet's poll does not stall the requests the
    same loop serves; every changed report still reaches the listeners once."""
    consumer = Consumer(MemoryBus(), ShadowIndex())
    seen: list[str] = []
    consumer.subscribe(lambda kind, w: seen.append(w) if kind == "report" else None)
    reports = {f"w{i:04d}": EngineReport(running=i % 3, ts=1.0) for i in range(1000)}
    ticks = 0

    async def other_work() -> None:  # stands for the requests served by the same loop
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)  # the other work has started
    before = ticks
    await consumer._update_reports(reports)
    during = ticks - before
    task.cancel()
    assert during >= 3  # 1,000 reports in steps of 256: the loop ran between them
    assert sorted(seen) == sorted(reports)
    seen.clear()
    await consumer._update_reports(reports)  # nothing changed: nothing emitted
    assert seen == []


class ReadLog(MemoryBus):
    """Records when each read started and how many entries it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[float, int]] = []

    async def read(self, *args: Any, **kwargs: Any) -> list[StreamRead]:
        started = time.monotonic()
        got = await super().read(*args, **kwargs)
        self.reads.append((started, sum(len(r.entries) for r in got)))
        return got


async def test_entries_arriving_within_the_read_interval_come_in_one_read() -> None:
    """``read_interval``: after a read that returned entries the consumer waits out the
    interval, so entries appended one by one meanwhile cost one round trip, not one each."""
    bus = ReadLog()
    w = Writer("w0")
    await w.publish(bus, [w.entry([Cleared()])])
    await bus.register(WorkerInfo("w0", "http://x", "m", epoch=1), ttl=60)
    interval = 1.0
    config = ConsumerConfig(block_ms=20, poll_interval=0.02, expiry_grace=0)
    config.read_interval = interval
    async with Consumer(bus, config=config) as c:
        await c.wait_synced(5)
        await wait_until(lambda: c.applier.cursor("w0").seq == w.seq, 5, "the start")
        before = len(bus.reads)
        await w.publish(bus, [w.entry(w.random_events())])
        await wait_until(lambda: c.applier.cursor("w0").seq == w.seq, 5, "first entry")
        first = next(i for i in range(before, len(bus.reads)) if bus.reads[i][1])
        for _ in range(10):  # one append each, the consumer free to run between them
            await w.publish(bus, [w.entry(w.random_events())])
            await asyncio.sleep(0)
        await wait_until(lambda: c.index.worker_keys("w0") == w.mirror.keys(), 5, "all ten")
        later = [(t, n) for t, n in bus.reads[first + 1 :] if n]
        assert [n for _, n in later] == [10]  # one read for the ten
        assert later[0][0] - bus.reads[first][0] >= interval
