"""Gateway side of the event bus: worker streams → shadow index, plus registry and load.

Two layers:

* ``StreamApplier`` — pure, synchronous: applies snapshots and stream entries of many
  workers to a ``ShadowIndex`` and decides, from epochs and gap-free sequence numbers,
  whether an entry is applied, stale, a duplicate, or reveals a gap that only a snapshot
  can close (docs/protocol.md, "Consumer rules"). Tests drive it without Redis.
* ``Consumer`` — the asyncio service the gateway runs: it bootstraps each registered worker
  from its snapshot, XREADs all streams in batches, re-bootstraps a worker that fell behind a
  trim, drops workers whose registration lapsed, polls load reports, and rides out bus
  outages by keeping the last index and retrying with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from gateway.antientropy import AntiEntropy
from gateway.contract.bus import BusError, EventBus, wait_event
from gateway.contract.wire import (
    Cleared,
    EngineReport,
    Entry,
    Removed,
    Snapshot,
    Stored,
    WorkerInfo,
)
from gateway.routing.index import ShadowIndex

__all__ = [
    "Applied",
    "ApplyStats",
    "Consumer",
    "ConsumerConfig",
    "ConsumerStats",
    "Cursor",
    "StreamApplier",
]

log = logging.getLogger(__name__)


# -- pure part -------------------------------------------------------------------------------


class Applied(Enum):
    """What ``StreamApplier.apply`` did with an entry."""

    APPLIED = "applied"
    STALE = "stale"  # older epoch than the worker's current one: dropped
    DUPLICATE = "duplicate"  # already applied (seq not above the cursor)
    GAP = "gap"  # entries are missing: the worker waits for a covering snapshot
    WAITING = "waiting"  # the worker is waiting for a snapshot: not applied
    CORRUPT = "corrupt"  # undecodable entry: treated as a gap


@dataclass
class Cursor:
    """Where one worker's stream has been applied up to."""

    epoch: int | None = None  # None: nothing known yet (accept any epoch from seq 1)
    seq: int = 0  # last applied entry of ``epoch``
    stream_id: str = "0"  # read position (ids after it are unread)
    waiting: bool = False  # missed entries: apply nothing until a covering snapshot


@dataclass
class ApplyStats:
    entries_applied: int = 0
    events_applied: int = 0
    entries_stale: int = 0
    entries_duplicate: int = 0
    entries_corrupt: int = 0
    entries_skipped: int = 0
    gaps: int = 0
    bootstraps: int = 0
    epoch_changes: int = 0


class StreamApplier:
    """Applies snapshots and entries of many workers to one ``ShadowIndex``; no I/O."""

    def __init__(self, index: ShadowIndex) -> None:
        self.index = index
        self.cursors: dict[str, Cursor] = {}
        self.stats = ApplyStats()

    def cursor(self, worker: str) -> Cursor:
        cur = self.cursors.get(worker)
        if cur is None:
            cur = self.cursors[worker] = Cursor()
        return cur

    def bootstrap(self, worker: str, snapshot: Snapshot | None) -> None:
        """Replace ``worker``'s state by ``snapshot`` (None: start from the stream's head)."""
        self.index.add_worker(worker)
        self.index.cleared(worker)
        self.stats.bootstraps += 1
        if snapshot is None:
            self.cursors[worker] = Cursor()
            return
        for parent, chain in snapshot.chains:
            self.index.stored(worker, parent, chain)
        self.cursors[worker] = Cursor(snapshot.epoch, snapshot.seq, snapshot.stream_id)

    def covers(self, worker: str, snapshot: Snapshot | None) -> bool:
        """Whether ``snapshot`` can close ``worker``'s gap (it is past the last applied entry)."""
        if snapshot is None:
            return False
        cur = self.cursor(worker)
        if cur.epoch is None:
            return True
        return (snapshot.epoch, snapshot.seq) > (cur.epoch, cur.seq)

    def new_epoch(self, worker: str, epoch: int) -> bool:
        """The registry shows agent run ``epoch``: if newer, drop the old run's state now."""
        cur = self.cursor(worker)
        if cur.epoch is not None and epoch <= cur.epoch:
            return False
        self._start_epoch(worker, cur, epoch)
        return True

    def apply(self, worker: str, stream_id: str, entry: Entry | None) -> Applied:
        cur = self.cursor(worker)
        if _id_after(stream_id, cur.stream_id):
            cur.stream_id = stream_id
        if entry is None:
            self.stats.entries_corrupt += 1
            cur.waiting = True
            return Applied.CORRUPT
        if cur.epoch is not None and entry.epoch < cur.epoch:
            self.stats.entries_stale += 1
            return Applied.STALE
        if cur.epoch is None or entry.epoch > cur.epoch:
            self._start_epoch(worker, cur, entry.epoch)
        if entry.seq <= cur.seq:
            self.stats.entries_duplicate += 1
            return Applied.DUPLICATE
        if cur.waiting:
            self.stats.entries_skipped += 1
            return Applied.WAITING
        if entry.seq != cur.seq + 1:
            self.stats.gaps += 1
            cur.waiting = True
            return Applied.GAP
        self._apply_events(worker, entry.events)
        cur.seq = entry.seq
        self.stats.entries_applied += 1
        self.stats.events_applied += len(entry.events)
        return Applied.APPLIED

    def forget(self, worker: str) -> None:
        self.cursors.pop(worker, None)
        self.index.remove_worker(worker)

    def _start_epoch(self, worker: str, cur: Cursor, epoch: int) -> None:
        if cur.epoch is not None:
            self.stats.epoch_changes += 1
        self.index.cleared(worker)
        cur.epoch = epoch
        cur.seq = 0
        cur.waiting = False

    def _apply_events(self, worker: str, events: Iterable[Stored | Removed | Cleared]) -> None:
        """Consecutive removes go to the index in one call: its per-call cost dominates."""
        index = self.index
        removes: list[int] = []
        for ev in events:
            kind = type(ev)
            if kind is Removed:
                removes.extend(ev.keys)  # type: ignore[union-attr]
                continue
            if removes:
                index.removed(worker, removes)
                removes = []
            if kind is Stored:
                index.stored(worker, ev.parent, ev.keys)  # type: ignore[union-attr]
            else:
                index.cleared(worker)
        if removes:
            index.removed(worker, removes)


