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
that many decode steps; ``hot_step_ties`` (2) does the same only for a prefix replicated for
its demand (held by several workers, ``holders_needed`` >= 2), whose requests are alike.
A busy engine's next step starts anywhere within its current one, which no report shows; when every request is alike (one hot prefix, same-size questions) a
few milliseconds of predicted queue are that phase, not load, and taking turns queues 3-4%
less than choosing by them (offline simulator, 2 and 8 workers). With requests of
mixed sizes (multi-turn chat) the same differences are real queued work: ``step_ties: 1``
raised p99 TTFT 12-22% at 95% load on the chat-eviction preset (live A/B), so it is a
setting for uniform traffic, not the default. A hot prefix's requests are that uniform
traffic, and a conversation's prefix (one holder) or a system prompt whose share warrants one
holder never qualifies, so ``hot_step_ties`` is on: without it kvroute's p50 on one hot
prefix was 3-10% above round robin's at 60-95% load (offline simulator, 2 and 8 workers).

``queue_weight`` (off by default) makes the cluster's side of the bill grow with the queues:
a request's own prefill also delays every request that reaches its worker while it waits
and prefills there, about the pool's arrival rate per worker x its TTFT there, so a score
adds ``queue_weight`` x prefill x that count. Idle, the term is small; near capacity it
keeps a conversation on its busy holder rather than moving it to a shorter queue, where
its whole prefill would lengthen the queues that prompted the move. On chat-eviction at
60-80% (offline, 12 seeds) the medians and the p99 fell (p99 -15% / -11% at 0.3), and at
60% fewer runs tipped into eviction thrash, less far (48 runs: 2 past 2.5 s, at most 3.3 s,
against 4 and 8.8 s); on long, mostly cold prompts past capacity
(``trace-production`` at 40-60%) the median fell 14-21% and the p99 rose 21-35%, the cold
long prompts that the default spreads waiting behind the requests that match where they
are (docs/benchmarks.md, "Collapses near capacity are the policy's").

