"""Default policy: the lowest predicted time to first token.

For every candidate: predicted TTFT = prefill work queued ahead of the request + prefill of
the request's uncached tokens (prompt - matched prefix), chunked, stretched by the decode of
the sequences running alongside (``CostModel.ttft_ms``). One cost handles the cases threshold
switches get wrong: a saturated holder of a hot prefix loses to an idle worker that pays one
prefill; at low concurrency idle workers tie and the tie is broken at random (never "worker
0"); a conversation follows its prefix while loads are comparable.

``compute_weight`` adds the cluster's side of the bill: prefill time spent on uncached tokens
is time that worker cannot serve others, so among near-equal TTFTs the one that reuses more
cache wins. Near-ties (within ``tie_ms`` or ``tie_ratio``) go to the longest match, then to a
uniformly random worker among them.

Cost: the workers holding a prefix are scored one by one (there are few); the others all
need the full prefill, so idle ones are interchangeable (one score for all) and busy ones are
visited by increasing queue until a lower bound shows no later one can win. A decision
touches a handful of workers whatever the pool size.
"""

from __future__ import annotations

from gateway.policy import (
    CandidateScore,
    Decision,
    Policy,
    PolicyContext,
    PoolView,
    RouteRequest,
    register,
)


@register
class PredictedTTFT(Policy):
    name = "ttft"
    REASONS = ("single", "cold", "cache", "balance")

    def __init__(
        self, compute_weight: float = 0.5, tie_ms: float = 1.0, tie_ratio: float = 0.02
    ) -> None:
        if compute_weight < 0 or tie_ms < 0 or tie_ratio < 0:
            raise ValueError("compute_weight, tie_ms and tie_ratio must be >= 0")
        self.compute_weight = compute_weight
        self.tie_ms = tie_ms
        self.tie_ratio = tie_ratio

    def choose(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, explain: bool = False
    ) -> Decision:
        cost = ctx.cost
        scale = cost.scale
        cw = self.compute_weight
        tie_ms, tie_ratio = self.tie_ms, self.tie_ratio
        prompt = request.prompt_tokens
        mt = request.matched_tokens

        # Workers with the same matched prefix ("level") and the same load are
        # interchangeable: a level's idle workers are scored once, and busy workers are
        # visited by increasing lower bound (LoadTracker's order) until no level that still
        # has unvisited workers can win.
        level_of: dict[str, int] = {}
        idle_at: dict[int, list[str]] = {}
        busy_at: dict[int, int] = {}
        idle_pos = pool.loads.idle_index()
        for blocks, ws in pool.levels:
            m = mt(blocks)
            level_of.update(dict.fromkeys(ws, m))
            idle = [w for w in ws if w in idle_pos]
            if idle:
                idle_at[m] = idle
            if len(idle) < len(ws):
                busy_at[m] = busy_at.get(m, 0) + len(ws) - len(idle)
        idle0 = [w for w in pool.idle() if w not in level_of] if level_of else pool.idle()
        if idle0:
            idle_at[0] = idle0
        busy0 = pool.busy_count() - sum(busy_at.values())
        if busy0 > 0:
            busy_at[0] = busy_at.get(0, 0) + busy0

        floors: dict[int, float] = {}
        bases: dict[int, float] = {}
        for m in {0, *idle_at, *busy_at}:
            new = prompt - m
            floors[m] = cw * cost.prefill_ms(new) * scale
            bases[m] = cost.chunked_prefill_ms(new) * scale + floors[m]

        best = float("inf")
        idle_score: dict[int, tuple[float, float]] = {}
        for m in idle_at:
            t = cost.ttft_ms(0.0, prompt - m, 0.0, 0.0)
            idle_score[m] = (t + floors[m], t)
            best = min(best, t + floors[m])

        # (score, worker, matched tokens, predicted ttft) of every busy worker scored
        scored: list[tuple[float, str, int, float]] = []
        limit = best + max(tie_ms, best * tie_ratio)
        min_base = min((bases[m] for m in busy_at), default=float("inf"))
        cache: dict[tuple[float, float, float, int], tuple[float, float]] = {}
        view = pool.view
        for key, w in pool.busy_by_key():
            bound = key * scale
            if not explain and min_base + bound > limit:
                break
            m = level_of.get(w, 0)
            left = busy_at[m] - 1
            if left:
                busy_at[m] = left
            else:
                del busy_at[m]
                min_base = min((bases[x] for x in busy_at), default=float("inf"))
            if not explain and bases[m] + bound > limit:
                continue
            v = view(w)
            state = (v.queued_prefill_tokens, v.running, v.kv_usage, m)
            hit = cache.get(state)
            if hit is None:
                t = cost.ttft_ms(state[0], prompt - m, state[1], state[2])
                hit = cache[state] = (t + floors[m], t)
            scored.append((hit[0], w, m, hit[1]))
            if hit[0] < best:
                best = hit[0]
                limit = best + max(tie_ms, best * tie_ratio)

        near = [e for e in scored if e[0] <= limit]
        near_idle = [m for m, (s, _) in idle_score.items() if s <= limit]
        top = max([e[2] for e in near] + near_idle)
        ties = [e[1] for e in near if e[2] == top]
        if top in near_idle:
            ties.extend(idle_at[top])
        pick = ctx.rng.choice(ties)
        matched = level_of.get(pick, 0)
        if pick in idle_pos:
            ttft = idle_score[matched][1]
        else:
            ttft = next(e[3] for e in scored if e[1] == pick)
        best_match = mt(pool.levels[0][0]) if pool.levels else 0
        if len(pool.workers) == 1:
            reason = "single"
        elif best_match == 0:
            reason = "cold"
        elif matched >= best_match:
            reason = "cache"
        else:
            reason = "balance"
        cands: tuple[CandidateScore, ...] = ()
        if explain:
            for m, ws in idle_at.items():
                scored.extend((idle_score[m][0], w, m, idle_score[m][1]) for w in ws)
            cands = tuple(CandidateScore(w, m, t, s) for s, w, m, t in scored)
        return Decision(pick, self.name, reason, matched, ttft, cands)