def _id_after(a: str, b: str) -> bool:
    am, _, an = a.partition("-")
    bm, _, bn = b.partition("-")
    return (int(am), int(an or 0)) > (int(bm), int(bn or 0))


# -- the service -----------------------------------------------------------------------------


#: load reports applied per event-loop step (``Consumer._update_reports``)
_REPORTS_PER_STEP = 256


@dataclass
class ConsumerConfig:
    read_count: int = 500  # entries per stream per XREAD (bounds one apply step)
    block_ms: int = 100  # XREAD BLOCK
    #: seconds from one XREAD that returned entries to the next: entries that arrive in
    #: between come in one round trip instead of one each (each costs the gateway's loop
    #: ~0.2 ms of CPU); it bounds the lag it adds, and a burst still reads ``read_count``
    read_interval: float = 0.01
    poll_interval: float = 0.2  # registry + load reports
    snapshot_retry: float = 0.5  # a worker waiting for a covering snapshot re-reads it
    expiry_grace: float = 3.0  # after (re)connecting, wait this long before expiring workers
    backoff_min: float = 0.05
    backoff_max: float = 2.0
    #: compare the index with the digests agents stamp on entries; resync on a mismatch
    antientropy: bool = True


@dataclass
class ConsumerStats:
    """Metrics-ready counters (the gateway exports them)."""

    connected: bool = False
    bus_errors: int = 0
    connects: int = 0
    resyncs: int = 0  # bootstraps after a gap, a trim or a corrupt entry
    workers_added: int = 0
    workers_expired: int = 0
    lag_last_s: float = 0.0  # engine timestamp -> applied, latest entry
    lag_max_s: float = 0.0
    reads: int = 0  # XREADs (round trips)
    entries_read: int = 0  # stream entries those reads returned
    apply: ApplyStats = field(default_factory=ApplyStats)


#: listener(kind, worker) with kind in "added", "removed", "updated", "report",
#: "mismatch" / "resync" (anti-entropy found the worker's index wrong / healed it), and
#: "gap" / "healed" (entries are missing from the worker's stream / a snapshot or a new
#: epoch closed the gap): the trust verdicts change with these at once, not a tick later.
Listener = Callable[[str, str], None]
EntryHook = Callable[[str, Entry, float], None]


