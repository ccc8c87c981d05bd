"""One engine publisher (one DP rank) → ordered engine batches, recovering from gaps.

The live path is a ZMQ SUB socket (3 frames: topic, 8-byte big-endian seq, payload).
``SeqTracker`` (pure) classifies each seq: the next one, a gap, a duplicate (already
replayed), or a restart (seq went backwards: the engine's cache is gone, the rank is
cleared).

Replay is a DEALER request ``[b"", start_seq]`` to the replay endpoint, answered by
``[..., seq, payload]`` frames until the end marker ``ff*8`` or an empty payload; the last
two frames are taken as (seq, payload) so both replay layouts work.

Sequence numbers alone cannot tell a restarted engine that already published past what we
expected from the one we were following, so continuity is *proven*, not assumed: a gap is
replayed from the last batch we applied, and that batch's bytes must match (a new
publisher's batch of the same seq has another timestamp). The same proof is asked after
the SUB socket reconnects (a socket monitor sees the publisher go and come back), which
catches a restarted engine that has published nothing yet. Without proof (no replay
endpoint, buffer too short, bytes differ) the rank is cleared and carries on from what it
sees: after a clear, partial history can only under-claim, never lie.

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
from zmq.utils.monitor import parse_monitor_message

from worker_agent.engines.base import EventSource
from worker_agent.metrics import AgentMetrics

__all__ = ["BatchHandler", "RankSubscriber", "ReplayResult", "SeqTracker", "Verdict", "replay"]

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
DRAIN_MAX = 64  # live messages handled between two yields to the event loop
#: Silence, after a replay round's first message, that means the engine dropped the rest.
REPLAY_IDLE_S = 0.25


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
    digest: int | None = None  # hash of the payload of batch ``expected - 1``

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

    def applied(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        self.digest = hash(payload)

    def continues(self, batches: list[tuple[int, bytes]]) -> bool:
        """Whether replayed ``batches`` contain our last applied batch, byte for byte."""
        if self.expected is None:
            return True
        if self.expected == 0 or self.digest is None:
            return bool(batches) and batches[0][0] <= self.expected
        last = self.expected - 1
        return any(seq == last and hash(p) == self.digest for seq, p in batches)


@dataclass
class ReplayResult:
    """What a replay brought: ``batches`` in seq order without holes (the first may be later
    than asked: the engine no longer buffers what came before), and how many extra rounds it
    took to get past messages the engine's socket dropped."""

    batches: list[tuple[int, bytes]]
    resumed: int = 0


async def replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    patience: float,
    idle: float = REPLAY_IDLE_S,
) -> ReplayResult | None:
    """Batches from ``start`` held by the engine's replay buffer; None if it never answers.

    The engine answers a request with its whole buffer from ``start`` in one burst, and its
    ROUTER socket silently drops what exceeds its send queue (vLLM 0.23 and SGLang 0.5.23 lose
    everything past ~1,000 queued messages, the end marker included). So a reply is read in
    rounds: each round asks from the first batch not yet received and keeps the contiguous
    run it gets, until the end marker, a hole, or ``idle`` seconds of silence after its first
    message. ``patience`` bounds the wait for a round's first message, per round, so a long
    replay that keeps making progress never times out. The replay ends at the end marker, or
    when a round brings nothing new (what arrived is returned; the caller decides whether the
    engine still had the range).
    """
    out: list[tuple[int, bytes]] = []
    rounds = 0
    while True:
        nxt = out[-1][0] + 1 if out else start
        got, ended = await _replay_round(ctx, endpoint, nxt, patience, idle, first=not out)
        if got is None:
            return ReplayResult(out, max(0, rounds - 1)) if out else None
        rounds += 1
        out.extend(got)
        if ended or not got:
            return ReplayResult(out, rounds - 1)


