"""Engine batches of every DP rank → canonical events for the publisher; no I/O.

The subscriber calls ``on_batch`` for each engine batch in sequence order and ``on_reset``
when the engine's history is lost for a rank (restart, gap without replay, a lost batch).
Every canonical change goes through the mirror, so what is published is exactly the change
of the mirror.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.contract.wire import Event, Removed, Stored
from gateway.routing.keys import BlockKeyer
from worker_agent.canonical import RankCanonicaliser
from worker_agent.engines.decode import (
    BadBatch,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    decode_batch,
)
from worker_agent.metrics import AgentMetrics
from worker_agent.mirror import WorkerMirror

__all__ = ["EventPipeline", "Sink"]

#: sink(events, dp_rank, engine seq or -1, engine timestamp)
Sink = Callable[[list[Event], int, int, float], None]


class EventPipeline:
    def __init__(
        self,
        keyer: BlockKeyer,
        sink: Sink,
        metrics: AgentMetrics,
        ranks: list[int] | None = None,
        gpu_media: frozenset[str | None] = frozenset({None, "GPU"}),
        limits: DecodeLimits | None = None,
    ) -> None:
        self.mirror = WorkerMirror()
        self.ranks = {r: RankCanonicaliser(keyer, gpu_media) for r in ranks or [0]}
        self.sink = sink
        self.metrics = metrics
        self.limits = limits or DecodeLimits()
        self._stored = metrics.events.labels("stored")
        self._removed = metrics.events.labels("removed")
        self._blocks_stored = metrics.blocks.labels("stored")
        self._blocks_removed = metrics.blocks.labels("removed")

    def on_batch(self, rank: int, seq: int, payload: bytes) -> bool:
        """Apply one engine batch; False if it was undecodable (the rank is then cleared)."""
        m = self.metrics
        m.frames.inc()
        try:
            batch = decode_batch(payload, self.limits)
        except BadBatch as exc:
            m.bad.labels(exc.reason).inc()
            # it may have held removals we cannot apply: never keep a possibly stale state
            self.on_reset(rank, "lost_batch")
            return False
        for reason in batch.bad:
            m.bad.labels(reason).inc()
        canon = self.ranks[rank]
        out = _Events()
        wave: list[BlockStored] = []
        wave_hashes: set[object] = set()
        gone: list[BlockRemoved] = []  # consecutive removes: one mirror change
        stored = removed = 0
        for ev in batch.events:
            if isinstance(ev, BlockRemoved):
                removed += 1
                self._store_wave(canon, wave, out)
                wave_hashes.clear()
                gone.append(ev)
                continue
            self._remove(canon, gone, out)
            if isinstance(ev, BlockStored):
                stored += 1
                if ev.parent is not None and ev.parent in wave_hashes:
                    self._store_wave(canon, wave, out)  # it depends on the wave: flush first
                    wave_hashes.clear()
                wave.append(ev)
                wave_hashes.update(ev.hashes)
                continue
            self._store_wave(canon, wave, out)
            wave_hashes.clear()
            m.events.labels("cleared").inc()
            m.clears.labels("engine").inc()
            out.extend(self._clear_rank(rank))
        self._remove(canon, gone, out)
        self._store_wave(canon, wave, out)
        self._stored.inc(stored)
        self._removed.inc(removed)
        self._flush_counters(canon)
        self._emit(out.items, rank, seq, batch.ts)
        return True

    def _remove(self, canon: RankCanonicaliser, gone: list[BlockRemoved], out: _Events) -> None:
        if gone:
            keys = [k for ev in gone for k in canon.removed(ev)]
            if keys:
                out.extend(self.mirror.drop(keys))
            gone.clear()

    def _store_wave(self, canon: RankCanonicaliser, wave: list[BlockStored], out: _Events) -> None:
        """Stores with no dependency among them: keyed together, applied in order."""
        if not wave:
            return
        for chains in canon.stored_many(wave):
            if chains:
                out.extend(self.mirror.add(chains))
        wave.clear()

    def on_reset(self, rank: int, reason: str) -> None:
        """The rank's engine history is lost: publish that it holds nothing."""
        self.metrics.clears.labels(reason).inc()
        self._emit(self._clear_rank(rank), rank, -1, time.time())

    def _clear_rank(self, rank: int) -> list[Event]:
        keys = self.ranks[rank].cleared()
        if len(self.ranks) == 1:
            return self.mirror.clear()
        return self.mirror.drop(keys)

    def _emit(self, events: list[Event], rank: int, seq: int, ts: float) -> None:
        m = self.metrics
        stored = removed = 0
        for ev in events:
            if type(ev) is Removed:
                removed += len(ev.keys)
            elif type(ev) is Stored:
                stored += len(ev.keys)
        if stored:
            self._blocks_stored.inc(stored)
        if removed:
            self._blocks_removed.inc(removed)
        m.mirror_blocks.set(len(self.mirror))
        self.sink(events, rank, seq, ts)

    def _flush_counters(self, canon: RankCanonicaliser) -> None:
        if canon.dropped:
            for reason, n in canon.dropped.items():
                self.metrics.dropped.labels(reason).inc(n)
            canon.dropped.clear()
        if canon.bad:
            for reason, n in canon.bad.items():
                self.metrics.bad.labels(reason).inc(n)
            canon.bad.clear()


class _Events:
    """Canonical events of one batch; adjacent removes merged into one (vLLM sends one
    BlockRemoved per hash)."""

    def __init__(self) -> None:
        self.items: list[Event] = []
        self._removes: list[int] | None = None

    def extend(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, Removed):
                if self._removes is None:
                    self._removes = list(ev.keys)
                    self.items.append(Removed(self._removes))
                else:
                    self._removes.extend(ev.keys)
            else:
                self._removes = None
                self.items.append(ev)
