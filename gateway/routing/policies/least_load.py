"""Baseline: power of two choices on load, cache-blind.

Two distinct random workers; the one with fewer sequences in the engine, then less queued
prefill work, wins. Sampling two instead of taking the global minimum avoids the herd that
"always the least loaded" causes when several gateways share stale load figures.
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


class LeastLoad(Policy):
    name = "least_load"
    uses_index = False
    REASONS = ("least_load",)

    def choose(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, explain: bool = False
    ) -> Decision:
        workers = pool.workers
        pair = ctx.rng.sample(workers, 2) if len(workers) > 1 else workers

        def load(w: str) -> tuple[float, float]:
            v = pool.view(w)
            return v.running, v.queued_prefill_tokens

        return simple_decision(self, request, min(pair, key=load), pool, "least_load", explain)


register(LeastLoad)
