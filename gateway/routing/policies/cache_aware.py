"""Baseline: SGLang's and smg's ``cache_aware`` decision rule, on kvroute's index.

A model of the peer for the offline simulator and A/B runs, so that where smg cache_aware
beats kvroute live the rule can be replayed offline on the same stream. Its decision, from
smg's documentation (shared/reference/peers.md): if the in-flight requests are imbalanced
(``max - min > balance_abs`` and ``max > min x balance_rel``) the least-loaded worker, cache
ignored; otherwise the longest match if it covers more than ``cache_threshold`` of the
prompt (ties at random); otherwise the least-loaded worker. Load is the router's own count
of requests in flight, as smg's.

Where it differs from smg: matches come from the index (the engines' events plus kvroute's
speculative inserts) rather than a tree of the text smg itself routed, and a miss goes to the
least-loaded worker, as smg's current versions do (older ones took the smallest tree).
"""

from __future__ import annotations

from gateway.routing.policy import (
    Decision,
    Policy,
    PolicyContext,
    PoolView,
    RouteRequest,
    register,
    simple_decision,
)


class CacheAware(Policy):
    name = "cache_aware"
    REASONS = ("balance", "cache", "cold")

    def __init__(
        self, cache_threshold: float = 0.3, balance_abs: float = 64.0, balance_rel: float = 1.5
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0 or balance_abs < 0 or balance_rel < 1.0:
            raise ValueError(
                "cache_threshold must be in [0, 1], balance_abs >= 0 and balance_rel >= 1"
            )
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def choose(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, explain: bool = False
    ) -> Decision:
        workers = pool.workers
        load = {w: pool.loads.inflight(w) for w in workers}
        lo, hi = min(load.values()), max(load.values())
        least = ctx.rng.choice(sorted(w for w in workers if load[w] == lo))
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return simple_decision(self, request, least, pool, "balance", explain)
        matches = pool.matches
        if matches and request.prompt_tokens > 0:
            best = max(matches.values())
            if request.matched_tokens(best) > self.cache_threshold * request.prompt_tokens:
                worker = ctx.rng.choice(sorted(w for w, m in matches.items() if m == best))
                return simple_decision(self, request, worker, pool, "cache", explain)
        return simple_decision(self, request, least, pool, "cold", explain)


register(CacheAware)
