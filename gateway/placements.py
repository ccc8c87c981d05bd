"""Gateway replicas share their placements: each replica's speculative inserts reach the others.

Why: every replica (a gateway process behind a load balancer, or one of ``server.workers``)
keeps its own shadow index, fed by every worker's KV events. An engine publishes a request's
blocks only once it schedules it; until then only the replica that sent the request knows
where its prefix is going (its speculative insert). Another replica routing the next turn of
that conversation, or a second request with the same new prompt, does not, and sends it
elsewhere: a miss, which adds prefill to a queue, which delays the events further. Offline on
the replicas preset (``kvroute bench replicas``, docs/benchmarks.md) 4 replicas lost ~10
points of hit rate and 8 lost ~18 without sharing, under 1 point with it.

Each replica drains its index's ``outbox`` every ``interval`` (sooner when a request starts,
below) into one ``Placements`` batch on the bus (``gateway.contract.wire``, docs/protocol.md
section 9) and applies the other replicas' batches with ``ShadowIndex.adopt``, on its own
clock (replicas share no clock).
A batch is a hint with a TTL (``index.speculative_ttl``): one lost (the bus down, garbage, a
trimmed stream) leaves the replicas as they would be without sharing, so nothing is retried
or replayed; a replica that loses its place reads on from the stream's tail.

Each batch also carries the replica's routers' journals (``Router.journal``): every request's
start, first token and end, and the prefix it shared. The others count those requests in
their load views and prefix rates (``gateway.routing.remote``) until their end, their
origin's silence or a TTL, so R replicas see a worker as busy, and a hot prefix as popular,
as one gateway would (``replicas.share_load``). A request's start is sent at once rather than
at the period's end (at most one batch per ``start_gap``): until the others count it they
route on top of it, and offline a 20 ms delay raised a hot prefix's TTFT p99 by up to a fifth.

A lone gateway has no one to tell: every replica publishes an empty batch every
``heartbeat_s`` (its presence), and sends its placements only while it has read another
replica's batch within ``peer_ttl``; until then its outbox is emptied unsent (``unshared``)
and its routers journal nothing.
So one gateway pays one XADD a second, and replicas find each other within a heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.contract.bus import BusError, EventBus
from gateway.contract.wire import (
    PROTOCOL_VERSION,
    Journal,
    Placement,
    Placements,
    decode_placements,
    encode_placements,
)
from gateway.pool import Pool
from gateway.routing.index import ShadowIndex
from gateway.routing.remote import RemoteRequests
from gateway.routing.router import Router

log = logging.getLogger(__name__)

__all__ = ["PlacementFeed", "PlacementStats", "shared_routers"]

#: server-side wait of a read of the placements stream (a batch wakes it at once)
_BLOCK_MS = 1000


@dataclass
class PlacementStats:
    published: int = 0  # placements (speculative inserts) this replica sent
    batches_published: int = 0
    adopted: int = 0  # other replicas' placements applied here
    adopted_blocks: int = 0  # blocks they newly attributed in this index
    own_skipped: int = 0  # batches of this replica read back
    heartbeats: int = 0  # empty batches sent (this replica's presence)
    unshared: int = 0  # placements not sent: no other replica heard from within peer_ttl
    dropped: int = 0  # placements not sent: the bus refused them, or too many pending
    notes_published: int = 0  # journal notes (requests' starts, first tokens, ends) sent
    notes_dropped: int = 0  # journal notes not sent (no peer, the bus down, too many)
    garbage: int = 0  # undecodable batches read
    read_errors: int = 0  # failed reads (the bus down)


def shared_routers(pools: Iterable[Pool]) -> dict[str, Router]:
    """Every pool's routers by the name their journals carry (the same on every replica)."""
    out = {}
    for p in pools:
        out[p.name] = p.router
        out[f"{p.name}/decode"] = p.decode_router
    return out


