"""Default policy: the lowest predicted time to first token.

For every candidate: predicted TTFT = prefill work queued ahead of the request + prefill of
the request's uncached tokens (prompt - matched prefix), chunked, stretched by the decode of
the sequences running alongside (``CostModel.ttft_ms``). One cost handles the cases threshold
switches get wrong: a saturated holder of a hot prefix loses to an idle worker that pays one
prefill; at low concurrency idle workers tie and the tie is broken at random (never "worker
0"); a conversation follows its prefix while loads are comparable.

``compute_weight`` adds the cluster's side of the bill: prefill time spent on uncached tokens
is time that worker cannot serve others, so among near-equal TTFTs the one that reuses more
cache wins. Near-ties (within ``tie_ms`` or ``tie_ratio``) go to the longest match, then to
the worker that has waited longest for a request (round robin among equals; random among
workers never used), never to "worker 0".

``step_ties`` (off by default) widens the near-ties among busy workers with that match by
that many decode steps. A busy engine's next step starts anywhere within its current one,
which no report shows; when every request is alike (one hot prefix, same-size questions) a
few milliseconds of predicted queue are that phase, not load, and taking turns queues 3-4%
less than choosing by them (offline simulator, 2 and 8 workers). With requests of
mixed sizes (multi-turn chat) the same differences are real queued work: ``step_ties: 1``
raised p99 TTFT 12-22% at 95% load on the chat-eviction preset (live A/B), so it is a
setting for uniform traffic, not the default.

Hot prefixes are replicated in proportion to demand (``gateway/routing/replication.py``): a
prefix arriving at ``r`` requests/s whose cold prefill takes ``p`` ms warrants
``ceil(replication × r × p / 1000)`` holders (engine time demanded against one worker's
second), following the decayed rate up and down. Only sustained demand counts
(``min_requests`` recent requests, decayed): a burst of siblings sharing a new prefix stays
together, as speculation intends. When the prefix has fewer holders (and warm-ups under way)
than it warrants, the policy asks for a warm-up of the least loaded non-holder (an idle one
at random if any) and routes the request as usual: the gateway sends that worker the prefix
alone with one output token, off the request path, and traffic moves there once the index
shows the prefix (reason ``cache`` or ``balance`` then). With ``warmup: false`` the request
itself goes to the non-holder instead, cold (reason ``replicate``), when the best holder is
busy. A conversation's own prefix (a low rate) never replicates; one system prompt on every
request at a high rate ends up on every worker.

LoRA adapters: a request for an adapter is keyed on the adapter's chain (its matches are
blocks computed with that adapter only), and a worker without the adapter loaded adds
``CostParams.adapter_load_ms`` to its predicted TTFT, so among equal caches and loads the
worker that has the adapter wins, and a loaded but saturated one still loses to an idle
worker that pays the load.

Cost: workers with the same match length and load are interchangeable, so idle ones are
scored once per match length, and busy ones are visited by increasing lower bound
(``CostModel.queue_key``) until the bound shows no later one can win; at most
``max_scored`` busy workers are scored per match length (later ones of that length have
larger bounds, so they could only tie). A decision touches a few dozen workers at most,
whatever the pool size.
"""

from __future__ import annotations

from itertools import repeat

from gateway.routing.policy import (
    CandidateScore,
    Decision,
    Policy,
    PolicyContext,
    PoolView,
    RouteRequest,
    register,
)
from gateway.routing.replication import WarmupIntent, holders_needed


