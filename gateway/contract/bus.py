"""The event bus seam: how agents hand cache state, registrations and load to the gateway.

``EventBus`` is a small abstract base (like an httpx transport): the worker agent writes
through it, the gateway's consumer reads through it, and implementations are
interchangeable. ``MemoryBus`` keeps everything in process (the demo without a
redis-server, fast unit tests); ``gateway.contract.redis_bus.RedisBus`` is the production one.
Both store the bytes that ``gateway.contract.wire`` defines.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.contract.wire import (
    EngineReport,
    Entry,
    Snapshot,
    WorkerInfo,
    decode_report,
    decode_snapshot,
    decode_worker,
    encode_entry,
    encode_report,
    encode_snapshot,
    encode_worker,
    try_decode_entry,
)

_T = TypeVar("_T")

__all__ = [
    "BusError",
    "EventBus",
    "MemoryBus",
    "StreamRead",
    "stream_id_after",
    "wait_event",
]


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` up to ``seconds``; True if set. (``asyncio.timeout``, not
    ``wait_for``: on Python 3.11 ``wait_for`` can swallow a cancellation that races its
    timeout, and a loop that swallows its cancellation never stops.)"""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
        return True
    except TimeoutError:
        return False


class BusError(ConnectionError):
    """The bus is unreachable or refused an operation (callers retry with backoff)."""


# -- the seam --------------------------------------------------------------------------------


@dataclass
class StreamRead:
    """Entries read from one worker's stream; ``None`` marks an undecodable entry."""

    worker: str
    entries: list[tuple[str, Entry | None]]


class EventBus(ABC):
    """What agents and consumers need from the shared store, and nothing more.

    Every method may raise ``BusError`` when the store is unreachable; callers keep their
    state and retry (docs/protocol.md, "Recovery").
    """

    # streams
    @abstractmethod
    async def append(self, worker: str, entries: Sequence[Entry]) -> list[str]:
        """Append entries to ``worker``'s stream in order; returns their stream ids."""

    @abstractmethod
    async def read(
        self, positions: Mapping[str, str], count: int = 1000, block_ms: int | None = None
    ) -> list[StreamRead]:
        """Entries after ``positions[worker]`` (a stream id, ``"0"`` for the start) of many
        streams in one call; waits up to ``block_ms`` for any if none are ready."""

    @abstractmethod
    async def trim(self, worker: str, min_id: str) -> None:
        """Drop entries of ``worker``'s stream older than ``min_id``."""

    # snapshots
    @abstractmethod
    async def write_snapshot(self, worker: str, snapshot: Snapshot) -> None: ...

    @abstractmethod
    async def read_snapshot(self, worker: str) -> Snapshot | None: ...

    # registry
    @abstractmethod
    async def register(self, info: WorkerInfo, ttl: float) -> None:
        """Register or heartbeat ``info``; it lapses unless renewed within ``ttl`` seconds."""

    @abstractmethod
    async def deregister(self, worker: str) -> None:
        """Remove the registration and load report at once (graceful shutdown)."""

    @abstractmethod
    async def workers(self) -> dict[str, WorkerInfo]:
        """Registrations that have not lapsed."""

    # load
    @abstractmethod
    async def publish_report(self, worker: str, report: EngineReport, ttl: float) -> None: ...

    @abstractmethod
    async def read_reports(self, workers: Sequence[str]) -> dict[str, EngineReport]: ...

    # placements (gateway replica to gateway replica; optional)
    #: whether the methods below work: a bus for the agents alone need not carry them
    carries_placements = False

    async def publish_placements(self, origin: str, data: bytes) -> None:
        """Append one encoded ``Placements`` batch of replica ``origin`` to the replicas'
        shared stream (the origin beside it, so readers skip their own without decoding)."""
        raise BusError(f"{type(self).__name__} does not carry placements")

    async def placements_tail(self) -> str:
        """The id of the shared stream's latest entry (``"0-0"`` when empty): where a
        replica that starts, or lost its place, reads from."""
        raise BusError(f"{type(self).__name__} does not carry placements")

    async def read_placements(
        self, after: str, count: int = 256, block_ms: int | None = None
    ) -> list[tuple[str, str, bytes]]:
        """Batches after stream id ``after`` as (id, origin, bytes); waits up to ``block_ms``."""
        raise BusError(f"{type(self).__name__} does not carry placements")

    async def stream_bytes(self, worker: str) -> int:
        """Bytes the store spends on ``worker``'s stream (for benchmarks; 0 if unknown)."""
        return 0

    async def ping(self) -> None:  # noqa: B027 - optional, default: assume up
        """Raise ``BusError`` unless the store answers."""

    async def close(self) -> None:  # noqa: B027 - optional, nothing to release
        """Release connections."""


def stream_id_after(a: str, b: str) -> bool:
    """Whether stream id ``a`` is later than ``b`` (ids are ``<ms>-<n>``)."""
    return _id_tuple(a) > _id_tuple(b)


def _id_tuple(sid: str) -> tuple[int, int]:
    ms, _, n = sid.partition("-")
    return int(ms), int(n or 0)


# -- in-memory implementation ----------------------------------------------------------------


@dataclass
class _Stream:
    entries: list[tuple[tuple[int, int], bytes]] = field(default_factory=list)
    last: tuple[int, int] = (0, 0)


#: origin and batch stored together in the memory bus's placements stream
_PLACEMENT_SEP = b"\x00"


