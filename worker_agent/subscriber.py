"""One engine publisher (one DP rank) → ordered engine batches, recovering from gaps.

The live path is a ZMQ SUB socket (3 frames: topic, 8-byte big-endian seq, payload).
``SeqTracker`` (pure) classifies each seq: the next one, a gap (replay it through a DEALER
from the replay endpoint: ``[b"", start_seq]`` → ``[..., seq, payload]`` frames until the
end marker ``ff*8`` or an empty payload, the last two frames taken as (seq, payload) so
both replay layouts work), a duplicate (already replayed), or a restart (seq went
backwards: the engine's cache is gone, the rank is cleared). A gap the replay buffer no
longer covers (or no replay endpoint) clears the rank and carries on from what is known:
after a clear, partial history can only under-claim, never lie.

At start the subscriber replays from seq 0 so that an agent started beside a running engine
learns what the engine's replay buffer still holds.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import zmq
import zmq.asyncio

from worker_agent.engines.base import EventSource
from worker_agent.metrics import AgentMetrics

__all__ = ["BatchHandler", "RankSubscriber", "SeqTracker", "Verdict", "replay"]

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8


class BatchHandler(Protocol):
    def on_batch(self, rank: int, seq: int, payload: bytes) -> bool: ...

    def on_reset(self, rank: int, reason: str) -> None: ...


class Verdict(Enum):
    NEXT = "next"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


@dataclass
class SeqTracker:
    """Engine sequence numbers of one publisher (pure logic)."""

    expected: int | None = None  # next seq to apply; None: take the first one seen
    dup_until: int | None = None  # seqs up to this were replayed: live copies are duplicates

    def classify(self, seq: int) -> Verdict:
        if self.expected is None or seq == self.expected:
            self.dup_until = None
            return Verdict.NEXT
        if seq > self.expected:
            self.dup_until = None
            return Verdict.GAP
        if self.dup_until is not None and seq <= self.dup_until:
            return Verdict.DUPLICATE
        return Verdict.RESTART

    def applied(self, seq: int) -> None:
        self.expected = seq + 1


async def replay(
    ctx: zmq.asyncio.Context, endpoint: str, start: int, patience: float
) -> list[tuple[int, bytes]] | None:
    """Batches from ``start`` held by the engine's replay buffer; None if unavailable."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                async with asyncio.timeout(remaining):
                    frames = await sock.recv_multipart()
            except TimeoutError:
                return None
            if len(frames) < 2:
                continue
            seq_b, payload = frames[-2], frames[-1]
            if seq_b == END_SEQ or not payload:
                return out
            if len(seq_b) == 8:
                out.append((int.from_bytes(seq_b, "big"), payload))
    finally:
        sock.close(linger=0)


class RankSubscriber:
    """Feeds one rank's engine batches, in order and without silent gaps, to a handler."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        source: EventSource,
        handler: BatchHandler,
        metrics: AgentMetrics,
        replay_timeout: float = 2.0,
        rcvhwm: int = 100_000,
    ) -> None:
        self.ctx = ctx
        self.source = source
        self.handler = handler
        self.metrics = metrics
        self.replay_timeout = replay_timeout
        self.rcvhwm = rcvhwm
        self.tracker = SeqTracker()
        self.connected = asyncio.Event()  # set once the SUB socket is connected and synced

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        try:
            await self._initial_sync()
            self.connected.set()
            while True:
                frames = await sub.recv_multipart()
                await self._on_frames(frames)
        finally:
            sub.close(linger=0)

    async def _initial_sync(self) -> None:
        if self.source.replay is None:
            return
        got = await replay(self.ctx, self.source.replay, 0, self.replay_timeout)
        self.metrics.replays.labels("initial" if got is not None else "unavailable").inc()
        if got is not None:  # replay works: nothing before the first batch can be missed
            self.tracker.expected = got[0][0] if got else 0
        if got:
            await self._apply_run(got)
            self.tracker.dup_until = self.tracker.expected - 1 if self.tracker.expected else None

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.metrics.bad.labels("frame_count").inc()
            return
        if len(frames[1]) != 8:
            self.metrics.bad.labels("seq_frame").inc()
            return
        seq = int.from_bytes(frames[1], "big")
        verdict = self.tracker.classify(seq)
        if verdict is Verdict.DUPLICATE:
            return
        if verdict is Verdict.RESTART:
            log.warning(
                "rank %d: engine seq went back to %d: engine restarted", self.source.rank, seq
            )
            self.handler.on_reset(self.source.rank, "restart")
            self.tracker = SeqTracker(expected=0)
            verdict = self.tracker.classify(seq)
        if verdict is Verdict.NEXT:
            self._apply(seq, frames[2])
            return
        await self._recover(seq, frames[2])

    async def _recover(self, seq: int, payload: bytes) -> None:
        """Live ``seq`` arrived but ``expected`` is missing: replay, else clear."""
        self.metrics.gaps.inc()
        expected = self.tracker.expected
        assert expected is not None
        got = None
        if self.source.replay is not None:
            got = await replay(self.ctx, self.source.replay, expected, self.replay_timeout)
        if got is None:
            self.metrics.replays.labels("unavailable").inc()
        elif not got or got[0][0] != expected:
            self.metrics.replays.labels("too_old").inc()
        else:
            self.metrics.replays.labels("ok").inc()
        batches = dict(got or [])
        batches.setdefault(seq, payload)
        await self._apply_run(sorted(batches.items()))
        if self.tracker.expected is not None and self.tracker.expected > seq + 1:
            self.tracker.dup_until = self.tracker.expected - 1

    async def _apply_run(self, batches: list[tuple[int, bytes]]) -> None:
        """Apply batches in seq order; a hole in them loses history: clear, carry on."""
        for i, (seq, payload) in enumerate(batches):
            expected = self.tracker.expected
            if expected is not None and seq < expected:
                continue
            if expected is not None and seq > expected:
                log.warning(
                    "rank %d: engine batches %d..%d are lost: clearing",
                    self.source.rank,
                    expected,
                    seq - 1,
                )
                self.handler.on_reset(self.source.rank, "replay_unavailable")
            self._apply(seq, payload)
            if i % 64 == 63:
                await asyncio.sleep(0)  # a long replay must not starve the event loop

    def _apply(self, seq: int, payload: bytes) -> None:
        self.tracker.applied(seq)
        self.handler.on_batch(self.source.rank, seq, payload)