class PlacementFeed:
    """Publishes one index's speculative inserts and adopts the other replicas'."""

    def __init__(
        self,
        bus: EventBus,
        index: ShadowIndex,
        *,
        interval: float = 0.02,
        start_gap: float = 0.002,
        max_pending: int = 10_000,
        retry_s: float = 0.5,
        heartbeat_s: float = 1.0,
        peer_ttl: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        origin: str | None = None,
        routers: dict[str, Router] | None = None,
        remote_ttl: float = 300.0,
    ) -> None:
        if interval <= 0 or max_pending < 1 or retry_s <= 0 or heartbeat_s <= 0:
            raise ValueError("interval, retry_s and heartbeat_s must be > 0, max_pending >= 1")
        if not 0 <= start_gap <= interval:
            raise ValueError("start_gap must be within [0, interval]")
        if peer_ttl <= heartbeat_s:
            raise ValueError("peer_ttl must exceed heartbeat_s (a peer would flicker)")
        self.bus = bus
        self.index = index
        self.interval = interval
        #: a request's start wakes the publisher at once (``_nudge``), at most once per
        #: ``start_gap`` seconds: starts coming closer together share a batch
        self.start_gap = start_gap
        self.max_pending = max_pending
        self.retry_s = retry_s
        self.heartbeat_s = heartbeat_s
        self.peer_ttl = peer_ttl
        self.clock = clock
        #: this replica's id on the stream (it skips its own batches)
        self.origin = origin or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.stats = PlacementStats()
        #: routers whose requests are shared (``replicas.share_load``), by pool name
        #: (``pool``, ``pool/decode``): the same names on every replica
        self.routers = routers or {}
        self.remote = RemoteRequests(ttl=remote_ttl)
        self._heard: dict[str, float] = {}  # origin -> when its last batch was read
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._outage = False  # logged once per outage
        self._peer_at = float("-inf")  # when another replica's batch was last read
        self._sent_at = float("-inf")  # when this replica last published a batch
        self._started = asyncio.Event()  # a router journaled a start (``_nudge``)

    def peers(self) -> bool:
        """Whether another replica was heard from within ``peer_ttl``."""
        return self.clock() - self._peer_at <= self.peer_ttl

    async def start(self) -> None:
        self.index.outbox = []
        self._stopping = False
        self._started = asyncio.Event()  # bound to this loop
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="kvroute-placements-publish"),
            asyncio.create_task(self._read_loop(), name="kvroute-placements-read"),
        ]

    async def stop(self) -> None:
        """Cancel the loops, as ``Consumer.stop`` does: a loop whose cancellation the Redis
        client swallowed still ends at its next iteration (the stop flag), so this never
        hangs. What was decided before the stop is still sent, if the bus answers at once."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        self._tasks = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self.flush()
        self.index.outbox = None
        for r in self.routers.values():
            r.journal = None
            r.on_start = None

    # -- publishing -------------------------------------------------------------------------

    def take(self) -> list[Placement]:
        """The outbox's placements (the newest ``max_pending`` of them), emptied."""
        box = self.index.outbox
        if not box:
            return []
        if len(box) > self.max_pending:
            self.stats.dropped += len(box) - self.max_pending
            del box[: len(box) - self.max_pending]
        items = [Placement(w, parent, keys) for w, parent, keys in box]
        box.clear()
        return items

    def take_journals(self) -> list[Journal]:
        """Every router's journal since the last batch, emptied (a router's oldest notes
        beyond ``max_pending`` dropped, counted: their requests then end by the TTL)."""
        out = []
        for name, r in self.routers.items():
            notes = r.journal
            if not notes:
                continue
            if len(notes) > self.max_pending:
                self.stats.notes_dropped += len(notes) - self.max_pending
                del notes[: len(notes) - self.max_pending]
            out.append(Journal(name, list(notes), list(r.journal_adapters)))
            notes.clear()
            r.journal_adapters.clear()
        return out

    def _journal(self, on: bool) -> None:
        """Routers journal their requests only while another replica listens: a lone
        gateway pays nothing per request for it. A request started before journaling began
        sends its end alone, which the others count as ``unknown``."""
        for r in self.routers.values():
            if on and r.journal is None:
                r.journal = []
                r.on_start = self._nudge
            elif not on and r.journal is not None:
                self.stats.notes_dropped += len(r.journal)
                r.journal = None
                r.journal_adapters.clear()
                r.on_start = None

    def _nudge(self) -> None:
        """A router journaled a request's start: publish it now rather than at the period's
        end. The other replicas route on top of this request until they count it; offline
        (``kvroute bench replicas --placement-lag``) a 20 ms delay raised hot-prefix-8's
        TTFT p99 by up to a fifth over one gateway's, 1-3 ms by a few percent. While the bus
        is down, starts wait for the period: a refused XADD per request helps no one."""
        if not self._outage:
            self._started.set()

    async def flush(self) -> None:
        """One period's work: the outbox as one batch to the other replicas (emptied unsent
        while there are none), or an empty batch when a heartbeat is due. On a bus error the
        batch is dropped (counted)."""
        box = self.index.outbox
        peers = self.peers()
        self._journal(peers)
        if box and not peers:  # no one to tell: emptied as it is
            self.stats.unshared += len(box)
            box.clear()
        items = self.take()
        journals = self.take_journals()
        notes = sum(len(j.notes) for j in journals)
        now = self.clock()
        self._housekeep(now)
        if not items and not notes and now - self._sent_at < self.heartbeat_s:
            return
        data = encode_placements(Placements(PROTOCOL_VERSION, self.origin, items, journals))
        try:
            await self.bus.publish_placements(self.origin, data)
        except BusError as exc:
            self.stats.dropped += len(items)
            self.stats.notes_dropped += notes
            self._down(exc)
            return
        self._up()
        self._sent_at = now
        self.stats.notes_published += notes
        if items or notes:
            self.stats.published += len(items)
            self.stats.batches_published += 1
        else:
            self.stats.heartbeats += 1

    def _housekeep(self, now: float) -> None:
        """End the remote requests whose END will not come: their origin fell silent, or
        they outlived the TTL."""
        for origin, at in list(self._heard.items()):
            if now - at > self.peer_ttl:
                del self._heard[origin]
                self.remote.forget(origin)
        self.remote.expire(now)

    async def _publish_loop(self) -> None:
        started = self._started
        loop = asyncio.get_running_loop()
        while not self._stopping:
            began = loop.time()
            try:
                await self.flush()
            except Exception:  # a bug must not end sharing for the life of the process
                log.exception("placements: publishing failed")
            # the batching period, cut short by a request's start (``_nudge``), but not to
            # less than ``start_gap``: starts closer together than that share a batch
            if not started.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval):
                        await started.wait()
            started.clear()
            rest = began + self.start_gap - loop.time()
            if rest > 0:
                await asyncio.sleep(rest)

    # -- adopting ---------------------------------------------------------------------------

    def adopt(self, data: bytes, origin: str = "") -> int:
        """Apply one batch read from the stream (``origin``: the id the stream gives beside
        it, which skips this replica's own without decoding); returns the placements adopted."""
        if origin == self.origin:
            self.stats.own_skipped += 1
            return 0
        try:
            batch = decode_placements(data)
        except ValueError:  # msgspec.DecodeError is a ValueError
            self.stats.garbage += 1
            return 0
        if batch.origin == self.origin:
            self.stats.own_skipped += 1
            return 0
        now = self.clock()
        self._peer_at = now
        self._heard[batch.origin] = now
        adopt = self.index.adopt
        for it in batch.items:
            self.stats.adopted_blocks += adopt(it.worker, it.parent, it.keys, now)
        self.stats.adopted += len(batch.items)
        for j in batch.journals:
            router = self.routers.get(j.name)
            if router is not None:  # a pool this replica does not serve: nothing to count
                self.remote.apply(batch.origin, j.name, router, j.notes, now, j.adapters)
        return len(batch.items)

    async def _read_loop(self) -> None:
        position: str | None = None
        while not self._stopping:
            try:
                if position is None:
                    position = await self.bus.placements_tail()
                batches = await self.bus.read_placements(position, block_ms=_BLOCK_MS)
            except BusError as exc:
                self.stats.read_errors += 1
                self._down(exc)
                position = None  # what was missed is stale by the time the bus is back
                await asyncio.sleep(self.retry_s)
                continue
            self._up()
            for sid, origin, data in batches:
                position = sid
                try:
                    self.adopt(data, origin)
                except Exception:  # a bug must not end sharing for the life of the process
                    self.stats.garbage += 1
                    log.exception("placements: adopting a batch failed")

    def _down(self, exc: BusError) -> None:
        if not self._outage:
            self._outage = True
            log.warning("placements not shared with the other replicas: %s", exc)

    def _up(self) -> None:
        if self._outage:
            self._outage = False
            log.info("placements shared with the other replicas again")