async def _replay_round(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    patience: float,
    idle: float,
    first: bool,
) -> tuple[list[tuple[int, bytes]] | None, bool]:
    """One request: (the contiguous run received, whether the end marker came). The run is
    None when nothing at all came within ``patience``. Only the first round of a replay may
    start later than asked (the engine's buffer starts there); later rounds stop at a hole."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # never push back on the engine: it would drop more
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        expect = start
        answered = False
        while True:
            try:
                async with asyncio.timeout(idle if answered else patience):
                    frames = await sock.recv_multipart()
            except TimeoutError:
                return (out if answered else None), False
            answered = True
            if len(frames) < 2:
                continue
            seq_b, payload = frames[-2], frames[-1]
            if seq_b == END_SEQ or not payload:
                return out, True
            if len(seq_b) != 8:
                continue
            seq = int.from_bytes(seq_b, "big")
            if seq < expect:
                continue  # already have it
            if seq > expect and (out or not first):
                return out, False  # a hole: the next round asks from ``expect``
            out.append((seq, payload))
            expect = seq + 1
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
        self._lock = asyncio.Lock()  # one of: a live batch, a recovery, a reconnect check
        self._lost = False  # the publisher disconnected and has not come back yet

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        # Plain (non-asyncio) views of the same sockets: draining what is already queued
        # with NOBLOCK costs a C call, not an asyncio future per message.
        raw_sub: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        raw_monitor: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        watcher = asyncio.create_task(self._watch_connection(monitor, raw_monitor))
        try:
            async with self._lock:
                await self._initial_sync()
            self.connected.set()
            while True:
                queued = [await sub.recv_multipart()]
                while len(queued) < DRAIN_MAX:
                    try:
                        queued.append(raw_sub.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                async with self._lock:
                    if self._drain_monitor(raw_monitor):  # before trusting the batches
                        await self._check_after_reconnect()
                    for frames in queued:
                        await self._on_frames(frames)
                # A ready socket completes ``recv`` without suspending: yield explicitly, or
                # a backlog would starve the publisher and the heartbeat.
                await asyncio.sleep(0)
        finally:
            watcher.cancel()
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _watch_connection(self, monitor: zmq.asyncio.Socket, raw: zmq.Socket[bytes]) -> None:
        """Check a reconnection even if the publisher sends nothing afterwards."""
        while True:
            await monitor.poll()
            async with self._lock:
                if self._drain_monitor(raw):
                    await self._check_after_reconnect()

    def _drain_monitor(self, raw: zmq.Socket[bytes]) -> bool:
        """Read pending socket events; True if the publisher came back after going away."""
        back = False
        while True:
            try:
                frames = raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return back
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._lost = True
            elif event == zmq.EVENT_CONNECTED and self._lost:
                self._lost = False
                back = True

    async def _initial_sync(self) -> None:
        if self.source.replay is None:
            return
        got = await self._replay(self.source.replay, 0)
        self.metrics.replays.labels("initial" if got is not None else "unavailable").inc()
        if got is not None:  # replay works: nothing before the first batch can be missed
            self.tracker.expected = got[0][0] if got else 0
            await self._apply_run(got)

    async def _check_after_reconnect(self) -> None:
        """The publisher went away and came back: same history, or a restarted engine?"""
        if self.tracker.expected is None:
            return
        got = None
        if self.source.replay is not None:
            got = await self._replay(self.source.replay, 0)
        if got is not None and self.tracker.continues(got):
            self.metrics.replays.labels("reconnect").inc()
            await self._apply_run(got)
            return
        self._restarted(got, "publisher reconnected with another history")
        if got:
            await self._apply_run(got)

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
            self._restarted(None, f"engine seq went back to {seq}")
            self.tracker.expected = 0
            verdict = self.tracker.classify(seq)
        if verdict is Verdict.NEXT:
            self._apply(seq, frames[2])
            return
        await self._recover(seq, frames[2])

    async def _recover(self, seq: int, payload: bytes) -> None:
        """Live ``seq`` arrived but ``expected`` is missing: replay with proof, else clear."""
        self.metrics.gaps.inc()
        tracker = self.tracker
        assert tracker.expected is not None
        start = tracker.expected - 1 if tracker.expected and tracker.digest is not None else 0
        got = None
        if self.source.replay is not None:
            got = await self._replay(self.source.replay, start)
        if got is None:
            self.metrics.replays.labels("unavailable").inc()
        elif got and got[0][0] == start and tracker.continues(got[:1]):
            self.metrics.replays.labels("ok").inc()
        elif got and got[0][0] == start:  # the batch we applied last is not theirs
            full = await self._replay(self.source.replay or "", 0)
            self._restarted(full, "a new engine history")
            got = full
        else:
            self.metrics.replays.labels("too_old").inc()
        batches = dict(got or [])
        batches.setdefault(seq, payload)
        await self._apply_run(sorted(batches.items()))

    async def _replay(self, endpoint: str, start: int) -> list[tuple[int, bytes]] | None:
        """Batches from ``start`` (see ``replay``), counting the rounds it had to resume."""
        got = await replay(self.ctx, endpoint, start, self.replay_timeout)
        if got is None:
            return None
        if got.resumed:
            self.metrics.replays.labels("resumed").inc(got.resumed)
            log.info(
                "rank %d: replay from %d resumed %d times past dropped messages",
                self.source.rank,
                start,
                got.resumed,
            )
        return got.batches

    def _restarted(self, history: list[tuple[int, bytes]] | None, why: str) -> None:
        """The engine restarted: clear the rank; ``history`` (the new engine's replay
        buffer, if known) is applied next by the caller."""
        log.warning("rank %d: %s: engine restarted, clearing", self.source.rank, why)
        self.handler.on_reset(self.source.rank, "restart")
        self.tracker = SeqTracker()
        if history is not None:
            self.tracker.expected = history[0][0] if history else 0

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
        if batches and self.tracker.expected is not None:
            self.tracker.dup_until = self.tracker.expected - 1

    def _apply(self, seq: int, payload: bytes) -> None:
        self.tracker.applied(seq, payload)
        self.handler.on_batch(self.source.rank, seq, payload)
