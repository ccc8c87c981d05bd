"""The other gateway replicas' requests, counted in this replica's load views and prefix rates.

Why: behind a load balancer each replica routes 1/R of the traffic. Between two engine load
reports a replica knows only the requests it sent itself, so R replicas each see a worker
1/R as busy as it is and pile onto it together; and each measures a hot prefix's rate as
1/R of the pool's, so it gives the prefix too few holders. Offline (``kvroute bench
replicas``) 8 replicas raised hot-prefix-8's median TTFT by a third that way.

Each replica's routers journal their requests (``Router.journal``: start, first token, end,
and the popularity key the route observed); the placements feed carries the journals to the
other replicas, where this class applies them: a remote start is a ``LoadTracker.started``
on the same worker (not journalled again), its first token and end follow it, its arrival
is a ``PrefixPopularity`` observation, and a start for a LoRA adapter occupies that
adapter's slot on the worker (``AdapterCatalog.begin``) until it ends, so no replica sends a
third adapter to a worker whose slots the others' requests fill. Pure: time is an argument,
no I/O.

Nothing here may leak when a note is lost (the bus down, a trimmed stream, a replica that
died mid-request): a remote request ends at its END, when its origin falls silent
(``forget``), or after ``ttl`` seconds (``expire``), whichever comes first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.routing.router import END, FIRST, START, Note, Router

__all__ = ["RemoteRequests", "RemoteStats"]


@dataclass
class RemoteStats:
    started: int = 0  # remote requests counted here
    ended: int = 0  # ... ended by their END
    expired: int = 0  # ... ended by the TTL or their origin's silence (a note lost)
    unknown: int = 0  # FIRST / END of a request not counted here (its START missed)
    arrivals: int = 0  # popularity observations of remote requests


@dataclass
class _Remote:
    router: Router
    rid: int  # this replica's handle in ``router.loads``
    at: float
    worker: str = ""
    adapter: str | None = None  # the LoRA adapter whose slot it occupies

    def end(self) -> None:
        self.router.loads.finished(self.rid)
        if self.adapter is not None:
            self.router.adapters.end(self.worker, self.adapter)


@dataclass
class RemoteRequests:
    """Remote requests in flight, keyed by (origin, router name, the origin's handle)."""

    #: seconds after which a remote request still counted is dropped (its END was lost)
    ttl: float = 300.0
    stats: RemoteStats = field(default_factory=RemoteStats)
    _live: dict[tuple[str, str, int], _Remote] = field(default_factory=dict)
    _order: deque[tuple[float, tuple[str, str, int]]] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self._live)

    def apply(
        self,
        origin: str,
        name: str,
        router: Router,
        notes: list[Note],
        now: float,
        adapters: Sequence[tuple[int, str]] = (),
    ) -> None:
        """One journal of ``origin``'s router ``name`` (this replica's ``router`` of the same
        pool and role); ``adapters``: the LoRA adapter of its STARTs that have one, by rid.
        A START on a worker this router does not know is skipped."""
        loads, pop, st = router.loads, router.ctx.popularity, self.stats
        known = loads.members()
        lora = dict(adapters) if adapters else None
        for kind, rid, worker, uncached, cached, arrival in notes:
            key = (origin, name, rid)
            if kind == START:
                if arrival >= 0:
                    pop.observe(arrival, now)
                    st.arrivals += 1
                elif arrival == -1:
                    pop.observe_request(now)
                    st.arrivals += 1
                if worker not in known or key in self._live:
                    continue
                local = loads.started(worker, max(uncached, 1), now, max(cached, 0))
                adapter = lora.get(rid) if lora is not None else None
                if adapter is not None:
                    router.adapters.begin(worker, adapter)
                self._live[key] = _Remote(router, local, now, worker, adapter)
                self._order.append((now, key))
                st.started += 1
            elif kind == FIRST:
                r = self._live.get(key)
                if r is None:
                    st.unknown += 1
                else:
                    r.router.loads.first_token(r.rid)
            elif kind == END:
                r = self._live.pop(key, None)
                if r is None:
                    st.unknown += 1
                else:
                    r.end()
                    st.ended += 1

    def expire(self, now: float) -> int:
        """End the remote requests counted for longer than ``ttl``; returns how many."""
        n = 0
        order = self._order
        while order and order[0][0] + self.ttl <= now:
            at, key = order.popleft()
            r = self._live.get(key)
            if r is not None and r.at == at:
                del self._live[key]
                r.end()
                n += 1
        self.stats.expired += n
        return n

    def forget(self, origin: str) -> int:
        """End every request of ``origin`` (it fell silent: it died, or its notes are lost)."""
        gone = [k for k in self._live if k[0] == origin]
        for k in gone:
            self._live.pop(k).end()
        self.stats.expired += len(gone)
        return len(gone)