``warm_queue_weight`` (off by default) is that term only where it should pay: while the
pool's recent reuse is at least ``cold_reuse`` (after ``cold_min_requests``), the gate
``cold_wait_ratio`` uses the other way round. With much reuse a move off a busy holder
redoes a conversation's (or an adapter's) prefill and evicts others' cache; with little
(trace-production, hit ~0.06) there is nothing to lose by spreading, and the term cost the
p99 there. Offline at 0.3 (docs/benchmarks.md, "The queue weight where the pool reuses
much"): chat-eviction at 60% p50 / p99 1,424 / 5,212 to 1,241 / 4,403 ms (12 seeds), lora,
hot-sudden and dp-ranks lower at their highest load, trace-production unchanged (the gate
stays shut), dp-ranks at 50-60% p99 +2-7%. Live on chat-eviction at 60% the gain did not
show: in four alternated pairs it was worse in three (goodput 0.78 against 0.93 on
average), so it stays off until the simulator and the live gateway agree on it. A larger
``queue_weight`` applies whatever the reuse.

``long_tie_ratio`` (off by default) widens the near-ties of a long request (uncached tokens
at least ``long_factor`` x the pool's recent mean, ``LoadTracker.mean_prompt_tokens``) to
that ratio of its best score, so among workers within it the longest match, then the one
that waited longest, takes it. Routing every request to its own lowest predicted TTFT is
greedy: a long cold prompt takes the shortest queue and every short request sent after it
waits behind it, while the long one would lose only a small fraction of its own time on a
busier worker. On long, mostly cold prompts past the cluster's capacity (the
``trace-production`` preset at 60%) ``long_tie_ratio: 1`` moved the offline median from
7.3 to 4.2 s and goodput at 8 s from 0.53 to 0.81, at the cost of the p99 (19 to 28 s),
and at 20% load raised the p99 5.8 to 9.6 s; on chat-eviction it raised the p99 with the
median level (docs/benchmarks.md, "Long prompts yield the shortest queue"). A median- and
goodput-first setting for long-prompt traffic, not the default.

``long_wait_ratio`` (off by default) is the same idea with the window measured in the long
request's predicted wait at its best worker (its score less its own prefill there), not in
its whole TTFT: it stays closed while an idle worker can start the request at once and opens
only when every worker has a queue, which is where the greedy choice hurts. On
trace-production (offline, 3 seeds) ``long_wait_ratio: 3`` kept the default's p99 at 20%
load and improved every percentile at 40%, and at 60% moved the median 7.3 to 4.7 s and
goodput 0.53 to 0.79 with the p99 19 to 25 s; on chat-eviction at 60%, hot-sudden, lora and
dp-ranks it raised the p99 (docs/benchmarks.md, "A window of the wait: long_wait_ratio").

``cold_wait_ratio`` (3, on by default) is that window, opened automatically while the pool
has little reuse to lose: while the share of recent requests' prompt tokens predicted cached
where they were sent (``LoadTracker.reuse``) is below ``cold_reuse`` (0.3). What separates
trace-production from the presets the window hurt is reuse, not size: there (hit ~0.06)
where a long cold prompt goes decides nothing later, so letting it leave the shortest queue
to the short requests costs no cache; on multi-turn chat, LoRA and hot-prefix traffic (hit
0.84-0.97) a long request is typically a conversation's or an adapter's first turn, its
placement decides where the following turns find their cache, and the greedy choice is the
right one there (the window raised their p99 by 16-63%). Offline, 2-3 seeds per preset, it
gives trace-production long_wait_ratio 3's figures (60%: median 7.3 to 4.7 s, p99 19 to
25 s) and every other preset the former default's, bar one request in hot-sudden's 30%
(docs/benchmarks.md, "A window for cold pools: cold_wait_ratio"). ``cold_wait_ratio: 0``
turns it off; an explicit larger ``long_wait_ratio`` applies whatever the reuse. The gate
asks for evidence: it stays shut until the pool has sent ``cold_min_requests`` (32)
requests, so a fresh pool (or a router that only answers dry runs, as ``bench index``'s) is
not taken for a cold one; a decision with the window open scores more workers (``bench
index`` with ``long_wait_ratio: 3``: decision p99 ~1.45x).

Hot prefixes are replicated in proportion to demand (``gateway/routing/replication.py``): a
prefix arriving at ``r`` requests/s whose cold prefill takes ``p`` ms warrants
``ceil(replication × r × p / 1000)`` holders (engine time demanded against one worker's
second), following the decayed rate up and down. Only sustained demand counts
(``min_requests`` recent requests, decayed): a burst of siblings sharing a new prefix stays
together, as speculation intends. When the prefix has fewer holders (and warm-ups under way)
than it warrants, the new holder is an idle non-holder at random, else the least loaded busy
one if it is lighter than the best holder, and it is warmed: the policy asks for a warm-up
and routes the request as usual; the gateway sends that worker the prefix alone with one
output token, off the request path, and traffic moves there once the index shows the prefix
(reason ``cache`` or ``balance`` then). Not at the prefix's onset, while no holder has
computed it yet: a warm-up then computes it a second time beside the holder's prefill,
serving no request, and on a busy engine the requests the index sends there meanwhile are
admitted before it is done and compute it once more (on the ``hot-sudden`` preset past
capacity this put kvroute's p50 at 1.3x round robin's, docs/benchmarks.md); the request
itself goes to the new holder cold instead (reason ``replicate``) when the best holder is
busy, as round robin would send it. With ``warmup: false`` that is what always happens.
At a hot prefix's onset, while its holder is still prefilling it (the index's match is
only speculative), a request that would wait there goes cold to a non-holder (reason
``replicate``) if it is predicted no slower there and the demand counting it warrants
another holder: round robin spreads the first cold prefills over the workers at once, and
waiting a warm-up's worth before starting the second holder made kvroute's cold start
slower than round robin's. The demand there counts from the request that put the prefix on
its holder (the index's speculative attribution), not from the prefix's first match: a
conversation's next turn sent while its previous turn still waits in the holder's queue
(open-loop traffic past capacity) is one request in seconds, not a burst. Counted over the
rate's 0.1 s minimum window instead, such turns went cold to other workers, each computing its
whole conversation again, and on the chat-eviction preset at 30 req/s that extra work tipped
the cluster into a collapse it did not leave (docs/benchmarks.md, "Open-loop turns are not an
onset"). A conversation's own prefix (a low rate) never replicates; one
system prompt on every request at a high rate ends up on every worker.

``next_turns`` (on by default) keeps a conversation's next turn out of that onset rule
altogether: when the holder's chain ends at the request's match (the request extends the
prompt queued there instead of sharing a prefix of it, ``ShadowIndex.continues``), it is
one conversation, whatever rate its one request suggests. Counted from the previous turn's
attribution, a turn sent 0.1-0.3 s after it (open-loop) still measured 3-10 requests/s; with
a cost model that prices the holder's queue as the engines spend it, such turns went cold
to other workers by the dozen, each recomputing its conversation, and chat-eviction at 80%
collapsed (offline, 6 seeds: p50 / p99 15.2 / 46.7 s, 2.2 / 9.2 s with the rule); with the
default model the rule cuts that cell's p50 / p99 by 30% / 28% (docs/benchmarks.md, "Next
turns are not an onset").

``onset_siblings`` (off by default) counts one more request at that onset: the one its
holder is prefilling, when the request being routed shares only a prefix of its prompt (the
holder's chain goes on past the match, ``ShadowIndex.continues``: a sibling, not a
conversation's next turn). Then a hot prefix's second request already takes a second
worker cold, as round robin sends it, where by default the third does: on hot-prefix-2 at
30% (offline, seed 3) the onset became round robin's request for request, and the window's
p99 went from 1.004x to 1.001x round robin's (10 seeds), hot-prefix-8's 30% p99 below
it. But every preset with several shared prefixes lost by it: each system prompt's onset
put a second cold copy on another worker, and the hit rate fell 0.1-0.9 points on
chat-eviction, dp-ranks and lora, chat-eviction's 60% p99 +5% and 80% p50 +15% (12 seeds),
hot-sudden's 80% p50 +17% (docs/benchmarks.md, "A hot prefix's second request at its
onset"). A setting for a pool whose traffic is one hot prefix, not the default.

``warm_idle`` (on by default) adds holders for a reason the demand's compute does not
show: in a cold pool (recent reuse below ``cold_reuse``), a sustained prefix (not a burst)
whose holders are all busy is warmed onto an idle worker that lacks it, one per request
while any such worker is left. On long, mostly cold prompts sharing one short prefix (the
``trace-production`` preset: 512 shared tokens of ~12,000) every request prefers a holder
that is decoding (one or two decode steps ride along its prefill, ~30-60 ms) to an idle
worker that would recompute the prefix (~60-130 ms more), a prefix that short warrants one
holder for its compute, so the workers the first requests missed were never sent
anything: at 1.2 req/s over 90 s (offline) four of eight workers took 1, 2, 7 and 9 of
121 requests. Warmed, they take their share as idle holders (13-18 each); the 20% cell's
median (30 s) went from 913 to 873 ms (every request alone on an idle worker with the
prefix cached: 832), p90 / p99 level, at 40% 1,763 to 1,556 ms; at 60%, where idle
workers are rare, the change is within the run-to-run noise (docs/benchmarks.md, "Idle
workers without the shared prefix"). With much reuse (multi-turn chat) the gate stays
shut: there warmed copies displaced conversations' cache (chat-eviction at 30%: hit 0.896
to 0.890 without the gate). At fleet size its warm-ups cost the offline simulator nothing
measurable: Q6 (2,048 workers x 1M requests, a trace reusing ~18%) took 354.9 s with it and
352.2 s without, back to back on one machine (TTFT p50 126 vs 128 ms); an earlier pair,
650.9 vs 539.6 s, which had it off by default for a while, ran 20 minutes apart on a machine
whose speed drifted (docs/benchmarks.md, "Idle workers without the shared prefix").

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
whatever the pool size, and nothing in it grows with a prefix's holders: match levels, idle
workers and members are bit sets (``PoolView``), counted and intersected, never listed; once
only levels with few busy holders are left unfinished, the scan visits just those (in the
same order); the longest-waiting idle worker of a group is found from the tracker's waiting
order; a tie among workers never sent a request is drawn from their bit set; the cost
model's request and load terms are memoised. A prefix held by all of 2,048 workers costs
what one held by two does. The decisions, ties and random draws are exactly those of a scan
over every worker in the same order (tests/test_routing_scale.py), except which of several
never-sent workers matching nothing a draw picks (same candidates, same odds; ``_tie_break``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import islice, repeat

from gateway.routing.costmodel import RequestTerms
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
        hot_step_ties: float = 2.0,
        long_tie_ratio: float = 0.0,
        long_factor: float = 1.0,
        long_wait_ratio: float = 0.0,
        cold_wait_ratio: float = 3.0,
        cold_reuse: float = 0.3,
        cold_min_requests: int = 32,
        warm_idle: bool = True,
        queue_weight: float = 0.0,
        warm_queue_weight: float = 0.0,
        onset_siblings: bool = False,
        next_turns: bool = True,
    ) -> None:
        if (
            min(compute_weight, tie_ms, tie_ratio, replication, step_ties, hot_step_ties) < 0
            or min(long_tie_ratio, long_factor, long_wait_ratio, cold_wait_ratio, cold_reuse) < 0
            or min(cold_min_requests, queue_weight, warm_queue_weight) < 0
        ):
            raise ValueError(
                "compute_weight, tie_ms, tie_ratio, replication, step_ties, hot_step_ties,"
                " long_tie_ratio, long_factor, long_wait_ratio, cold_wait_ratio, cold_reuse,"
                " cold_min_requests, queue_weight and warm_queue_weight must be >= 0"
            )
        self.compute_weight = compute_weight
        self.tie_ms = tie_ms
        self.tie_ratio = tie_ratio
        self.replication = replication
        self.min_requests = min_requests
        self.max_scored = max_scored  # busy workers scored per match length (0: all)
        self.step_ties = step_ties  # same-match near-ties: this many decode steps (see choose)
        self.warmup = warmup  # new holders are warmed off the request path (else: spill cold)
        self.hot_step_ties = hot_step_ties  # step_ties for a prefix hot enough to replicate
        # near-ties of a long request (uncached tokens >= long_factor x the pool's recent
        # mean): off (0) by default, see the module docstring
        self.long_tie_ratio = long_tie_ratio
        self.long_factor = long_factor
        # ... or within that many times its wait at its best worker (0: off)
        self.long_wait_ratio = long_wait_ratio
        # ... and that window by default while the pool's recent reuse is below cold_reuse
        self.cold_wait_ratio = cold_wait_ratio
        self.cold_reuse = cold_reuse
        self.cold_min_requests = cold_min_requests  # ... once that many requests were sent
        # a sustained prefix whose holders are all busy is warmed onto an idle non-holder
        # while the pool is cold (below cold_reuse): see the module docstring
        self.warm_idle = warm_idle
        # the request's prefill also delays the requests that reach its worker meanwhile
        # (off by default): see the module docstring
        self.queue_weight = queue_weight
        # ... and that weight while the pool's recent reuse is at least cold_reuse
        self.warm_queue_weight = warm_queue_weight
        # at a prefix's onset, the request being prefilled counts as demand when this one is
        # its sibling (off by default): see the module docstring
        self.onset_siblings = onset_siblings
        # a conversation's next turn never spills at an onset (see _spill)
        self.next_turns = next_turns

    def choose(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, explain: bool = False
    ) -> Decision:
        cost = ctx.cost
        scale = cost.scale
        cw = self.compute_weight
        tie_ms, tie_ratio = self.tie_ms, self.tie_ratio
        prompt = request.prompt_tokens
        mt = request.matched_tokens
        bits_of = pool.loads.bits()

        # Workers with the same matched prefix ("level") and the same load are
        # interchangeable: a level's idle workers are one bit set scored once, and busy
        # workers are visited by increasing lower bound (LoadTracker's order) until no level
        # that still has unvisited workers can win. Nothing here walks a level's holders.
        idle_all = pool.idle_bits
        levels: list[tuple[int, int]] = []  # (matched tokens, holders' bits), longest first
        idle_at: dict[int, int] = {}  # matched tokens -> its idle workers' bits
        busy_at: dict[int, int] = {}  # matched tokens -> how many busy workers
        held = 0
        for blocks, hb in pool.masks:
            m = mt(blocks)
            levels.append((m, hb))
            held |= hb
            idle = hb & idle_all
            n_idle = idle.bit_count()
            if n_idle:  # (a later level of the same length replaces an earlier one's)
                idle_at[m] = idle
            n = hb.bit_count()
            if n_idle < n:
                busy_at[m] = busy_at.get(m, 0) + n - n_idle
        idle0 = idle_all & ~held
        # idle_at[0] is the idle workers that match nothing (their tie order is the tracker's)
        unmatched = bool(idle0)
        if unmatched:
            idle_at[0] = idle0
        busy0 = pool.busy_count() - sum(busy_at.values())
        if busy0 > 0:
            busy_at[0] = busy_at.get(0, 0) + busy0

        # per match length: the request's cost terms, its compute floor (cw x prefill) and
        # base (its own chunked prefill + floor: a busy worker's score minus its queue)
        terms: dict[int, RequestTerms] = {}
        floors: dict[int, float] = {}
        bases: dict[int, float] = {}
        request_terms = cost.request_terms
        for m in (0, *idle_at, *busy_at):
            if m not in terms:
                rt = terms[m] = request_terms(prompt - m)
                f = floors[m] = cw * rt.prefill * scale
                bases[m] = rt.chunked * scale + f
        # queue_weight: the request's own prefill delays the requests that reach its worker
        # while it waits and prefills there (the pool's arrival rate per worker x its TTFT
        # there): a score adds prefill x that count x queue_weight, ``ext[m]`` x its TTFT. It
        # only adds, so the scan's lower bounds (base + queue) still hold
        ext: dict[int, float] | None = None  # None: off, nothing per decision
        qw = self.queue_weight
        if (
            self.warm_queue_weight > qw
            and pool.loads.sent >= self.cold_min_requests
            and pool.loads.reuse() >= self.cold_reuse
        ):
            qw = self.warm_queue_weight  # much reuse: moves cost others their cache
        if qw > 0:
            per_ms = qw * ctx.popularity.total_rate(ctx.now) / (1000.0 * pool.size)
            if per_ms > 0:
                ext = {m: terms[m].prefill * scale * per_ms for m in floors}

        # A LoRA request costs an adapter load where the adapter is not loaded: an idle
        # worker without it is worse than one with it at the same match, so a level keeps
        # only its idle workers with the adapter when it has any.
        missing = pool.adapter_missing
        pen = cost.params.adapter_load_ms * scale if missing else 0.0
        idle_pen: dict[int, float] = {}
        if missing:
            lacking = sum(bits_of.get(w, 0) for w in missing)
            for m, g in idle_at.items():
                have = g & ~lacking
                if have:
                    idle_at[m] = have
                else:
                    idle_pen[m] = pen

        best = float("inf")
        idle_score: dict[int, tuple[float, float]] = {}
        for m in idle_at:
            t = terms[m].own[0] * scale + idle_pen.get(m, 0.0)  # ttft_ms(0, prompt - m, 0, 0)
            sc = t + floors[m] + (ext[m] * t if ext is not None else 0.0)
            idle_score[m] = (sc, t)
            best = min(best, sc)

        # (score, worker, matched tokens, predicted ttft) of every busy worker scored
        scored: list[tuple[float, str, int, float]] = []
        # step_ties: same-match busy workers within that many decode steps tie (see the
        # module docstring); the scan goes that much further so every such worker is scored.
        # When the longest match present has idle workers (and they pay no adapter load),
        # one of them is the best score and the decision goes to that idle group with its
        # near ties: the step window, which widens ties among busy workers only when no idle
        # worker has the top match, cannot apply, so the scan need not reach that far.
        deepest = levels[0][0] if levels else 0  # levels are longest first
        if deepest in idle_at and deepest not in idle_pen:
            steps = 0.0
        else:
            steps = self.step_ties or (self.hot_step_ties if self._hot(request, pool, ctx) else 0.0)
        step = steps * cost.max_decode_step_ms() * scale if steps else 0.0
        # near-tie window of a score: the default's, or a long request's wider one (its wait
        # at the best worker, the best score less the cheapest base, when long_wait_ratio)
        wait_ratio = self.long_wait_ratio
        loads = pool.loads
        if (
            self.cold_wait_ratio > wait_ratio
            and loads.sent >= self.cold_min_requests
            and loads.reuse() < self.cold_reuse
        ):
            wait_ratio = self.cold_wait_ratio  # little reuse to lose by spreading (docstring)
        base_min = 0.0
        if (self.long_tie_ratio or wait_ratio) and self._long(request, pool, deepest):
            tie_ratio = max(tie_ratio, self.long_tie_ratio)
            base_min = min(bases.values())
        else:
            wait_ratio = 0.0

        def tie_width(b: float) -> float:
            w = max(tie_ms, b * tie_ratio)
            return max(w, wait_ratio * (b - base_min)) if wait_ratio else w

        limit = best + tie_width(best)
        reach = limit + step
        if busy_at and not explain:
            # a level whose base plus the lowest bound in the pool is past ``reach`` has no
            # worker that can be scored (bounds only grow along the scan, ``reach`` only
            # shrinks): finished before the scan starts, so its busy holders are not visited
            lowest = next(pool.busy_by_key(), None)
            floor = lowest[0] * scale if lowest is not None else float("inf")
            for m in [m for m in busy_at if bases[m] + floor > reach]:
                del busy_at[m]
        min_base = min((bases[m] for m in busy_at), default=float("inf"))
        scored_at: dict[int, int] = {}
        cap = self.max_scored if not explain else 0
        view = pool.view
        load_terms = cost.load_terms
        overlap = cost.params.decode_overlap
        # Busy workers in (key, worker) order: the pool's, until only levels with few busy
        # holders are left (a conversation's holders, typically), then just theirs, so a
        # scan does not step over the many busy workers of finished levels (see _narrow).
        total = dict(busy_at)
        source = None if explain else _narrow(levels, busy_at, total, idle_all, pool, None)
        if source is None and (busy_at or explain):
            source = pool.busy_by_key()
        while source is not None:
            it, source = source, None
            for entry in it:
                key, w = entry
                bound = key * scale
                if not explain and min_base + bound > reach:
                    break
                m = _level(levels, bits_of[w]) if levels else 0
                left = busy_at.get(m, 0) - 1
                if left < 0:  # this match length is done (all seen, or enough scored)
                    continue
                n = scored_at.get(m, 0) + 1
                scored_at[m] = n
                score = explain or bases[m] + bound <= reach
                if left and n != cap and score:
                    busy_at[m] = left
                else:  # later workers of this length have larger bounds: they could only
                    # tie (cap reached), or cannot be scored at all (past ``reach``)
                    del busy_at[m]
                    min_base = min((bases[x] for x in busy_at), default=float("inf"))
                    if not explain:
                        source = _narrow(levels, busy_at, total, idle_all, pool, entry)
                if score:
                    # cost.ttft_after(own_prefill(prompt - m), queued, running, kv), memoised
                    v = view(w)
                    lt = load_terms(v.queued_prefill_tokens, v.running, v.kv_usage)
                    own = terms[m].own
                    ms = own[0] + lt.queued_ms
                    if v.running > 0:
                        ms += (lt.queued_steps + own[1]) * overlap * lt.decode_ms
                    t = ms * scale
                    if missing and w in missing:
                        t += pen
                    s = t + floors[m] + (ext[m] * t if ext is not None else 0.0)
                    scored.append((s, w, m, t))
                    if s < best:
                        best = s
                        limit = best + tie_width(best)
                        reach = limit + step
                if source is not None:
                    break

        near = [e for e in scored if e[0] <= limit]
        near_idle = [m for m, (s, _) in idle_score.items() if s <= limit]
        top = max([e[2] for e in near] + near_idle)
        ties = [e[1] for e in near if e[2] == top]
        group = 0  # idle workers tied with ``ties``
        if top in near_idle:
            group = idle_at[top]
        elif steps:  # an idle engine starts at once: only busy ones have a phase
            at_top = [e for e in scored if e[2] == top]
            first = min(at_top)
            window = (
                first[0]
                + max(tie_ms, first[0] * tie_ratio)
                + steps * (cost.decode_step_ms(pool.view(first[1]).kv_usage) * scale)
            )
            ties = [e[1] for e in at_top if e[0] <= window]
        pick = self._tie_break(ties, group, top == 0 and unmatched, pool, ctx)
        if group and pick not in ties:
            matched, ttft = top, idle_score[top][1]
        else:
            _, _, matched, ttft = next(e for e in scored if e[1] == pick)
        best_match = mt(pool.masks[0][0]) if pool.masks else 0
        replicate = self.replication and request.adapter is None  # adapters: not modelled
        replica = self._replica(request, pool, ctx, pick, ttft) if replicate else None
        if replica is not None:
            pick, matched = replica, _level(levels, bits_of[replica])
            v = pool.view(replica)
            ttft = cost.ttft_ms(v.queued_prefill_tokens, prompt - matched, v.running, v.kv_usage)
            return Decision(pick, self.name, "replicate", matched, ttft, ())
        if pool.size == 1:
            reason = "single"
        elif best_match == 0:
            reason = "cold"
        elif matched >= best_match:
            reason = "cache"
        else:
            reason = "balance"
        cands: tuple[CandidateScore, ...] = ()
        if explain:
            for m, g in idle_at.items():
                ws = _group_names(pool, g, m == 0 and unmatched)
                scored.extend((idle_score[m][0], w, m, idle_score[m][1]) for w in ws)
            cands = tuple(CandidateScore(w, m, t, s) for s, w, m, t in scored)
        return Decision(pick, self.name, reason, matched, ttft, cands)

    @staticmethod
    def _tie_break(
        ties: list[str], group: int, unmatched: bool, pool: PoolView, ctx: PolicyContext
    ) -> str:
        """Among equally good workers (busy ``ties`` and the idle ``group``), the one that has
        waited longest for a request; a coin toss among those never sent one. Round robin
        among equals spaces each worker's arrivals evenly, which queues less than independent
        random picks.

        The idle group is a bit set. When it has members never sent a request, they (and any
        busy tie never sent one) are the candidates: one draw picks an index into the busy
        ties, then the group's never-sent bit set by increasing bit (``LoadTracker.nth``), so
        nothing lists the hundreds of workers a large pool leaves unsent at first. Otherwise
        its longest-waiting member is found from the tracker's idle workers in waiting order,
        and only when several candidates share the oldest time is the list drawn from built
        (busy ties in scan order, then the group: the tracker's idle order for workers
        matching nothing, else by bit). A draw consumes the generator exactly as
        ``rng.choice`` over that list does; the never-sent draw picks the same worker as the
        list would except among workers matching nothing (bit order, not the tracker's idle
        order: the same candidates, each as likely)."""
        n_group = group.bit_count()
        if len(ties) + n_group == 1:
            return ties[0] if ties else pool.loads.names(group)[0]
        loads = pool.loads
        sent_of = loads.last_sent_map().get
        inf = float("-inf")
        sent = list(map(sent_of, ties, repeat(inf)))
        oldest = min(sent, default=float("inf"))
        first: list[str] = [w for w, t in zip(ties, sent, strict=True) if t == oldest]
        unsent = group & loads.unsent_bits()
        if unsent:  # never sent: as old as it gets
            if oldest != inf:
                first = []
            k = ctx.rng.randrange(len(first) + unsent.bit_count())  # = rng.choice's draw
            return first[k] if k < len(first) else loads.nth(unsent, k - len(first))
        if group:
            g_oldest, g_first = _oldest_idle(pool, group, n_group)
            if g_oldest < oldest:
                oldest, first = g_oldest, g_first
            elif g_oldest == oldest:
                first = first + g_first
        if len(first) > 1:  # several waited equally long: draw in the established order
            members = _group_names(pool, group, unmatched) if group else []
            first = [w for w in ties if sent_of(w, inf) == oldest] + [
                w for w in members if sent_of(w, inf) == oldest
            ]
        return ctx.rng.choice(first)

    def _replica(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, pick: str, ttft: float
    ) -> str | None:
        """Grow a hot prefix's holder set if its demand warrants more holders than it has.

        With ``warmup``, once a holder has computed the prefix, the new holder is asked for
        in ``ctx.warmups`` and None is returned (the request goes to ``pick``); at the
        onset, or without ``warmup``, the non-holder is returned to receive this request
        cold, and only while ``pick`` is busy. Either way, while ``pick`` is still
        prefilling the prefix (``_spill``) the request itself goes to a non-holder when
        that is no slower (``ttft``: ``pick``'s prediction)."""
        if not pool.masks:
            return None
        depth, held = pool.masks[0]
        if not held & pool.loads.bit(pick) or depth > len(request.keys):
            return None
        v = pool.view(pick)
        if not self.warmup and v.idle:
            return None
        queued = v.queued_prefill_tokens
        key = request.keys[depth - 1]
        now = ctx.now
        pop = ctx.popularity
        tokens = request.matched_tokens(depth)
        # this request and the recent ones (decayed: half a request of slack)
        burst = pop.weight(key, now) + 1.5 < self.min_requests  # not sustained demand
        if burst and queued < tokens:  # and no onset to spill either (``_spill``'s first test)
            return None
        holders = pool.levels[0][1]
        cost = ctx.cost
        prefill = cost.chunked_prefill_ms(tokens) * cost.scale
        book = ctx.warmups
        warming = book.pending(key, holders, now) if self.warmup else []
        have = len(holders) + len(warming)
        spill = self._spill(request, pool, ctx, pick, ttft, tokens, prefill, key, have)
        if spill is not None:
            return spill
        if burst:
            return None
        need = holders_needed(pop.rate(key, now), prefill, len(pool.workers), self.replication)
        if have >= need:  # enough holders for the demand's compute; an idle one, though?
            if self.warm_idle:
                target = self._idle_newcomer(pool, ctx, v.idle, warming)
                if target is not None and not self._none_computed(pool, ctx, pool.masks[0][1], key):
                    book.want(WarmupIntent(target, key, depth, tokens, now))
            return None
        target = self._newcomer(pool, ctx, pick, {*holders, *warming})
        if target is None:
            return None
        if self.warmup and not self._none_computed(pool, ctx, pool.masks[0][1], key):
            book.want(WarmupIntent(target, key, depth, tokens, now))
            return None
        # No warm-up at the prefix's onset (no holder has computed it yet): the warm-up
        # would compute it a second time beside the holder's prefill, serving no request,
        # and on a busy engine the requests the index then sends there (its speculative
        # entry) are admitted while it is still being chunked and compute it again. This
        # request goes there cold instead, as round robin would send it (and as without
        # warm-ups), if ``pick`` is busy (an idle holder serves it at once).
        return None if v.idle else target

    def _idle_newcomer(
        self, pool: PoolView, ctx: PolicyContext, pick_idle: bool, warming: list[str]
    ) -> str | None:
        """An idle worker to warm with the longest match's prefix although its demand's
        compute needs no more holders (``warm_idle``): in a cold pool (recent reuse below
        ``cold_reuse``), when every holder is busy (``pick`` too) and some worker is idle
        without the prefix and not being warmed with it; one at random. None otherwise.

        Each request then pays a busy holder's decode steps riding along its prefill (and
        the wait for the step under way) rather than recompute the prefix on an idle
        worker, which costs more, so the idle workers are never sent anything: the prefix's
        compute is what ``holders_needed`` counts, and a short one warrants one holder."""
        if not self.warmup or pick_idle:
            return None
        idle = pool.idle_bits
        held = pool.masks[0][1]
        if not idle or idle & held or pool.loads.reuse() >= self.cold_reuse:
            return None
        free = idle & ~held
        if free and warming:
            bits_of = pool.loads.bits()
            for w in warming:
                free &= ~bits_of.get(w, 0)
        if not free:
            return None
        return pool.loads.nth(free, ctx.rng.randrange(free.bit_count()))

    def _long(self, request: RouteRequest, pool: PoolView, deepest: int) -> bool:
        """Whether the request is long for this pool: its uncached tokens at its longest
        match are at least ``long_factor`` x the mean of the requests sent recently
        (``LoadTracker.mean_prompt_tokens``), so the rule needs no model-specific constant."""
        new = request.prompt_tokens - deepest
        return new > 0 and new >= self.long_factor * pool.loads.mean_prompt_tokens

    def _hot(self, request: RouteRequest, pool: PoolView, ctx: PolicyContext) -> bool:
        """Whether the longest match is a prefix replicated for its demand: held by several
        workers and arriving fast enough to warrant several (``holders_needed`` >= 2).
        Its requests are alike (the prefix dominates them), so among its busy holders a few
        milliseconds of predicted queue are the engines' step phase, not load:
        ``hot_step_ties`` applies there. A conversation's prefix (one holder) and a system
        prompt whose share warrants one holder keep the exact comparison."""
        if not self.hot_step_ties or not self.replication or not pool.masks:
            return False
        depth, bits = pool.masks[0]
        if bits.bit_count() < 2 or depth > len(request.keys):
            return False
        cost = ctx.cost
        rate = ctx.popularity.rate(request.keys[depth - 1], ctx.now)
        prefill = cost.chunked_prefill_ms(request.matched_tokens(depth)) * cost.scale
        return holders_needed(rate, prefill, pool.size, self.replication) >= 2

    def _spill(
        self,
        request: RouteRequest,
        pool: PoolView,
        ctx: PolicyContext,
        pick: str,
        ttft: float,
        tokens: int,
        prefill: float,
        key: int,
        have: int,
    ) -> str | None:
        """A non-holder to send this request to cold, at the onset of a hot prefix.

        While the prefix's holder is still prefilling it (the index's match is speculative
        and its queue holds at least the prefix), a request arriving there waits for that
        prefill, then its own step: no faster than a cold prefill on an idle worker, which
        round robin would have started at once. If the demand counting this request
        warrants another holder, the request goes cold to a non-holder (an idle one at
        random, else the least loaded busy one) when its predicted TTFT there is no worse
        than at ``pick``: that request loses nothing and the new holder starts a warm-up's
        worth earlier. A burst of siblings of a short prefix (demand for one holder) and a
        conversation's next turn (its prefix computed, or its previous turn still queued on
        ``pick``: ``next_turns``) stay where they are."""
        if pool.view(pick).queued_prefill_tokens < tokens:
            return None
        if ctx.computed is not None and ctx.computed(pick, key):  # the prefix is there
            return None
        if self.next_turns and ctx.continues is not None and not ctx.continues(pick, key):
            return None  # the holder's chain ends at the match: a next turn, not a sibling
        pop = ctx.popularity
        size = len(pool.workers)
        # the prefix's demand counted from the request that put it on ``pick`` (its
        # speculative attribution), not from its first match: a conversation's next turn
        # sent while its previous one still waits in ``pick``'s queue (open-loop traffic past
        # capacity) is one request since then, not a burst
        since = ctx.speculated_at(pick, key) if ctx.speculated_at is not None else None
        rate = pop.rate(key, ctx.now, plus=1.0, since=since)
        need = holders_needed(rate, prefill, size, self.replication)
        held = pool.masks[0][1]
        if need <= have and self._none_computed(pool, ctx, held, key):
            # every holder is still computing the prefix, so its prefill has lasted at
            # least since the prefix was first seen: the requests seen since (and this one)
            # arrived within one prefill, each a holder's worth of demand, whatever the cost
            # model (uncalibrated at first) says the prefill costs. With ``onset_siblings``
            # so did the request being prefilled, when this one shares only a prefix of its
            # prompt (a sibling: the holder's chain goes on past the match), not all of it
            # (a next turn)
            seen = pop.weight(key, ctx.now) + 1.0
            if self.onset_siblings and ctx.continues is not None and ctx.continues(pick, key):
                seen += 1.0
            need = min(size, math.ceil(seen - 1e-9))
        if need <= have:
            return None
        free = pool.idle_bits & ~held
        target: str | None
        if free:
            names = pool.loads.names(free)
            target = names[0] if len(names) == 1 else ctx.rng.choice(names)
        else:  # the least loaded busy non-holder (the first few in load order)
            bits = pool.loads.bits()
            busy = islice(pool.busy_by_key(), _SPILL_SCAN)
            target = next((w for _, w in busy if not bits[w] & held), None)
            if target is None:
                return None
        bit = pool.loads.bit(target)
        blocks = next((n for n, hb in pool.masks if hb & bit), 0)
        v = pool.view(target)
        new = request.prompt_tokens - request.matched_tokens(blocks)
        cold = ctx.cost.ttft_ms(v.queued_prefill_tokens, new, v.running, v.kv_usage)
        return target if cold <= ttft else None

    @staticmethod
    def _none_computed(pool: PoolView, ctx: PolicyContext, held: int, key: int) -> bool:
        """Whether no holder in ``held`` has the prefix ending with ``key`` computed (the
        index's matches are all speculative); False when unknown or too many to ask."""
        computed = ctx.computed
        if computed is None or held.bit_count() > _SPILL_SCAN:
            return False
        return not any(computed(w, key) for w in pool.loads.names(held))

    @staticmethod
    def _newcomer(pool: PoolView, ctx: PolicyContext, pick: str, taken: set[str]) -> str | None:
        """The worker to become a new holder: an idle non-holder at random, else the least
        loaded busy non-holder if it is lighter than ``pick`` (a shorter predicted wait:
        a few decoding sequences weigh less than a long prefill queued)."""
        idle = [w for w in pool.idle() if w not in taken]
        if idle:
            return ctx.rng.choice(idle)
        cost = ctx.cost
        busy = pool.view(pick)
        mine = cost.ttft_ms(busy.queued_prefill_tokens, 1, busy.running, busy.kv_usage)
        for _, w in pool.busy_by_key():
            if w not in taken:
                v = pool.view(w)
                wait = cost.ttft_ms(v.queued_prefill_tokens, 1, v.running, v.kv_usage)
                return w if wait < mine else None
        return None


#: busy workers looked at for a non-holder to spill a hot prefix's onset to
_SPILL_SCAN = 16

#: busy holders left in the unfinished levels below which a scan visits only them
_NARROW = 64


def _narrow(
    levels: list[tuple[int, int]],
    busy_at: dict[int, int],
    total: dict[int, int],
    idle_all: int,
    pool: PoolView,
    after: tuple[float, str] | None,
) -> Iterator[tuple[float, str]] | None:
    """The busy holders of the unfinished levels past ``after``, in the pool's busy order:
    what the scan would visit next, without the workers of finished levels in between
    (skipped anyway). None while the workers matching nothing are unfinished (their set is
    the rest of the pool) or the unfinished levels hold more than ``_NARROW`` busy workers."""
    if not busy_at or 0 in busy_at or sum(total[m] for m in busy_at) > _NARROW:
        return None
    bits = 0
    for m, hb in levels:
        if m in busy_at:
            bits |= hb
    entry = pool.loads.busy_entry
    rest = [e for e in map(entry, pool.loads.names(bits & ~idle_all)) if e is not None]
    if after is not None:
        rest = [e for e in rest if e > after]
    rest.sort()
    return iter(rest)


def _level(levels: list[tuple[int, int]], bit: int) -> int:
    """The matched tokens of the worker with ``bit`` (0: it matches nothing)."""
    for m, hb in levels:
        if hb & bit:
            return m
    return 0


def _group_names(pool: PoolView, group: int, unmatched: bool) -> list[str]:
    """An idle group's workers in their tie order: the tracker's idle order for the workers
    that match nothing, by bit (the index's slot order) for a level's holders."""
    if not unmatched:
        return pool.loads.names(group)
    members = set(pool.loads.names(group))  # a set: a probe per idle worker, not a bit test
    return [w for w in pool.loads.idle_workers() if w in members]


#: idle groups up to this size are decoded to find their oldest member; larger ones are
#: found by walking the idle workers in waiting order (a member turns up within about
#: idle / group steps)
_DECODE_GROUP = 16


def _oldest_idle(pool: PoolView, group: int, n_group: int) -> tuple[float, list[str]]:
    """The earliest last send among the idle workers of ``group``, and those members that
    have it (in no particular order)."""
    loads = pool.loads
    if n_group <= _DECODE_GROUP:
        sent_of = loads.last_sent_map().get
        ws = loads.names(group)
        sent = [sent_of(w, float("-inf")) for w in ws]
        oldest = min(sent)
        return oldest, [w for w, t in zip(ws, sent, strict=True) if t == oldest]
    bits_of = loads.bits()
    found: list[str] = []
    oldest = float("inf")
    for t, w in loads.idle_by_age():
        if found and t != oldest:
            break
        if bits_of[w] & group:
            oldest = t
            found.append(w)
    return oldest, found


register(PredictedTTFT)
