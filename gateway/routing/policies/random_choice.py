"""Baseline: a uniformly random worker."""

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


class RandomChoice(Policy):
    name = "random"
    uses_index = False
    REASONS = ("random",)

    def choose(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, explain: bool = False
    ) -> Decision:
        return simple_decision(self, request, ctx.rng.choice(pool.workers), pool, "random", explain)


register(RandomChoice)
