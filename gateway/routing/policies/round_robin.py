"""Baseline: each request to the next worker in turn (cache- and load-blind)."""

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


class RoundRobin(Policy):
    name = "round_robin"
    uses_index = False
    REASONS = ("turn",)

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, explain: bool = False
    ) -> Decision:
        workers = pool.workers
        worker = workers[self._turn % len(workers)]
        self._turn += 1
        return simple_decision(self, request, worker, pool, "turn", explain)


register(RoundRobin)