class Consumer:
    """Keeps ``index`` equal to every registered worker's published cache state.

    Read side for the gateway: ``workers()``, ``report(worker)``, ``subscribe(listener)``,
    ``changed`` (an ``asyncio.Event`` set on registry changes), ``stats``.
    """

    def __init__(
        self,
        bus: EventBus,
        index: ShadowIndex | None = None,
        config: ConsumerConfig | None = None,
        on_entry: EntryHook | None = None,
    ) -> None:
        self.bus = bus
        self.index = index if index is not None else ShadowIndex()
        self.config = config or ConsumerConfig()
        self.applier = StreamApplier(self.index)
        self.antientropy = AntiEntropy(self.index)
        self.stats = ConsumerStats(apply=self.applier.stats)
        self.changed = asyncio.Event()
        self._on_entry = on_entry
        self._infos: dict[str, WorkerInfo] = {}
        self._reports: dict[str, EngineReport] = {}
        self._listeners: list[Listener] = []
        self._pending: set[str] = set()  # workers to (re)bootstrap before the next read
        self._retry_at: dict[str, float] = {}
        self._connected_since = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._synced = asyncio.Event()
        self._stopping = False
        self._polled = False

    # -- read side for the gateway ----------------------------------------------------------

    def workers(self) -> dict[str, WorkerInfo]:
        return dict(self._infos)

    def report(self, worker: str) -> EngineReport | None:
        return self._reports.get(worker)

    def distrust(self) -> dict[str, str]:
        """Workers whose stream is not to be trusted now, with why: a digest mismatch not
        yet resynced, or a gap waiting for a covering snapshot."""
        out: dict[str, str] = {}
        for w in self._infos:
            cur = self.applier.cursors.get(w)
            at = self.antientropy.mismatched.get(w)
            if at is not None and cur is not None and cur.epoch == at[0]:
                out[w] = "digest_mismatch"
            elif cur is not None and cur.waiting:
                out[w] = "stream_gap"
        return out

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @property
    def synced(self) -> bool:
        """The registry was read and every registered worker bootstrapped once (readiness)."""
        return self._synced.is_set()

    async def wait_synced(self, within: float | None = None) -> None:
        """Until the registry was read and every worker bootstrapped once."""
        async with asyncio.timeout(within):
            await self._synced.wait()

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="consumer-read"),
            asyncio.create_task(self._poll_loop(), name="consumer-poll"),
        ]

    async def stop(self) -> None:
        """Cancel the loops; a loop whose cancellation a client library swallowed still
        ends at its next iteration (the stop flag), so this never hangs."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        self._tasks = []

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- loops ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        backoff = self.config.backoff_min
        while not self._stopping:
            try:
                await self._bootstrap_pending()
                started = time.monotonic()
                if await self._read_once():
                    self._bus_ok()
                    await self._pace(started)
                backoff = self.config.backoff_min
            except BusError as exc:
                self._bus_failed(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.backoff_max)
            except Exception as exc:  # the loop must outlive any one read
                # an error no layer below turned into a BusError (a client library's own,
                # seen in a Redis Cluster failover): ending here would freeze the index for
                # good, silently; it is a failed read like any other, with its traceback
                log.exception("reading the event bus failed unexpectedly: retrying")
                self._bus_failed(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.backoff_max)

    async def _pace(self, started: float) -> None:
        """Wait out the rest of ``read_interval`` since the read that ``started`` then."""
        rest = self.config.read_interval - (time.monotonic() - started)
        if rest > 0 and not self._stopping:
            await asyncio.sleep(rest)

    async def _read_once(self) -> bool:
        """One XREAD over every worker's stream; False if there was nothing to read."""
        positions = {w: c.stream_id for w, c in self.applier.cursors.items() if w in self._infos}
        if not positions:
            self._wake.clear()
            await wait_event(self._wake, self.config.block_ms / 1000)
            return False
        reads = await self.bus.read(positions, self.config.read_count, self.config.block_ms)
        self.stats.reads += 1
        self.stats.entries_read += sum(len(r.entries) for r in reads)
        hook = self._on_entry
        for i, r in enumerate(reads):
            if i:
                await asyncio.sleep(0)  # applying is synchronous: let requests run between
            if r.worker not in self._infos:
                continue
            now = time.time()
            for sid, entry in r.entries:
                result = self.applier.apply(r.worker, sid, entry)
                if result is Applied.APPLIED and entry is not None:
                    self._record_lag(now, entry)
                    if hook is not None:
                        hook(r.worker, entry, now)
                    if self.config.antientropy and not self.antientropy.check(r.worker, entry):
                        self._mismatch(r.worker, entry)
                        break
                elif result in (Applied.GAP, Applied.CORRUPT):
                    self._pending.add(r.worker)
                    self._emit("gap", r.worker)
                    break
        return True

    def _mismatch(self, worker: str, entry: Entry) -> None:
        """The index disagrees with the agent's digest: stop applying, resync from snapshot."""
        log.warning(
            "index of %s differs from its agent's digest at (%d, %d): resyncing from snapshot",
            worker,
            entry.epoch,
            entry.seq,
        )
        self.applier.cursor(worker).waiting = True
        self._pending.add(worker)
        self._retry_at.pop(worker, None)
        self._emit("mismatch", worker)

    def _record_lag(self, now: float, entry: Entry) -> None:
        if entry.ts > 0:
            lag = max(0.0, now - entry.ts)
            self.stats.lag_last_s = lag
            if lag > self.stats.lag_max_s:
                self.stats.lag_max_s = lag

    async def _bootstrap_pending(self) -> None:
        now = time.monotonic()
        for worker in sorted(self._pending):
            if worker not in self._infos:
                self._pending.discard(worker)
                continue
            cur = self.applier.cursors.get(worker)
            if cur is not None and not cur.waiting:  # a new epoch from seq 1 closed the gap
                self._pending.discard(worker)
                self.antientropy.forget(worker)
                self._emit("healed", worker)
                continue
            if self._retry_at.get(worker, 0.0) > now:
                continue
            await self._bootstrap(worker)
        if self._polled and self._infos.keys() <= self.applier.cursors.keys():
            self._synced.set()

    async def _bootstrap(self, worker: str) -> None:
        snap = await self.bus.read_snapshot(worker)
        cur = self.applier.cursors.get(worker)
        fresh = cur is None
        heals = snap is not None and self.antientropy.heals(worker, snap.epoch, snap.seq)
        if fresh or heals or self.applier.covers(worker, snap):
            self.applier.bootstrap(worker, snap)
            if not fresh:
                self.stats.resyncs += 1
            if self.antientropy.healed(worker):
                self._emit("resync", worker)
            elif not fresh:
                self._emit("healed", worker)
            self._pending.discard(worker)
            self._retry_at.pop(worker, None)
            return
        # the snapshot predates what we missed: keep the last state, retry shortly
        self._retry_at[worker] = time.monotonic() + self.config.snapshot_retry

    async def _poll_loop(self) -> None:
        while not self._stopping:
            try:
                infos = await self.bus.workers()
                self._bus_ok()  # before expiring anyone: the grace runs from this reconnection
                self._update_registry(infos)
                self._polled = True
                reports = await self.bus.read_reports(sorted(self._infos))
                await self._update_reports(reports)
                self._bus_ok()
            except BusError as exc:
                self._bus_failed(exc)
            await asyncio.sleep(self.config.poll_interval)

    def _update_registry(self, infos: dict[str, WorkerInfo]) -> None:
        changed = False
        for w, info in infos.items():
            old = self._infos.get(w)
            if old is None:
                self._infos[w] = info
                self._pending.add(w)
                self.stats.workers_added += 1
                self._emit("added", w)
                changed = True
            elif old is not info and old != info:  # the bus reuses an unchanged record
                self._infos[w] = info
                if info.epoch != old.epoch and w in self.applier.cursors:
                    self.applier.new_epoch(w, info.epoch)
                self._emit("updated", w)
                changed = True
        grace_over = time.monotonic() - self._connected_since >= self.config.expiry_grace
        for w in list(self._infos):
            if w not in infos and grace_over:
                del self._infos[w]
                self._reports.pop(w, None)
                self._pending.discard(w)
                self.applier.forget(w)
                self.antientropy.forget(w)
                self.stats.workers_expired += 1
                self._emit("removed", w)
                changed = True
        if changed:
            self.changed.set()
            self._wake.set()

    async def _update_reports(self, reports: dict[str, EngineReport]) -> None:
        """Hand new reports to the listeners (each pool's load tracker), yielding to the
        event loop every ``_REPORTS_PER_STEP``: a fleet's reports arrive every poll, and
        applying thousands at once would stall the requests this loop also serves."""
        for i, (w, rep) in enumerate(reports.items()):
            if i and not i % _REPORTS_PER_STEP:
                await asyncio.sleep(0)  # let requests run between chunks
            if self._reports.get(w) != rep:
                self._reports[w] = rep
                self._emit("report", w)

    def _emit(self, kind: str, worker: str) -> None:
        for listener in self._listeners:
            try:
                listener(kind, worker)
            except Exception:  # a listener's bug must not stop the consumer
                log.exception("consumer listener failed on %s %s", kind, worker)

    def _bus_ok(self) -> None:
        if not self.stats.connected:
            self.stats.connected = True
            self.stats.connects += 1
            self._connected_since = time.monotonic()

    def _bus_failed(self, exc: BaseException) -> None:
        self.stats.bus_errors += 1
        if self.stats.connected:
            log.warning("event bus unavailable, keeping the last index: %s", exc)
        self.stats.connected = False
