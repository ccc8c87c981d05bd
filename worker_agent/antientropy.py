"""Anti-entropy, writer side: stamp the mirror's digest on a stream entry every interval.

A reader's index can drift from the mirror without any sequence gap (an entry lost or
rewritten between agent and Redis, a reader bug): nothing else would notice until a restart.
So every ``digest_interval`` the agent stamps ``Digest(blocks, key_digest(mirror))`` on an
entry; a reader that has applied exactly that entry compares like with like and, on a
mismatch, re-bootstraps the worker from its snapshot (``gateway/antientropy.py``).

The stamp rides on the entry itself, not on a separate record, so the comparison holds under
any traffic: a record read later would describe a position the reader has already left.
``DigestingBus`` wraps the bus the publisher writes through: when ``append`` is called the
publisher has just sealed every pending event (no await in between), so the mirror is
exactly the state after the last entry of the call. An idle worker gets an empty entry
(``Removed([])``, a no-op) to carry its stamp, and a snapshot at once, so a reader that finds
a mismatch finds a snapshot covering it within one round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from gateway.contract.bus import EventBus, StreamRead, wait_event
from gateway.contract.wire import (
    Digest,
    EngineReport,
    Entry,
    Removed,
    Snapshot,
    WorkerInfo,
    key_digest,
)
from worker_agent.publisher import Publisher

__all__ = ["DigestingBus", "digest_loop"]


class DigestingBus(EventBus):
    """``bus`` for one publisher, stamping the mirror's digest on the next entry after
    ``request()``. ``parents`` is the mirror's key -> parent map (its keys are the set)."""

    def __init__(self, bus: EventBus, parents: Callable[[], Mapping[int, int | None]]) -> None:
        self.bus = bus
        self._parents = parents
        self._due = False
        self.stamped = 0  # entries stamped (tests, metrics)

    def request(self) -> None:
        self._due = True

    async def append(self, worker: str, entries: Sequence[Entry]) -> list[str]:
        if self._due and entries:  # synchronous up to here: the mirror is after entries[-1]
            keys = self._parents().keys()
            entries[-1].digest = Digest(len(keys), key_digest(keys))
            self._due = False
            self.stamped += 1
        return await self.bus.append(worker, entries)

    # -- everything else goes straight through ----------------------------------------------

    async def read(
        self, positions: Mapping[str, str], count: int = 1000, block_ms: int | None = None
    ) -> list[StreamRead]:
        return await self.bus.read(positions, count, block_ms)

    async def trim(self, worker: str, min_id: str) -> None:
        await self.bus.trim(worker, min_id)

    async def write_snapshot(self, worker: str, snapshot: Snapshot) -> None:
        await self.bus.write_snapshot(worker, snapshot)

    async def read_snapshot(self, worker: str) -> Snapshot | None:
        return await self.bus.read_snapshot(worker)

    async def register(self, info: WorkerInfo, ttl: float) -> None:
        await self.bus.register(info, ttl)

    async def deregister(self, worker: str) -> None:
        await self.bus.deregister(worker)

    async def workers(self) -> dict[str, WorkerInfo]:
        return await self.bus.workers()

    async def publish_report(self, worker: str, report: EngineReport, ttl: float) -> None:
        await self.bus.publish_report(worker, report, ttl)

    async def read_reports(self, workers: Sequence[str]) -> dict[str, EngineReport]:
        return await self.bus.read_reports(workers)


async def digest_loop(
    domains: Sequence[tuple[Publisher, DigestingBus, int]],
    interval: float,
    stopping: Callable[[], bool],
) -> None:
    """Every ``interval``: for each (publisher, its bus, a rank of it), stamp the next entry,
    make sure there is one, and have a snapshot follow it."""
    if interval <= 0:
        return
    await asyncio.gather(*(wait_event(pub.started, 5.0) for pub, _, _ in domains))
    while not stopping():
        await asyncio.sleep(interval)
        for pub, bus, rank in domains:
            bus.request()
            pub.add([Removed([])], rank, -1, 0.0)
            pub.request_snapshot()