@register
class PredictedTTFT(Policy):
    name = "ttft"
    REASONS = ("single", "cold", "cache", "balance", "replicate")

    def __init__(
        self,
        compute_weight: float = 1.5,
        tie_ms: float = 1.0,
        tie_ratio: float = 0.02,
        replication: float = 1.0,
        min_requests: float = 2.0,
        max_scored: int = 16,
        step_ties: float = 0.0,
        warmup: bool = True,
    ) -> None:
        if min(compute_weight, tie_ms, tie_ratio, replication, step_ties) < 0:
            raise ValueError(
                "compute_weight, tie_ms, tie_ratio, replication and step_ties must be >= 0"
            )
        self.compute_weight = compute_weight
        self.tie_ms = tie_ms
        self.tie_ratio = tie_ratio
        self.replication = replication
        self.min_requests = min_requests
        self.max_scored = max_scored  # busy workers scored per match length (0: all)
        self.step_ties = step_ties  # same-match near-ties: this many decode steps (see choose)
        self.warmup = warmup  # new holders are warmed off the request path (else: spill cold)

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

        # A LoRA request costs an adapter load where the adapter is not loaded: an idle
        # worker without it is worse than one with it at the same match, so a level keeps
        # only its idle workers with the adapter when it has any.
        missing = pool.adapter_missing
        pen = cost.params.adapter_load_ms * scale if missing else 0.0
        idle_pen: dict[int, float] = {}
        if missing:
            for m, ws in idle_at.items():
                have = [w for w in ws if w not in missing]
                if have:
                    idle_at[m] = have
                else:
                    idle_pen[m] = pen

        best = float("inf")
        idle_score: dict[int, tuple[float, float]] = {}
        for m in idle_at:
            t = cost.ttft_ms(0.0, prompt - m, 0.0, 0.0) + idle_pen.get(m, 0.0)
            idle_score[m] = (t + floors[m], t)
            best = min(best, t + floors[m])

        # (score, worker, matched tokens, predicted ttft) of every busy worker scored
        scored: list[tuple[float, str, int, float]] = []
        # step_ties: same-match busy workers within that many decode steps tie (see the
        # module docstring); the scan goes that much further so every such worker is scored.
        step = self.step_ties * cost.max_decode_step_ms() * scale if self.step_ties else 0.0
        limit = best + max(tie_ms, best * tie_ratio)
        reach = limit + step
        min_base = min((bases[m] for m in busy_at), default=float("inf"))
        own = {m: cost.own_prefill(prompt - m) for m in floors}
        scored_at: dict[int, int] = {}
        cap = self.max_scored if not explain else 0
        view = pool.view
        for key, w in pool.busy_by_key():
            bound = key * scale
            if not explain and min_base + bound > reach:
                break
            m = level_of.get(w, 0)
            left = busy_at.get(m, 0) - 1
            if left < 0:  # this match length is done (all seen, or enough scored)
                continue
            n = scored_at.get(m, 0) + 1
            scored_at[m] = n
            if left and n != cap:
                busy_at[m] = left
            else:  # later workers of this length have larger bounds: they could only tie
                del busy_at[m]
                min_base = min((bases[x] for x in busy_at), default=float("inf"))
            if not explain and bases[m] + bound > reach:
                continue
            v = view(w)
            t = cost.ttft_after(own[m], v.queued_prefill_tokens, v.running, v.kv_usage)
            if missing and w in missing:
                t += pen
            s = t + floors[m]
            scored.append((s, w, m, t))
            if s < best:
                best = s
                limit = best + max(tie_ms, best * tie_ratio)
                reach = limit + step

        near = [e for e in scored if e[0] <= limit]
        near_idle = [m for m, (s, _) in idle_score.items() if s <= limit]
        top = max([e[2] for e in near] + near_idle)
        ties = [e[1] for e in near if e[2] == top]
        if top in near_idle:
            ties.extend(idle_at[top])
        elif self.step_ties:  # an idle engine starts at once: only busy ones have a phase
            at_top = [e for e in scored if e[2] == top]
            first = min(at_top)
            window = (
                first[0]
                + max(tie_ms, first[0] * tie_ratio)
                + self.step_ties * (cost.decode_step_ms(pool.view(first[1]).kv_usage) * scale)
            )
            ties = [e[1] for e in at_top if e[0] <= window]
        pick = self._tie_break(ties, pool, ctx)
        matched = level_of.get(pick, 0)
        if pick in idle_pos:
            ttft = idle_score[matched][1]
        else:
            ttft = next(e[3] for e in scored if e[1] == pick)
        best_match = mt(pool.levels[0][0]) if pool.levels else 0
        replicate = self.replication and request.adapter is None  # adapters: not modelled
        replica = self._replica(request, pool, ctx, pick) if replicate else None
        if replica is not None:
            pick, matched = replica, level_of.get(replica, 0)
            v = pool.view(replica)
            ttft = cost.ttft_ms(v.queued_prefill_tokens, prompt - matched, v.running, v.kv_usage)
            return Decision(pick, self.name, "replicate", matched, ttft, ())
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

    @staticmethod
    def _tie_break(ties: list[str], pool: PoolView, ctx: PolicyContext) -> str:
        """Among equally good workers, the one that has waited longest for a request; a coin
        toss among those never sent one. Round robin among equals spaces each worker's
        arrivals evenly, which queues less than independent random picks."""
        if len(ties) == 1:
            return ties[0]
        sent = list(map(pool.loads.last_sent_map().get, ties, repeat(float("-inf"))))
        oldest = min(sent)
        return ctx.rng.choice([w for w, t in zip(ties, sent, strict=True) if t == oldest])

    def _replica(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, pick: str
    ) -> str | None:
        """Grow a hot prefix's holder set if its demand warrants more holders than it has.

        With ``warmup`` the new holder is asked for in ``ctx.warmups`` and None is returned
        (the request goes to ``pick``); without, the non-holder is returned to receive this
        request cold, and only while ``pick`` is busy."""
        if not pool.levels:
            return None
        depth, holders = pool.levels[0]
        if pick not in holders or depth > len(request.keys):
            return None
        if not self.warmup and pool.view(pick).idle:
            return None
        key = request.keys[depth - 1]
        now = ctx.now
        pop = ctx.popularity
        # this request and the recent ones (decayed: half a request of slack)
        if pop.weight(key, now) + 1.5 < self.min_requests:  # a burst, not sustained demand
            return None
        cost = ctx.cost
        tokens = request.matched_tokens(depth)
        need = holders_needed(
            pop.rate(key, now),
            cost.chunked_prefill_ms(tokens) * cost.scale,
            len(pool.workers),
            self.replication,
        )
        book = ctx.warmups
        warming = book.pending(key, holders, now) if self.warmup else []
        if len(holders) + len(warming) >= need:
            return None
        target = self._newcomer(pool, ctx, pick, {*holders, *warming})
        if target is None or not self.warmup:
            return target
        book.want(WarmupIntent(target, key, depth, tokens, now))
        return None

    @staticmethod
    def _newcomer(pool: PoolView, ctx: PolicyContext, pick: str, taken: set[str]) -> str | None:
        """The worker to become a new holder: an idle non-holder at random, else the least
        loaded busy non-holder if it is lighter than ``pick``."""
        idle = [w for w in pool.idle() if w not in taken]
        if idle:
            return ctx.rng.choice(idle)
        busy = pool.view(pick)
        mine = (busy.running, busy.queued_prefill_tokens)
        for _, w in pool.busy_by_key():
            if w not in taken:
                v = pool.view(w)
                return w if (v.running, v.queued_prefill_tokens) < mine else None
        return None
