"""Canonical events → the worker's stream: batching, sequencing, outages, snapshots, trims.

* Events are queued synchronously by the pipeline and written by one task: whatever queued
  while the previous XADD pipeline was in flight goes out in the next one (batching without
  a timer, so latency stays one round trip under light load).
* Each entry gets the next ``seq`` of this agent's ``epoch`` when it is built; an entry is
  retried with the same seq until the bus acknowledges it, so readers see no gaps.
* Bus down: entries and new events stay buffered; past ``max_buffer_events`` keys the whole
  buffer is dropped (logged, counted in ``buffer_overflows``) and, once the bus is back, the
  mirror itself is published as clear + stores (a resync) rather than anything stale. After
  every reconnect a snapshot is written at once (the store may have lost everything, e.g. a
  Redis restart without persistence).
* Failures back off: after a failed bus operation nothing is tried before a capped,
  exponentially growing delay with jitter (hundreds of agents must not hammer a Redis that
  is failing over, nor spin a core each). The agent's heartbeat and load loops report their
  own bus results here (``bus_ok``/``bus_failed``), so one backoff and one honest
  ``redis_connected`` gauge cover every use of the bus: 0 from the first failure until an
  operation succeeds again.
* Snapshots are captured synchronously right after a drain, so they equal the state after
  the last built entry; the stream is trimmed (MINID) to the previous snapshot's id so a
  reader lagging by less than one snapshot interval never needs a re-bootstrap.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.contract.bus import BusError, EventBus, wait_event
from gateway.contract.wire import PROTOCOL_VERSION, Cleared, Entry, Event, Removed, Snapshot, Stored
from worker_agent.canonical import Chain
from worker_agent.metrics import AgentMetrics
from worker_agent.mirror import build_chains

__all__ = ["Publisher", "PublisherSettings"]

log = logging.getLogger(__name__)


@dataclass
class PublisherSettings:
    max_entry_keys: int = 4096  # keys per stream entry (large batches are split)
    max_buffer_events: int = 200_000  # buffered canonical keys before the resync policy
    snapshot_interval: float = 10.0  # seconds between snapshots
    #: delay after the first failed bus operation, doubling per failure up to backoff_max;
    #: each delay is drawn uniformly from [delay/2, delay] (jitter)
    backoff_min: float = 0.1
    backoff_max: float = 2.0


@dataclass
class _Chunk:
    events: list[Event]
    rank: int
    seq: int
    ts: float
    size: int = 0


@dataclass
class _State:
    pending: list[_Chunk] = field(default_factory=list)
    pending_size: int = 0
    unsent: list[Entry] = field(default_factory=list)
    unsent_size: int = 0


class Publisher:
    """Writes one worker's canonical events to the bus under one epoch."""

    def __init__(
        self,
        bus: EventBus,
        worker: str,
        epoch: int,
        parents: Callable[[], dict[int, int | None]],
        metrics: AgentMetrics,
        settings: PublisherSettings | None = None,
    ) -> None:
        self.bus = bus
        self.worker = worker
        self.epoch = epoch
        self.settings = settings or PublisherSettings()
        self.metrics = metrics
        self._parents = parents  # the mirror's key -> parent map (snapshot source)
        self._st = _State()
        self.seq = 0  # last seq assigned to an entry
        self.acked_seq = 0  # last seq the bus acknowledged
        self.last_id = "0-0"  # stream id of the acknowledged entry ``acked_seq``
        self._prev_snapshot_id: str | None = None
        self._snapshot_due = True
        self._next_snapshot = 0.0
        self._resync = False
        self._snapshot_task: asyncio.Task[None] | None = None
        self.snapshots_written = 0
        self._connected = False  # until a bus operation succeeds (the gauge says 0 till then)
        self._ever_connected = False
        self._failures = 0  # consecutive failed bus operations
        self._retry_at = 0.0  # monotonic time before which the bus is left alone
        self._rng = random.Random()
        self.metrics.connected.set(0)
        self._wake = asyncio.Event()
        self.started = asyncio.Event()  # set after the first acknowledged write
        self.idle = asyncio.Event()  # set whenever nothing is queued or unsent
        self.stopping = False  # ends ``run`` at its next iteration

    # -- input (synchronous, from the pipeline) ---------------------------------------------

    def add(self, events: list[Event], rank: int, seq: int, ts: float) -> None:
        if not events:
            return
        size = sum(_size(e) for e in events)
        st = self._st
        st.pending.append(_Chunk(events, rank, seq, ts, size))
        st.pending_size += size
        self.idle.clear()
        if st.pending_size + st.unsent_size > self.settings.max_buffer_events:
            self._overflow()
        self.metrics.buffer_depth.set(st.pending_size + st.unsent_size)
        self._wake.set()

    def request_snapshot(self) -> None:
        self._snapshot_due = True
        self._wake.set()

    # -- the writer task --------------------------------------------------------------------

    async def run(self) -> None:
        while not self.stopping:
            backoff = self._retry_at - time.monotonic()
            if backoff > 0:
                # events keep queueing (add() is synchronous); a wake-up only ends the wait
                # early if another loop saw the bus answer (bus_ok resets _retry_at)
                self._wake.clear()
                await wait_event(self._wake, backoff)
                continue
            if not self._has_work():
                self.idle.set()
                self._wake.clear()
                due_in = max(0.0, self._next_snapshot - time.monotonic())
                if not await wait_event(self._wake, due_in):
                    self._snapshot_due = True
                continue  # re-check the backoff: another loop may have seen the bus fail
            try:
                if await self._step():
                    self.bus_ok()
            except BusError as exc:
                self.metrics.publish_errors.inc()
                self.bus_failed(exc)

    # -- the bus's health, shared with the agent's other loops ------------------------------

    def may_use_bus(self) -> bool:
        """False while backing off after a failure (callers skip optional bus writes)."""
        return time.monotonic() >= self._retry_at

    def bus_ok(self) -> None:
        """A bus operation succeeded: reset the backoff; after an outage, resume at once."""
        self._failures = 0
        self._retry_at = 0.0
        self._set_connected(True)

    def bus_failed(self, exc: BaseException) -> None:
        """A bus operation failed: nothing more is tried before a jittered, capped delay."""
        s = self.settings
        delay = min(s.backoff_max, s.backoff_min * 2**self._failures)
        self._failures = min(self._failures + 1, 32)
        self._retry_at = time.monotonic() + self._rng.uniform(delay / 2, delay)
        self._set_connected(False, exc)

    async def flush(self, within: float) -> bool:
        """Wait until everything queued so far is acknowledged (graceful shutdown)."""
        self._wake.set()
        return await wait_event(self.idle, within)

    def _has_work(self) -> bool:
        st = self._st
        snapshot_due = self._snapshot_due and self._snapshot_task is None
        return bool(st.pending or st.unsent or self._resync) or snapshot_due

    async def _step(self) -> bool:
        """Build, send and snapshot what is due; True if the bus acknowledged something
        (snapshots written in the background report their own result)."""
        acked = False
        if self._resync:
            self._build_resync()
        self._drain()
        snap = None
        if self._snapshot_due and self._snapshot_task is None:
            snap = self._capture_snapshot()
        st = self._st
        if st.unsent:
            try:
                ids = await self.bus.append(self.worker, st.unsent)
            except BusError:
                self._snapshot_due = self._snapshot_due or snap is not None
                raise
            self.metrics.entries.inc(len(st.unsent))
            self.acked_seq = st.unsent[-1].seq
            self.last_id = ids[-1]
            st.unsent = []
            st.unsent_size = 0
            self.metrics.buffer_depth.set(st.pending_size)
            acked = True
        if snap is not None:
            # the snapshot is the state after entry ``seq``, whose id is now ``last_id``
            write = self._write_snapshot(snap[0], self.last_id, snap[1])
            if self.started.is_set():  # in the background: entries keep flowing meanwhile
                self._snapshot_task = asyncio.create_task(write)
                self._snapshot_task.add_done_callback(self._snapshot_done)
            else:
                await write  # the epoch's first snapshot precedes the registration
        if self.acked_seq and self.snapshots_written:
            self.started.set()  # the epoch's first entry and snapshot are written
        if not st.pending and not st.unsent:
            self.idle.set()
        return acked

    # -- building entries -------------------------------------------------------------------

    def _drain(self) -> None:
        """Pending chunks → sequenced entries of at most ``max_entry_keys`` keys."""
        st = self._st
        if not st.pending:
            return
        limit = self.settings.max_entry_keys
        batch: list[_Chunk] = []
        size = 0
        for chunk in st.pending:
            if batch and size + chunk.size > limit:
                self._seal(batch)
                batch, size = [], 0
            batch.append(chunk)
            size += chunk.size
        if batch:
            self._seal(batch)
        st.unsent_size += st.pending_size
        st.pending = []
        st.pending_size = 0

    def _seal(self, chunks: list[_Chunk]) -> None:
        events: list[Event] = []
        ranges: dict[int, list[int]] = {}
        ts = 0.0
        for c in chunks:
            events.extend(c.events)
            if c.seq >= 0:
                r = ranges.setdefault(c.rank, [c.seq, c.seq])
                r[0], r[1] = min(r[0], c.seq), max(r[1], c.seq)
            if c.ts and (not ts or c.ts < ts):
                ts = c.ts
        self.seq += 1
        eseq = [(rank, lo, hi) for rank, (lo, hi) in sorted(ranges.items())]
        self._st.unsent.append(
            Entry(PROTOCOL_VERSION, self.epoch, self.seq, ts, time.time(), eseq, events)
        )

    def _build_resync(self) -> None:
        """After an overflow: clear + the whole mirror, as ordinary entries."""
        self._resync = False
        st = self._st
        chains = build_chains(dict(self._parents()), self.settings.max_entry_keys)
        now = time.time()
        st.pending = [_Chunk([Cleared()], 0, -1, now, 1)]
        st.pending.extend(_Chunk([Stored(p, ks)], 0, -1, now, len(ks)) for p, ks in chains)
        st.pending_size = sum(c.size for c in st.pending)
        self._snapshot_due = True
        self.metrics.clears.labels("overflow").inc()

    def _overflow(self) -> None:
        """Too much buffered: forget it; the mirror is republished when the bus is back."""
        st = self._st
        log.warning(
            "event buffer over %d keys while the bus is down: dropping it, will resync",
            self.settings.max_buffer_events,
        )
        self.metrics.overflows.inc()
        st.pending, st.pending_size = [], 0
        st.unsent, st.unsent_size = [], 0
        self.seq = self.acked_seq  # the dropped entries were never acknowledged
        self._resync = True

    # -- snapshots --------------------------------------------------------------------------

    def _capture_snapshot(self) -> tuple[int, dict[int, int | None]]:
        """The mirror as of the last built entry (called right after ``_drain``)."""
        self._snapshot_due = False
        self._next_snapshot = time.monotonic() + self.settings.snapshot_interval
        return self.seq, dict(self._parents())

    async def _write_snapshot(
        self, seq: int, stream_id: str, parents: dict[int, int | None]
    ) -> None:
        """Write the snapshot, then trim behind the previous one. Failures only mark a
        snapshot due again (the writer loop deals with the bus being down)."""
        chains: list[Chain] = await asyncio.to_thread(build_chains, parents)
        snap = Snapshot(PROTOCOL_VERSION, self.epoch, seq, stream_id, time.time(), chains)
        try:
            await self.bus.write_snapshot(self.worker, snap)
            if self._prev_snapshot_id is not None:
                await self.bus.trim(self.worker, self._prev_snapshot_id)
        except BusError as exc:
            self.metrics.publish_errors.inc()
            self._snapshot_due = True  # retried once the backoff allows
            self.bus_failed(exc)
            return
        self._prev_snapshot_id = stream_id
        self.snapshots_written += 1
        self.metrics.snapshots.inc()
        self.bus_ok()

    def _snapshot_done(self, task: asyncio.Task[None]) -> None:
        self._snapshot_task = None
        if not task.cancelled() and task.exception() is not None:
            log.error("snapshot writer failed", exc_info=task.exception())
            self._snapshot_due = True
        self._wake.set()

    def close(self) -> None:
        """Stop a snapshot being written in the background (agent shutdown)."""
        self.stopping = True
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()

    def _set_connected(self, ok: bool, exc: BaseException | None = None) -> None:
        if ok and not self._connected:
            if self._ever_connected:
                log.info("event bus is back: flushing the buffer and writing a snapshot")
                self._snapshot_due = True
            self._ever_connected = True
            self._wake.set()
        elif not ok and self._connected:
            log.warning(
                "event bus unavailable, buffering up to %d keys (beyond that the buffer is "
                "dropped and the whole mirror republished on return); retrying with backoff "
                "up to %.1fs: %s",
                self.settings.max_buffer_events,
                self.settings.backoff_max,
                exc,
            )
        self._connected = ok
        self.metrics.connected.set(1 if ok else 0)


def _size(ev: Event) -> int:
    if isinstance(ev, Stored | Removed):
        return len(ev.keys)
    return 1
