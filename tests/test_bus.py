"""The EventBus contract, run against both implementations (memory and a real redis-server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis

from gateway.contract.bus import BusError, EventBus, MemoryBus
from gateway.contract.redis_bus import RedisBus
from gateway.contract.wire import (
    PROTOCOL_VERSION,
    Cleared,
    EngineReport,
    Entry,
    Removed,
    Snapshot,
    Stored,
    WorkerInfo,
    decode_entry,
    encode_entry,
)
from loadtest.harness import RedisServer


def entry(seq: int, *events: Stored | Removed | Cleared, epoch: int = 1) -> Entry:
    return Entry(PROTOCOL_VERSION, epoch, seq, 1.0, 2.0, [(0, seq, seq)], list(events))


@pytest.fixture(params=["memory", "redis"])
async def bus(request: pytest.FixtureRequest) -> AsyncIterator[EventBus]:
    if request.param == "memory":
        yield MemoryBus()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    b = RedisBus(server.url, prefix="t:")
    yield b
    await b.close()


async def test_append_and_read_many_streams(bus: EventBus) -> None:
    ids_a = await bus.append("a", [entry(1, Stored(None, [1, 2**64 - 1])), entry(2, Removed([1]))])
    ids_b = await bus.append("b", [entry(1, Cleared())])
    assert len(ids_a) == 2 and len(ids_b) == 1
    reads = {r.worker: r.entries for r in await bus.read({"a": "0", "b": "0", "c": "0"})}
    assert set(reads) == {"a", "b"}
    assert [sid for sid, _ in reads["a"]] == ids_a
    got = reads["a"][0][1]
    assert got is not None and got.events == [Stored(None, [1, 2**64 - 1])]
    assert reads["b"][0][1] == entry(1, Cleared())
    assert await bus.read({"a": ids_a[-1]}) == []
    one = await bus.read({"a": "0"}, count=1)
    assert len(one[0].entries) == 1


async def test_blocking_read_wakes_on_append(bus: EventBus) -> None:
    ids = await bus.append("a", [entry(1)])
    reader = asyncio.create_task(bus.read({"a": ids[0]}, block_ms=5000))
    await asyncio.sleep(0.05)
    await bus.append("a", [entry(2)])
    reads = await asyncio.wait_for(reader, 5)
    assert [e.seq for _, e in reads[0].entries if e] == [2]


async def test_trim_and_snapshot(bus: EventBus) -> None:
    ids = await bus.append("a", [entry(i) for i in range(1, 6)])
    await bus.trim("a", ids[2])
    (r,) = await bus.read({"a": "0"})
    assert next(e.seq for _, e in r.entries if e) <= 3  # approximate trimming may keep more
    assert await bus.read_snapshot("a") is None
    snap = Snapshot(PROTOCOL_VERSION, 1, 5, ids[-1], 3.0, [(None, [1, 2]), (2, [3])])
    await bus.write_snapshot("a", snap)
    assert await bus.read_snapshot("a") == snap


async def test_registry_and_reports(bus: EventBus) -> None:
    info = WorkerInfo("w1", "http://x", "m", labels={"zone": "a"}, epoch=7, kv_capacity_blocks=10)
    await bus.register(info, ttl=5)
    await bus.register(WorkerInfo("w2", "http://y", "m"), ttl=0.05)
    rep = EngineReport(running=2, waiting=1, kv_usage=0.5, prefix_cache_hits=3, ts=9.0)
    await bus.publish_report("w1", rep, ttl=5)
    await asyncio.sleep(0.1)  # w2's registration lapses (a real TTL, the thing under test)
    assert await bus.workers() == {"w1": info}
    assert await bus.read_reports(["w1", "w2"]) == {"w1": rep}
    await bus.deregister("w1")
    assert await bus.workers() == {}
    assert await bus.read_reports(["w1"]) == {}


async def test_registry_reads_decode_only_what_changed(redis_server: RedisServer) -> None:
    """An unchanged registration is the same record on every poll (not decoded again); a
    changed one is read anew, garbage is skipped, and a worker gone is forgotten."""
    bus = RedisBus(redis_server.url, prefix="t:")
    try:
        info = WorkerInfo("w1", "http://x", "m", epoch=1)
        await bus.register(info, ttl=5)
        first = (await bus.workers())["w1"]
        again = (await bus.workers())["w1"]
        assert first == info and again is first
        await bus.register(WorkerInfo("w1", "http://x", "m", epoch=2), ttl=5)  # agent restart
        assert (await bus.workers())["w1"].epoch == 2
        r = redis.Redis.from_url(redis_server.url)
        r.set(bus.layout.worker("w1"), b"{not json")
        assert await bus.workers() == {}  # garbage: skipped, not the last good record
        await bus.register(info, ttl=5)
        assert (await bus.workers())["w1"] == info
        await bus.deregister("w1")
        assert await bus.workers() == {} and bus._registrations == {}
    finally:
        await bus.close()


async def test_garbage_entry_reads_as_none(redis_server: RedisServer) -> None:
    bus = RedisBus(redis_server.url, prefix="t:")
    try:
        r = redis.Redis.from_url(redis_server.url)
        key = bus.layout.stream("a")
        r.xadd(key, {"e": b"\xc1junk"})
        r.xadd(key, {"other": b"x"})
        r.xadd(key, {"e": encode_entry(entry(1)).replace(b"\x01", b"\x09", 1)})
        (got,) = await bus.read({"a": "0"})
        assert [e for _, e in got.entries] == [None, None, None]
    finally:
        await bus.close()


async def test_redis_auth_and_outage(tmp_path) -> None:
    with RedisServer(password="s3cret", workdir=tmp_path) as server:
        bus = RedisBus(server.url, prefix="t:")
        try:
            await bus.ping()
            server.kill()
            with pytest.raises(BusError):
                await bus.append("a", [entry(1)])
            server.start()
            await bus.append("a", [entry(1)])  # reconnects by itself
            assert len((await bus.read({"a": "0"}))[0].entries) == 1
        finally:
            await bus.close()
        bad = RedisBus(f"redis://:wrong@127.0.0.1:{server.port}/0")
        try:
            with pytest.raises(BusError):
                await bad.ping()
        finally:
            await bad.close()


def test_entry_encoding_is_compact_and_versioned() -> None:
    keys = [2**64 - 1 - i for i in range(100)]
    data = encode_entry(entry(1, Stored(None, keys)))
    assert len(data) < 100 * 9 + 40  # msgpack uint64 = 9 bytes per key + a small header
    with pytest.raises(ValueError, match="newer"):
        decode_entry(encode_entry(Entry(PROTOCOL_VERSION + 1, 1, 1, 0, 0, [], [])))
    # fields appended by a later minor version are ignored
    longer = data[:1].replace(b"\x97", b"\x98") + data[1:] + b"\xc0"
    assert decode_entry(longer).events == [Stored(None, keys)]


async def test_memory_bus_outage() -> None:
    bus = MemoryBus()
    bus.set_down(True)
    with pytest.raises(BusError):
        await bus.workers()
    bus.set_down(False)
    assert await bus.workers() == {}


def test_protocol_document_vectors() -> None:
    """The test vector and the example entry printed in docs/protocol.md."""
    from pathlib import Path

    from gateway.routing.keys import BlockKeyer

    doc = Path(__file__).parent.parent.joinpath("docs", "protocol.md").read_text()
    keyer = BlockKeyer("kvroute", 16)
    k0, k1 = keyer.keys(list(range(1, 33)))
    assert f"0x{keyer.root_state():016x}" in doc
    assert f"0x{k0:016x}" in doc and f"0x{k1:016x}" in doc
    assert keyer.keys(list(range(17, 33)), parent=k0) == [k1]
    example = Entry(
        1, 1796000000000000, 1, 1.5, 1.6, [(0, 10, 12)],
        [Stored(None, [1, 2**64 - 1]), Removed([7]), Cleared()],
    )  # fmt: skip
    line = next(ln for ln in doc.splitlines() if ln.startswith("`97`"))
    assert bytes.fromhex(line.replace("`", "").replace(" ", "")) == encode_entry(example)