def _add(stream: _Stream, data: bytes) -> str:
    """Append ``data`` with a new id after the stream's last (Redis's ``<ms>-<n>``)."""
    ms = int(time.time() * 1000)
    sid = (ms, 0) if ms > stream.last[0] else (stream.last[0], stream.last[1] + 1)
    stream.last = sid
    stream.entries.append((sid, data))
    return f"{sid[0]}-{sid[1]}"


class MemoryBus(EventBus):
    """Everything in this process; encodes like ``RedisBus`` so the bytes are the same.

    ``clock`` is injectable so tests can lapse registrations without sleeping;
    ``set_down(True)`` makes every call raise ``BusError`` (an outage).
    """

    carries_placements = True
    #: placements batches kept (the Redis stream's approximate MAXLEN)
    placements_max_len = 10_000

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._placements = _Stream()
        self._streams: dict[str, _Stream] = {}
        self._snapshots: dict[str, bytes] = {}
        self._workers: dict[str, tuple[bytes, float]] = {}
        self._reports: dict[str, tuple[bytes, float]] = {}
        self._changed = asyncio.Condition()
        self._down = False

    def set_down(self, down: bool) -> None:
        self._down = down

    def _check(self) -> None:
        if self._down:
            raise BusError("memory bus is down")

    async def append(self, worker: str, entries: Sequence[Entry]) -> list[str]:
        self._check()
        stream = self._streams.setdefault(worker, _Stream())
        ids = [_add(stream, encode_entry(entry)) for entry in entries]
        async with self._changed:
            self._changed.notify_all()
        return ids

    async def publish_placements(self, origin: str, data: bytes) -> None:
        self._check()
        _add(self._placements, _PLACEMENT_SEP.join([origin.encode(), data]))
        del self._placements.entries[: -self.placements_max_len]
        async with self._changed:
            self._changed.notify_all()

    async def placements_tail(self) -> str:
        self._check()
        last = self._placements.last
        return f"{last[0]}-{last[1]}"

    async def read_placements(
        self, after: str, count: int = 256, block_ms: int | None = None
    ) -> list[tuple[str, str, bytes]]:
        return await self._waiting(lambda: self._placements_after(after, count), block_ms)

    def _placements_after(self, after: str, count: int) -> list[tuple[str, str, bytes]]:
        floor = _id_tuple(after)
        out = []
        for sid, d in self._placements.entries:
            if sid > floor:
                origin, _, data = d.partition(_PLACEMENT_SEP)
                out.append((f"{sid[0]}-{sid[1]}", origin.decode(), data))
                if len(out) >= count:
                    break
        return out

    async def read(
        self, positions: Mapping[str, str], count: int = 1000, block_ms: int | None = None
    ) -> list[StreamRead]:
        return await self._waiting(lambda: self._collect(positions, count), block_ms)

    async def _waiting(self, collect: Callable[[], list[_T]], block_ms: int | None) -> list[_T]:
        """``collect()``, or, when it finds nothing, once more after the next append (up to
        ``block_ms``), as a blocking XREAD does."""
        self._check()
        out = collect()
        if out or not block_ms:
            return out
        try:
            async with self._changed, asyncio.timeout(block_ms / 1000):
                await self._changed.wait()
        except TimeoutError:
            return []
        self._check()
        return collect()

    def _collect(self, positions: Mapping[str, str], count: int) -> list[StreamRead]:
        out = []
        for worker, pos in positions.items():
            stream = self._streams.get(worker)
            if stream is None:
                continue
            after = _id_tuple(pos)
            got: list[tuple[str, Entry | None]] = []
            for sid, data in stream.entries:
                if sid > after:
                    got.append((f"{sid[0]}-{sid[1]}", try_decode_entry(data)))
                    if len(got) >= count:
                        break
            if got:
                out.append(StreamRead(worker, got))
        return out

    async def trim(self, worker: str, min_id: str) -> None:
        self._check()
        stream = self._streams.get(worker)
        if stream is not None:
            floor = _id_tuple(min_id)
            stream.entries = [e for e in stream.entries if e[0] >= floor]

    async def write_snapshot(self, worker: str, snapshot: Snapshot) -> None:
        self._check()
        self._snapshots[worker] = encode_snapshot(snapshot)

    async def read_snapshot(self, worker: str) -> Snapshot | None:
        self._check()
        data = self._snapshots.get(worker)
        return None if data is None else decode_snapshot(data)

    async def register(self, info: WorkerInfo, ttl: float) -> None:
        self._check()
        self._workers[info.worker_id] = (encode_worker(info), self._clock() + ttl)

    async def deregister(self, worker: str) -> None:
        self._check()
        self._workers.pop(worker, None)
        self._reports.pop(worker, None)

    async def workers(self) -> dict[str, WorkerInfo]:
        self._check()
        now = self._clock()
        return {w: decode_worker(d) for w, (d, exp) in self._workers.items() if exp > now}

    async def publish_report(self, worker: str, report: EngineReport, ttl: float) -> None:
        self._check()
        self._reports[worker] = (encode_report(report), self._clock() + ttl)

    async def read_reports(self, workers: Sequence[str]) -> dict[str, EngineReport]:
        self._check()
        now = self._clock()
        out = {}
        for w in workers:
            rec = self._reports.get(w)
            if rec is not None and rec[1] > now:
                out[w] = decode_report(rec[0])
        return out

    async def stream_bytes(self, worker: str) -> int:
        stream = self._streams.get(worker)
        return 0 if stream is None else sum(len(d) for _, d in stream.entries)

    async def ping(self) -> None:
        self._check()

    def wipe(self) -> None:
        """Lose everything, like a Redis restart without persistence (for tests)."""
        self._streams.clear()
        self._placements = _Stream()
        self._snapshots.clear()
        self._workers.clear()
        self._reports.clear()
