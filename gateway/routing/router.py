"""The routing core's front door: index lookup + load + policy -> decision, and bookkeeping.

Pure and synchronous: time is an argument, randomness is a seeded ``random.Random``. The
live gateway, the offline cluster simulator and the benchmarks drive this same class, so
what the simulator says about routing quality is what the gateway does.

Life of a request: ``route()`` (lookup + policy; speculative insert of the prompt's keys for
the chosen worker, deferred when the keys are lazy) -> ``started()`` when it is sent (in-flight accounting) -> ``first_token()``
(prefill done; calibrates the cost model) -> ``finished()``. A retry on another worker is a
new ``route()`` with the failed worker excluded from the candidates.

The load tracker's worker bits are the index's slots (``LoadTracker.bind_bits``), so the
index's match masks and the tracker's idle and member sets meet as integers in ``PoolView``
without a per-worker translation; when the index frees a slot the bits are bound again.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gateway.routing.adapters import AdapterCatalog
from gateway.routing.costmodel import CostModel
from gateway.routing.index import ShadowIndex
from gateway.routing.keys import LazyKeys
from gateway.routing.load import LoadTracker
from gateway.routing.policy import Decision, Policy, PolicyContext, PoolView, RouteRequest

__all__ = ["END", "FIRST", "START", "NoCandidates", "Note", "Router", "Ticket"]

#: kinds of a journal ``Note`` (see ``Router.journal``)
START, FIRST, END = 0, 1, 2
#: (kind, rid, worker, uncached tokens, cached tokens, arrival): ``arrival`` on a START is
#: the popularity key of the request routed (-1: it shared no prefix; -2: not a routed
#: request, e.g. a warm-up); the other fields are 0 / "" where a kind has none
Note = tuple[int, int, str, int, int, int]


class NoCandidates(LookupError):
    """No healthy worker to route to (the gateway answers 503)."""


@dataclass
class Ticket:
    """Handle of a request in flight (returned by ``started``)."""

    rid: int
    decision: Decision
    sent_at: float
    adapter: str | None = None  # the LoRA adapter whose slot it occupies


class Router:
    """Routes the requests of one pool over its workers.

    The shadow index may be shared by several pools' routers (keys of different pools never
    meet); the load tracker is the pool's own and defines its membership.
    """

    def __init__(
        self,
        policy: Policy,
        block_size: int,
        *,
        index: ShadowIndex | None = None,
        loads: LoadTracker | None = None,
        cost: CostModel | None = None,
        rng: random.Random | None = None,
        speculate: bool = True,
        adapters: AdapterCatalog | None = None,
    ) -> None:
        self.policy = policy
        #: LoRA adapters each worker serves and has loaded
        self.adapters = adapters if adapters is not None else AdapterCatalog()
        self.block_size = block_size
        self.index = index if index is not None else ShadowIndex()
        cost = cost or CostModel()
        # busy workers ordered by the cost model's lower bound (see CostModel.queue_key)
        self.loads = loads if loads is not None else LoadTracker(order_key=cost.queue_key)
        # one bit space for the index's match masks and the tracker's sets (see PoolView)
        self._slot_epoch = self.index.slot_epoch
        self.loads.bind_bits(self.index.bit)
        self.ctx = PolicyContext(
            cost=cost,
            rng=rng or random.Random(),
            computed=self.index.holds,
            speculated_at=self.index.speculated_at,
            continues=self.index.continues,
        )
        self.speculate = speculate
        #: when not None, every request's start, first token and end (``Note``s), and the
        #: popularity key its route observed, for the other gateway replicas
        #: (gateway/placements.py): their load views and prefix rates then count the
        #: requests this replica sent, as one gateway's would
        self.journal: list[Note] | None = None
        #: (rid, adapter) of the journaled STARTs that occupy a LoRA slot, beside
        #: ``journal`` (a Note has no field for it; the wire carries it apart, so replicas
        #: of an older version still read the notes): the others then count the slots this
        #: replica's requests fill (``AdapterCatalog.crowded``)
        self.journal_adapters: list[tuple[int, str]] = []
        #: called after a START is journaled: the placements feed sends it at once, since
        #: the others route on top of this request until they count it (offline, a 20 ms
        #: wait raised hot-prefix-8's p99 by up to a fifth)
        self.on_start: Callable[[], None] | None = None
        #: the last routed decision and the popularity key its route observed (its START
        #: carries it; a warm-up's decision, or a retry's, is another object)
        self._routed: tuple[Decision | None, int] = (None, -2)
        #: the engines' own block size: they reuse whole engine blocks only (set from the
        #: workers' registrations; 1 = any canonical block boundary)
        self.engine_block_size = 1

    # -- membership -------------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        self.loads.add_worker(worker)
        self.adapters.add_worker(worker)

    def remove_worker(self, worker: str) -> None:
        """The worker left the pool: forget its load (the index owner forgets its blocks)."""
        self.loads.remove_worker(worker)
        self.adapters.remove_worker(worker)

    def workers(self) -> list[str]:
        return self.loads.workers()

    # -- decisions --------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Housekeeping off the request path: expire speculation, demote stale reports.

        The owner calls it periodically (the gateway every 100 ms; simulators per step).
        """
        self.index.expire(now)
        self.loads.refresh(now)

    def route(
        self,
        keys: Sequence[int],
        prompt_tokens: int,
        now: float,
        *,
        session_key: str | None = None,
        exclude: Iterable[str] = (),
        untrusted: Iterable[str] = (),
        dry_run: bool = False,
        explain: bool = False,
        adapter: str | None = None,
    ) -> Decision:
        """Choose a worker for a prompt of ``prompt_tokens`` tokens with block ``keys``.

        ``keys`` may be :class:`LazyKeys`: the decision computes them only as far as the
        index's match reaches, and the speculative insert that needs them all is left
        pending in the index (applied before anyone next reads or changes it, or by
        ``index.settle()``), so the rest is not on the decision's latency.

        ``exclude``: workers not to use for this request (unhealthy, or already tried).
        ``untrusted``: workers whose index entries are not to be believed (their stream is
        being repaired, or their measured precision is low): candidates by load alone.
        ``adapter``: the LoRA adapter asked for (``keys`` on its chain): only workers serving
        it are candidates, and those without it loaded pay its load in the cost model.
        ``dry_run``: no speculative insert (stateful baselines such as round robin still
        advance). ``explain``: score every worker for the explanation (slower; for debugging).
        """
        index = self.index
        self.loads.refresh(now)
        if index.slot_epoch != self._slot_epoch:  # the index freed a slot: bits may have moved
            self._slot_epoch = index.slot_epoch
            self.loads.bind_bits(index.bit)
        masks = index.match_masks(keys) if self.policy.uses_index and keys else []
        excluded = frozenset(exclude)
        trust = frozenset(untrusted)
        pool = None
        if adapter is not None:
            excluded |= self.adapters.not_serving(adapter)
            # where other adapters fill every slot, the request would wait for one to drain
            # (adapters.py): such workers are left out while any other can take it
            crowded = self.adapters.crowded(adapter, self.loads.workers()) - excluded
            if crowded:
                pool = PoolView.from_masks(self.loads, masks, excluded | crowded, trust)
                if not pool.size:
                    pool = None
        if pool is None:
            pool = PoolView.from_masks(self.loads, masks, excluded, trust)
        if not pool.size:
            raise NoCandidates("no healthy worker")
        if adapter is not None:
            pool.adapter_missing = self.adapters.not_loaded(adapter, pool.workers)
        self.ctx.now = now
        request = RouteRequest(
            keys, prompt_tokens, self.block_size, session_key, self.engine_block_size, adapter
        )
        warm = self.ctx.warmups
        asked = warm.asked
        decision = self.policy.choose(request, pool, self.ctx, explain)
        if warm.asked != asked and self.speculate:
            # a worker being warmed holds the prefix once its warm-up's step ends: requests
            # queued behind the warm-up find it cached (see gateway/routing/replication.py)
            for it in warm.latest(warm.asked - asked):
                index.speculate(it.worker, keys[: it.blocks], now)
        if not dry_run:
            if adapter is not None:
                self.adapters.routed(decision.worker, adapter)
            if pool.masks:  # the prefix this request shares with the cluster's caches
                shared = keys[pool.masks[0][0] - 1]
                self.ctx.popularity.observe(shared, now)
            else:
                self.ctx.popularity.observe_request(now)
                shared = -1
            if self.journal is not None:
                self._routed = (decision, shared)
            if self.speculate and keys:
                start = decision.matched_tokens // self.block_size
                if start and not index.holds(decision.worker, keys[start - 1]):
                    # the match there is itself speculative (a prefill still under way):
                    # this request computes it there too, so it renews the attribution, or
                    # a prefill longer than ``speculative_ttl`` would outlive it
                    start = 0
                if isinstance(keys, LazyKeys) and keys.computed < len(keys):
                    # the rest of the keys after the decision (ShadowIndex.speculate_later)
                    index.speculate_later(decision.worker, keys, now, start=start)
                else:
                    index.speculate(decision.worker, keys, now, start=start)
        return decision

    def started(
        self, decision: Decision, prompt_tokens: int, now: float, adapter: str | None = None
    ) -> Ticket:
        """The request was sent to ``decision.worker`` (for LoRA ``adapter``, if any)."""
        if adapter is not None:
            self.adapters.begin(decision.worker, adapter)
        uncached = max(prompt_tokens - decision.matched_tokens, 1)
        cached = max(prompt_tokens - uncached, 0)
        rid = self.loads.started(decision.worker, uncached, now, cached)
        if self.journal is not None:
            routed, arrival = self._routed
            if routed is decision:
                self._routed = (None, -2)
            else:
                arrival = -2
            self.journal.append((START, rid, decision.worker, uncached, cached, arrival))
            if adapter is not None:
                self.journal_adapters.append((rid, adapter))
            if self.on_start is not None:
                self.on_start()
        return Ticket(rid, decision, now, adapter)

    def first_token(self, ticket: Ticket, now: float) -> None:
        """The first token arrived: the request's prefill is done."""
        if not self.loads.first_token(ticket.rid):
            return
        if self.journal is not None:
            self.journal.append((FIRST, ticket.rid, "", 0, 0, 0))
        predicted = ticket.decision.predicted_ttft_ms
        if predicted is not None:
            self.ctx.cost.observe(predicted, (now - ticket.sent_at) * 1000.0)

    def finished(self, ticket: Ticket, now: float) -> None:
        """The request ended (success, error or cancellation)."""
        self.loads.finished(ticket.rid)
        if ticket.adapter is not None:
            self.adapters.end(ticket.decision.worker, ticket.adapter)
        if self.journal is not None:
            self.journal.append((END, ticket.rid, "", 0, 0, 0))
