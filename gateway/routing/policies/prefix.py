"""Baseline: the longest cached prefix, load ignored (ties and misses at random).

Shows what cache affinity alone does: best hit rate on paper, and a hot prefix piles every
request onto its holder.
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


class LongestPrefix(Policy):
    name = "prefix"
    REASONS = ("cache", "cold")

    def choose(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, explain: bool = False
    ) -> Decision:
        matches = pool.matches
        if not matches:
            return simple_decision(
                self, request, ctx.rng.choice(pool.workers), pool, "cold", explain
            )
        best = max(matches.values())
        worker = ctx.rng.choice(sorted(w for w, m in matches.items() if m == best))
        return simple_decision(self, request, worker, pool, "cache", explain)


register(LongestPrefix)
