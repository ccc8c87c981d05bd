"""Routing policies and the router: each behaves as named."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.contract.wire import EngineReport
from gateway.routing.adapters import AdapterCatalog
from gateway.routing.costmodel import CostModel, CostParams
from gateway.routing.keys import BlockKeyer
from gateway.routing.load import LoadTracker
from gateway.routing.policy import PolicyContext, PoolView, RouteRequest, make_policy, policy_names
from gateway.routing.popularity import PrefixPopularity
from gateway.routing.router import NoCandidates, Router

BS = 16
KEYER = BlockKeyer("policy-tests", BS)
WORKERS = [f"w{i}" for i in range(4)]


def prompt(seed: int, n_tokens: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    toks = [rng.randrange(100_000) for _ in range(n_tokens)]
    return toks, KEYER.keys(toks)


def router(policy: str = "ttft", seed: int = 0, **kw: object) -> Router:
    r = Router(make_policy(policy, **kw), BS, rng=random.Random(seed))
    for w in WORKERS:
        r.add_worker(w)
    return r


def pool(matches: dict[str, int] | None = None, queued: dict[str, float] | None = None) -> PoolView:
    loads = LoadTracker()
    for w in WORKERS:
        loads.add_worker(w)
    for w, q in (queued or {}).items():
        loads.started(w, int(q), now=0.0)
    return PoolView.from_matches(loads, matches or {})


def pick(
    policy_name: str,
    n: int,
    request: RouteRequest | None = None,
    p: PoolView | None = None,
    seed: int = 0,
) -> list[str]:
    pol = make_policy(policy_name)
    ctx = PolicyContext(rng=random.Random(seed))
    req = request or RouteRequest([], 100, BS)
    return [pol.choose(req, p or pool(), ctx).worker for _ in range(n)]


def test_registry_lists_every_policy_and_rejects_unknown() -> None:
    assert set(policy_names()) >= {
        "ttft",
        "round_robin",
        "random",
        "least_load",
        "session",
        "prefix",
        "cache_aware",
    }
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="bad parameters"):
        make_policy("ttft", bogus=1)


def test_round_robin_cycles_in_order() -> None:
    assert pick("round_robin", 8) == WORKERS * 2


def test_random_uses_every_worker_evenly() -> None:
    counts = Counter(pick("random", 4000, seed=7))
    assert set(counts) == set(WORKERS)
    assert all(800 < n < 1200 for n in counts.values()), counts


def test_least_load_never_picks_the_busier_of_its_two_samples() -> None:
    p = pool(queued={w: 0 for w in []})
    for i, w in enumerate(WORKERS):
        for _ in range(i * 10):
            p.loads.started(w, 10, now=0.0)
    counts = Counter(pick("least_load", 600, p=p, seed=1))
    assert "w3" not in counts  # the busiest loses every pair it is drawn in
    assert counts["w0"] > counts["w1"] > counts["w2"]


def test_session_is_sticky_and_consistent() -> None:
    pol = make_policy("session")
    ctx = PolicyContext()
    full = pool()
    first = {s: pol.choose(RouteRequest([], 1, BS, f"s{s}"), full, ctx).worker for s in range(200)}
    assert set(first.values()) == set(WORKERS)
    again = {s: pol.choose(RouteRequest([], 1, BS, f"s{s}"), full, ctx).worker for s in range(200)}
    assert again == first
    # w3 excluded: only its sessions move
    three = PoolView.from_levels(full.loads, [], frozenset({"w3"}))
    moved = {
        s
        for s in range(200)
        if pol.choose(RouteRequest([], 1, BS, f"s{s}"), three, ctx).worker != first[s]
    }
    assert moved == {s for s, w in first.items() if w == "w3"}
    # no session key: the prompt's first blocks decide
    _, keys = prompt(1, 256)
    picks = {pol.choose(RouteRequest(keys, 256, BS), full, ctx).worker for _ in range(5)}
    assert len(picks) == 1


def test_prefix_policy_ignores_load() -> None:
    p = pool(matches={"w2": 10, "w1": 3}, queued={"w2": 10**9})
    d = make_policy("prefix").choose(RouteRequest([], 1000, BS), p, PolicyContext())
    assert d.worker == "w2" and d.reason == "cache" and d.matched_tokens == 160


def test_cache_aware_follows_smgs_rule() -> None:
    """SGLang's / smg's cache_aware: balance first (in-flight requests, absolute and relative
    thresholds both exceeded), then the longest match above the cache threshold, else the
    least-loaded worker."""

    def inflight(counts: dict[str, int], matches: dict[str, int]) -> PoolView:
        p = pool(matches=matches)
        for w, n in counts.items():
            for _ in range(n):
                p.loads.started(w, 1, now=0.0)
        return p

    pol = make_policy("cache_aware", balance_abs=4, balance_rel=1.5)
    ctx = PolicyContext(rng=random.Random(0))
    req = RouteRequest([], 1000, BS)  # 62 blocks: a match of 19+ blocks is above 0.3
    # balanced, a match above the threshold: the holder, however busy within the bounds
    d = pol.choose(req, inflight({"w2": 4}, {"w2": 40}), ctx)
    assert (d.worker, d.reason, d.matched_tokens) == ("w2", "cache", 640)
    # a match at or below 0.3 of the prompt: the least-loaded worker (w3: none in flight)
    d = pol.choose(req, inflight({"w0": 1, "w1": 1, "w2": 1}, {"w2": 18}), ctx)
    assert (d.worker, d.reason) == ("w3", "cold")
    # imbalanced past both thresholds (5 - 0 > 4 and 5 > 0 x 1.5): cache ignored
    d = pol.choose(req, inflight({"w2": 5, "w0": 1, "w1": 1}, {"w2": 40}), ctx)
    assert (d.worker, d.reason) == ("w3", "balance")
    # past the absolute threshold only (10 - 5 > 4, but 10 < 5 x 2.5): still the holder
    rel = make_policy("cache_aware", balance_abs=4, balance_rel=2.5)
    counts = {"w0": 5, "w1": 5, "w2": 10, "w3": 5}
    d = rel.choose(req, inflight(counts, {"w2": 40}), ctx)
    assert (d.worker, d.reason) == ("w2", "cache")
    with pytest.raises(ValueError, match="cache_threshold must be"):
        make_policy("cache_aware", cache_threshold=1.5)


def test_ttft_follows_longest_prefix_when_loads_are_equal() -> None:
    r = router()
    toks, keys = prompt(1, 4096)
    r.index.stored("w1", None, keys[:100])
    r.index.stored("w2", None, keys[:200])
    r.index.stored("w3", None, keys[:50])
    d = r.route(keys, len(toks), now=0.0, explain=True)
    assert d.worker == "w2" and d.reason == "cache" and d.matched_tokens == 200 * BS
    by_worker = {c.worker: c for c in d.candidates}
    assert by_worker["w1"].matched_tokens == 1600 and by_worker["w0"].matched_tokens == 0
    assert (
        by_worker["w2"].predicted_ttft_ms
        < by_worker["w1"].predicted_ttft_ms
        < by_worker["w0"].predicted_ttft_ms
    )


def test_ttft_spreads_a_hot_prefix_when_its_holder_is_saturated() -> None:
    r = router()
    toks, keys = prompt(2, 6000)
    r.index.stored("w0", None, keys)
    # the holder has a long prefill queue: 20 requests' worth of uncached work
    for _ in range(20):
        r.loads.started("w0", 6000, now=0.0)
    d = r.route(keys, len(toks), now=0.0)
    assert d.worker != "w0" and d.reason == "balance"
    # with a short queue the holder keeps the traffic
    r2 = router()
    r2.index.stored("w0", None, keys)
    r2.loads.started("w0", 200, now=0.0)
    assert r2.route(keys, len(toks), now=0.0).worker == "w0"


def test_ttft_uses_idle_workers_at_low_concurrency_and_breaks_ties_at_random() -> None:
    # Q5: fewer requests in flight than workers; each cold request goes to an idle worker
    used: Counter[str] = Counter()
    for seed in range(30):
        r = router(seed=seed)
        tickets = []
        for i in range(3):  # 3 in flight < 4 workers
            toks, keys = prompt(1000 * seed + i, 512)
            d = r.route(keys, len(toks), now=0.0)
            tickets.append(r.started(d, len(toks), now=0.0))
        busy = [t.decision.worker for t in tickets]
        assert len(set(busy)) == 3, busy  # never two on one worker while one sits idle
        used.update(busy)
    assert set(used) == set(WORKERS)  # ties at random: no worker always left out (or always first)


def test_speculation_keeps_a_burst_on_one_worker_until_real_events() -> None:
    """Siblings of a new 4,000-token prefix at once: the second joins the first (one
    holder carries that demand). From the third the burst's rate warrants a second holder
    while the first is still computing the prefix, so, like round robin, the rest go cold
    to idle workers where they are predicted no slower (reason ``replicate``)."""
    r = router(seed=3)
    base, _ = prompt(5, 4000)
    picks = []
    for i in range(4):
        toks = base + prompt(100 + i, 32)[0]
        keys = KEYER.keys(toks)
        d = r.route(keys, len(toks), now=0.0)
        r.started(d, len(toks), now=0.0)
        picks.append((d.worker, d.reason))
    assert picks[0][0] == picks[1][0] and picks[1][1] == "cache", picks
    assert [reason for _, reason in picks[2:]] == ["replicate", "replicate"], picks
    assert len({w for w, _ in picks}) == 3, picks
    # after the TTL the speculative attribution is gone
    toks = base + prompt(999, 32)[0]
    assert r.index.match(KEYER.keys(toks)) != {}
    r.tick(10.0)
    assert r.index.match(KEYER.keys(toks)) == {}


def test_router_needs_candidates_and_dry_run_leaves_no_trace() -> None:
    r = router()
    toks, keys = prompt(3, 320)
    with pytest.raises(NoCandidates):
        r.route(keys, len(toks), now=0.0, exclude=WORKERS)
    r.route(keys, len(toks), now=0.0, dry_run=True)
    assert r.index.match(keys) == {}


def test_inflight_accounting_and_engine_reports() -> None:
    loads = LoadTracker(mean_prompt_tokens=1000, report_ttl=5.0)
    rid = loads.started("w0", 500, now=0.0)
    assert loads.view("w0").queued_prefill_tokens == 500
    assert loads.mean_prompt_tokens == 500  # learnt from what is sent
    assert loads.first_token(rid) and not loads.first_token(rid)
    v = loads.view("w0")
    assert v.queued_prefill_tokens == 0 and v.running == 1
    loads.finished(rid)
    assert loads.view("w0").idle and loads.idle_workers() == ["w0"]
    # another replica's traffic shows up through the engine report
    loads.report("w0", EngineReport(running=4, waiting=3, kv_usage=0.5), now=1.0)
    v = loads.view("w0")
    assert v.queued_prefill_tokens == 1500 and v.running == 7 and v.kv_usage == 0.5
    assert list(loads.busy_by_key()) == [(1500.0, "w0")]
    # our requests sent after the report count until they are served, not longer
    r2 = loads.started("w0", 500, now=1.5)
    assert loads.view("w0").queued_prefill_tokens == 2000
    loads.first_token(r2)
    assert loads.view("w0").queued_prefill_tokens == 1500 and loads.view("w0").running == 8
    loads.finished(r2)
    assert loads.view("w0").running == 7
    # our requests the report counted leave its figures as soon as they are served
    r3 = loads.started("w0", 500, now=2.0)
    loads.report("w0", EngineReport(running=0, waiting=1, kv_usage=0.1), now=2.1)
    assert loads.view("w0").queued_prefill_tokens == 500 and loads.view("w0").running == 1
    loads.first_token(r3)
    loads.finished(r3)
    assert loads.view("w0").idle, loads.view("w0")
    # a stale report stops counting
    loads.report("w0", EngineReport(running=2, waiting=0, kv_usage=0.1), now=3.0)
    assert not loads.view("w0").idle
    loads.refresh(100.0)
    assert loads.view("w0").idle
    loads.check_invariants()


def test_cost_model_shape_and_calibration() -> None:
    cm = CostModel()
    assert cm.prefill_ms(6144) > 5 * cm.prefill_ms(64)
    assert cm.ttft_ms(0, 6144, 0, 0) > cm.ttft_ms(0, 64, 0, 0)
    assert cm.ttft_ms(50_000, 64, 0, 0) > cm.ttft_ms(0, 6144, 0, 0)
    assert cm.ttft_ms(0, 64, 32, 0.9) > cm.ttft_ms(0, 64, 0, 0.9)
    # online calibration: the truth is 2x slower -> predictions converge to it
    cm2 = CostModel(CostParams())
    for _ in range(200):
        pred = cm2.ttft_ms(0, 2048, 0, 0)
        cm2.observe(pred, 2.0 * pred / cm2.scale)
    assert abs(cm2.scale - 2.0) < 0.05
    cm2.observe(10.0, float("nan"))
    assert abs(cm2.scale - 2.0) < 0.05
    # the longest decode step bounds every KV usage (concave and convex shapes)
    for d2 in (-25.74, -60.0, 10.0):
        cm3 = CostModel(CostParams(decode_d2=d2))
        grid = max(cm3.decode_step_ms(u / 100) for u in range(101))
        assert grid <= cm3.max_decode_step_ms() <= grid + 0.05


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 20_000), st.booleans(), st.integers(0, 8000)),
        max_size=25,
    ),
    st.dictionaries(st.sampled_from(WORKERS), st.integers(1, 400), max_size=4),
    st.integers(1, 8192),
    st.integers(0, 2**32),
)
@pytest.mark.parametrize(
    ("step_ties", "long_tie_ratio", "long_wait_ratio", "cold_wait_ratio", "queue_weights"),
    [
        (0.0, 0.0, 0.0, 3.0, (0.0, 0.0)),  # the default: the cold pool's window
        (0.0, 0.0, 0.0, 3.0, (0.0, 0.3)),  # and the warm pool's queue weight
        (0.0, 0.0, 0.0, 0.0, (0.0, 0.0)),
        (1.0, 0.0, 0.0, 0.0, (0.0, 0.0)),
        (1.0, 0.0, 0.0, 3.0, (0.0, 0.3)),
        (0.0, 0.5, 0.0, 0.0, (0.0, 0.0)),
        (0.0, 0.0, 3.0, 0.0, (0.0, 0.0)),
        (0.0, 0.0, 2.0, 6.0, (0.0, 0.0)),
        (0.0, 0.0, 0.0, 3.0, (1.0, 0.0)),
        (1.0, 0.5, 0.0, 0.0, (0.3, 1.0)),
    ],
)
def test_pruned_ttft_search_agrees_with_scoring_everyone(
    step_ties: float,
    long_tie_ratio: float,
    long_wait_ratio: float,
    cold_wait_ratio: float,
    queue_weights: tuple[float, float],
    ops: list[tuple[int, int, bool, int]],
    matches: dict[str, int],
    prompt_tokens: int,
    seed: int,
) -> None:
    """The policy visits a few workers; the result must equal a full scan's minimum."""
    loads = LoadTracker(order_key=CostModel().queue_key)
    for w in WORKERS:
        loads.add_worker(w)
    rids = []
    for wi, tokens, first, cached in ops:  # cached: the pool's reuse, above or below 0.3
        rid = loads.started(WORKERS[wi], tokens, now=0.0, cached_tokens=cached)
        rids.append(rid)
        if first:
            loads.first_token(rid)
    loads.check_invariants()
    pol = make_policy(
        "ttft",
        step_ties=step_ties,
        long_tie_ratio=long_tie_ratio,
        long_wait_ratio=long_wait_ratio,
        cold_wait_ratio=cold_wait_ratio,
        cold_min_requests=0,  # the gate on the reuse of however few requests were drawn
        queue_weight=queue_weights[0],
        warm_queue_weight=queue_weights[1],
    )
    req = RouteRequest([], prompt_tokens, BS)
    pop = PrefixPopularity()
    for i in range(seed % 200):  # up to 20 requests/s over the last 10 s
        pop.observe_request(i / 20.0)
    ratio = pol.tie_ratio
    wait_ratio = 0.0
    new = prompt_tokens - max((req.matched_tokens(b) for b in matches.values()), default=0)
    if new > 0 and new >= loads.mean_prompt_tokens:  # a long request: the wider windows
        ratio = max(ratio, long_tie_ratio)
        wait_ratio = long_wait_ratio
        if loads.reuse() < 0.3:  # a cold pool: cold_wait_ratio, if wider
            wait_ratio = max(wait_ratio, cold_wait_ratio)
    # its own prefill (with the compute floor) at the deepest match: a score less that is
    # the wait before it at that worker
    rt = CostModel().request_terms(new)
    own = rt.chunked + pol.compute_weight * rt.prefill
    fast = pol.choose(
        req,
        PoolView.from_matches(loads, matches),
        PolicyContext(rng=random.Random(seed), popularity=pop, now=10.0),
    )
    full = pol.choose(
        req,
        PoolView.from_matches(loads, matches),
        PolicyContext(rng=random.Random(seed), popularity=pop, now=10.0),
        explain=True,
    )
    best = min(c.score for c in full.candidates)
    limit = best + max(pol.tie_ms, best * ratio, wait_ratio * (best - own))
    near = [c for c in full.candidates if c.score <= limit]
    top = max(c.matched_tokens for c in near)
    allowed = {c.worker for c in near if c.matched_tokens == top}
    idle = {w for w in WORKERS if loads.view(w).idle}
    if step_ties and not allowed & idle:  # busy workers of that match within the steps
        at_top = [c for c in full.candidates if c.matched_tokens == top]
        first = min(at_top, key=lambda c: c.score)
        step = step_ties * CostModel().decode_step_ms(loads.view(first.worker).kv_usage)
        window = first.score + max(pol.tie_ms, first.score * ratio) + step
        allowed = {c.worker for c in at_top if c.score <= window}
    assert fast.worker in allowed
    assert fast.matched_tokens == req.matched_tokens(matches.get(fast.worker, 0))


def test_prefix_popularity_decays_and_stays_bounded() -> None:
    from gateway.routing.popularity import PrefixPopularity

    pop = PrefixPopularity(half_life=10.0)
    for i in range(30):
        pop.observe(1, float(i))
        if i % 3 == 0:
            pop.observe(2, float(i))
    assert 0.7 < pop.share(1, 30.0) < 0.8 and 0.2 < pop.share(2, 30.0) < 0.3
    assert pop.weight(1, 40.0) == pytest.approx(pop.weight(1, 30.0) / 2)
    assert pop.share(99, 30.0) == 0.0
    for k in range(5000):  # one-off prefixes are forgotten as they decay: memory bounded
        pop.observe(1000 + k, 30.0 + k)
    assert len(pop) < 2100


def test_ttft_replicates_a_hot_prefix_to_every_worker() -> None:
    """Without warm-ups, a hot prefix spills cold (reason ``replicate``): 10 req/s of a
    6,000-token prefix (~122 ms cold) at ``replication`` 4 warrant all four workers."""
    r = router(seed=5, warmup=False, replication=4.0)
    base, _ = prompt(7, 6000)
    reasons: Counter[str] = Counter()
    holders: set[str] = set()
    for i in range(60):
        toks = base + prompt(1000 + i, 64)[0]
        d = r.route(KEYER.keys(toks), len(toks), now=i * 0.1)
        t = r.started(d, len(toks), now=i * 0.1)
        reasons[d.reason] += 1
        holders.add(d.worker)
        if i % 2:  # keep a few in flight so holders are busy
            r.first_token(t, now=i * 0.1)
            r.finished(t, now=i * 0.1)
    assert holders == set(WORKERS)
    assert reasons["replicate"] == len(WORKERS) - 1  # one cold prefill per extra holder, no more


def test_a_sustained_hot_prefix_starts_a_second_holder_at_its_second_request() -> None:
    """A steady stream (20 req/s) of one new 6,000-token prefix: the second request arrives
    while the first holder is still prefilling it and is no slower cold on an idle worker,
    so it starts a second holder at once, as round robin would (before, the first few
    stayed with the first holder and the 7th started the second: a backlog behind the
    first prefill). (Spilling cold: warm-ups off.)"""
    r = router(seed=5, warmup=False)
    base, _ = prompt(8, 6000)
    picks = []
    for i in range(8):
        toks = base + prompt(2000 + i, 64)[0]
        d = r.route(KEYER.keys(toks), len(toks), now=i * 0.05)
        r.started(d, len(toks), now=i * 0.05)  # all in flight: the holder stays busy
        picks.append((d.worker, d.reason))
    first = next(i for i, (_, reason) in enumerate(picks) if reason == "replicate")
    assert first == 1, picks
    assert picks[1][0] != picks[0][0], picks


def test_step_ties_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="step_ties"):
        make_policy("ttft", step_ties=-1)
    with pytest.raises(ValueError, match="hot_step_ties"):
        make_policy("ttft", hot_step_ties=-1)


def test_a_conversations_own_prefix_is_never_replicated() -> None:
    r = router(seed=6)
    reasons: Counter[str] = Counter()
    for conv in range(40):  # many conversations, each its own prefix, each a small share
        msgs, _ = prompt(conv, 2000)
        for turn in range(4):
            msgs = msgs + prompt(100 * conv + turn, 64)[0]
            d = r.route(KEYER.keys(msgs), len(msgs), now=conv + turn * 0.01)
            t = r.started(d, len(msgs), now=conv + turn * 0.01)
            reasons[d.reason] += 1
            if turn % 2:
                r.first_token(t, now=conv)
    assert reasons["replicate"] == 0


def test_equal_workers_take_turns() -> None:
    """Ties go to the worker that waited longest: cold requests to idle workers cycle."""
    r = router(seed=9)
    picks = []
    for i in range(8):
        toks, keys = prompt(5000 + i, 320)
        d = r.route(keys, len(toks), now=float(i))
        t = r.started(d, len(toks), now=float(i))
        r.first_token(t, now=float(i))
        r.finished(t, now=float(i))
        picks.append(d.worker)
    assert sorted(picks[:4]) == WORKERS and picks[4:] == picks[:4]


@pytest.mark.parametrize("step_ties", [0.0, 1.0])
def test_busy_workers_within_one_engine_step_take_turns(step_ties: float) -> None:
    """With ``step_ties: 1``, same match, both busy: a predicted difference under one decode
    step is the phase of the engines' steps, not load, so the worker that waited longest gets
    the request; a difference of several steps still decides. By default the lighter wins."""
    pol = make_policy("ttft", step_ties=step_ties)
    step = step_ties * CostModel().decode_step_ms(0.0)
    for extra, expect_turns in [(250, step_ties > 0), (2000, False)]:
        r = router(seed=1, step_ties=step_ties)
        for w in WORKERS[2:]:
            r.remove_worker(w)
        # w0 has a little more prefill pending than w1 (``extra`` tokens), w1 was used last
        r.loads.started("w0", 100 + extra, now=0.0)
        r.loads.started("w1", 100, now=1.0)
        d = r.route([], 64, now=2.0, explain=True)
        scores = {c.worker: c.score for c in d.candidates}
        gap = scores["w0"] - scores["w1"]
        window = max(pol.tie_ms, scores["w1"] * pol.tie_ratio) + step
        assert gap > max(pol.tie_ms, scores["w1"] * pol.tie_ratio)  # not a plain near-tie
        assert (gap <= window) == expect_turns, (gap, window)
        assert d.worker == ("w0" if expect_turns else "w1")


@pytest.mark.parametrize("step_ties", [0.0, 1.0])
def test_an_idle_worker_without_the_prefix_leaves_busy_step_ties(step_ties: float) -> None:
    """The step window is skipped only when an idle worker has the *longest* match: an idle
    worker that matches nothing (a cold prefill of 4,000 tokens) does not end it for two
    busy holders of the prompt's prefix, under one step apart, which take turns."""
    r = router(seed=1, step_ties=step_ties)
    r.remove_worker("w3")
    toks, keys = prompt(77, 4000)
    for w in ("w0", "w1"):
        r.index.stored(w, None, keys)
    r.loads.started("w0", 100 + 250, now=0.0)  # w0: a little more pending, waited longest
    r.loads.started("w1", 100, now=1.0)
    ask = toks + [5] * 32
    d = r.route(keys, len(ask), now=2.0, explain=True, dry_run=True)
    scores = {c.worker: c.score for c in d.candidates}
    assert scores["w2"] > scores["w0"] > scores["w1"]  # the idle one pays the cold prefill
    assert r.route(keys, len(ask), now=2.0, dry_run=True).worker == ("w0" if step_ties else "w1")


@pytest.mark.parametrize("step_ties", [0.0, 1.0])
def test_an_idle_worker_paying_the_adapter_load_leaves_busy_step_ties(step_ties: float) -> None:
    """The step window is skipped only when an idle worker has the top match at no extra
    cost (it is then the best, whatever busy workers tie). An idle worker that would load
    the request's LoRA adapter is not that: two busy workers with the adapter, under one
    step apart, still take turns with ``step_ties: 1``."""
    r = Router(
        make_policy("ttft", step_ties=step_ties),
        BS,
        rng=random.Random(1),
        adapters=AdapterCatalog(("sql",)),
    )
    for w in WORKERS[:3]:
        r.add_worker(w)
    for w in ("w0", "w1"):
        r.adapters.report(w, ["sql"], slots=2)
    r.loads.started("w0", 100 + 250, now=0.0)  # w0: a little more pending, waited longest
    r.loads.started("w1", 100, now=1.0)
    d = r.route([], 64, now=2.0, adapter="sql", explain=True)
    scores = {c.worker: c.score for c in d.candidates}
    assert scores["w2"] > scores["w0"] > scores["w1"]  # the idle one pays the adapter load
    assert r.route([], 64, now=2.0, adapter="sql").worker == ("w0" if step_ties else "w1")


def test_predicted_reuse_stops_before_the_prompts_last_token() -> None:
    """The engines always compute the prompt's last token: a fully cached 32-token prompt
    reuses 16 tokens at block size 16, a 33-token one 32."""
    assert RouteRequest([1, 2], prompt_tokens=32, block_size=16).matched_tokens(2) == 16
    assert RouteRequest([1, 2], prompt_tokens=33, block_size=16).matched_tokens(2) == 32
    assert RouteRequest([1, 2], prompt_tokens=33, block_size=16).matched_tokens(1) == 16
    assert RouteRequest([], prompt_tokens=1, block_size=16).matched_tokens(0) == 0
    # engines with 32-token blocks under 16-token canonical keys reuse whole 32s
    r = RouteRequest([1, 2, 3], prompt_tokens=60, block_size=16, engine_block_size=32)
    assert r.matched_tokens(3) == 32 and r.matched_tokens(1) == 0


def test_ttft_long_tie_ratio_widens_ties_for_long_requests_only() -> None:
    """``long_tie_ratio``: a request whose uncached tokens are at least the pool's recent
    mean ties across workers within that ratio of its best TTFT and goes to the one that has
    waited longest, leaving the shortest queue to the short requests behind it; a short
    request keeps the exact comparison, and the default (0) keeps it for every request."""
    loads = LoadTracker(order_key=CostModel().queue_key)
    for w in WORKERS:
        loads.add_worker(w)
    loads.started("w1", 8000, now=0.0)  # the longest-waiting worker has the longest queue
    for t, w in enumerate(("w0", "w2", "w3"), start=1):
        loads.started(w, 4000, now=float(t))
    assert loads.mean_prompt_tokens == pytest.approx(5000)

    def choose(request: RouteRequest, **params: float) -> str:
        pol = make_policy("ttft", **{"cold_wait_ratio": 0.0, **params})  # (test below)
        return pol.choose(request, PoolView.from_matches(loads, {}), PolicyContext()).worker

    long_request = RouteRequest([], 20_000, BS)
    short_request = RouteRequest([], 100, BS)
    assert choose(long_request, long_tie_ratio=1.0) == "w1"
    assert choose(long_request) == "w0"  # the shortest queue, oldest among equals
    assert choose(short_request, long_tie_ratio=1.0) == "w0"
    # "long" is relative to the mean: at 5x the mean (25,000 tokens) this request is short
    assert choose(long_request, long_tie_ratio=1.0, long_factor=5.0) == "w0"
    with pytest.raises(ValueError, match=">= 0"):
        make_policy("ttft", long_tie_ratio=-1.0)


def test_ttft_queue_weight_keeps_a_conversation_on_its_busy_holder_under_load() -> None:
    """``queue_weight``: a move off a busy holder redoes the conversation's prefill, which
    delays the requests that reach the new worker meanwhile (the pool's rate per worker x
    its TTFT there). Under load the holder keeps the turn that the default moves; with
    little traffic the move stands, and the default ignores the rate."""
    loads = LoadTracker(order_key=CostModel().queue_key)
    for w in ("w0", "w1"):
        loads.add_worker(w)
    loads.started("w0", 30_000, now=0.0)  # the holder's queue: seconds of prefill
    turn = RouteRequest([], 8_000, BS)
    matches = {"w0": 7_900 // BS}  # the conversation so far, on w0

    def choose(rate: float, **params: float) -> str:
        pop = PrefixPopularity()
        for i in range(int(rate * 10)):  # ``rate`` requests/s over the last 10 s
            pop.observe_request(i / rate)
        pol = make_policy("ttft", **params)
        ctx = PolicyContext(rng=random.Random(0), popularity=pop, now=10.0)
        decision = pol.choose(turn, PoolView.from_matches(loads, matches), ctx)
        assert decision.matched_tokens == (7_900 // BS * BS if decision.worker == "w0" else 0)
        return decision.worker

    assert choose(40.0) == "w1"  # the default moves it to the idle worker ("balance")
    assert choose(40.0, queue_weight=1.0) == "w0"  # 20 requests/s per worker: it stays
    assert choose(0.5, queue_weight=1.0) == "w1"  # one every 4 s per worker: the move stands
    with pytest.raises(ValueError, match="queue_weight"):
        make_policy("ttft", queue_weight=-1.0)


def test_ttft_warm_queue_weight_applies_while_the_pool_reuses_much() -> None:
    """``warm_queue_weight``: ``queue_weight``'s term, only while the pool's recent reuse is
    at least ``cold_reuse`` (multi-turn chat, where a move costs others their cache) and
    once ``cold_min_requests`` were sent; in a cold pool (long, mostly cold prompts, where
    the term cost the p99) the default's choice stands."""
    turn = RouteRequest([], 8_000, BS)
    matches = {"w0": 7_900 // BS}  # the conversation so far, on w0, whose queue is long

    def choose(cached: int, rate: float = 40.0, **params: float) -> str:
        loads = LoadTracker(order_key=CostModel().queue_key)
        for w in ("w0", "w1"):
            loads.add_worker(w)
        loads.started("w0", 30_000, now=0.0, cached_tokens=cached)
        pop = PrefixPopularity()
        for i in range(int(rate * 10)):  # ``rate`` requests/s over the last 10 s
            pop.observe_request(i / rate)
        pol = make_policy("ttft", cold_wait_ratio=0.0, **params)
        ctx = PolicyContext(rng=random.Random(0), popularity=pop, now=10.0)
        return pol.choose(turn, PoolView.from_matches(loads, matches), ctx).worker

    warm, cold = 90_000, 0  # reuse 0.75 and 0
    assert choose(warm, warm_queue_weight=1.0, cold_min_requests=0) == "w0"  # it stays
    assert choose(cold, warm_queue_weight=1.0, cold_min_requests=0) == "w1"  # cold: it moves
    assert choose(warm, warm_queue_weight=1.0) == "w1"  # 1 request sent: no evidence yet
    assert choose(warm, cold_min_requests=0) == "w1"  # off by default
    assert choose(warm, 40.0, warm_queue_weight=0.3, cold_min_requests=0) == "w1"  # 0.3 at 40/s
    assert choose(warm, 160.0, warm_queue_weight=0.3, cold_min_requests=0) == "w0"  # and 160/s
    assert choose(cold, queue_weight=1.0, cold_min_requests=0) == "w0"  # whatever the reuse
    with pytest.raises(ValueError, match="warm_queue_weight"):
        make_policy("ttft", warm_queue_weight=-1.0)


def test_prefix_popularity_total_rate_is_the_pools_request_rate() -> None:
    def stream(seconds: float) -> PrefixPopularity:
        pop = PrefixPopularity(half_life=20.0)
        for i in range(int(seconds * 10)):  # 10 requests/s, a third sharing a prefix
            if i % 3:
                pop.observe_request(i / 10.0)
            else:
                pop.observe(7, i / 10.0)
        return pop

    assert PrefixPopularity().total_rate(5.0) == 0.0  # nothing seen
    assert stream(60.0).total_rate(60.0) == pytest.approx(10.0, rel=0.05)
    assert stream(3.0).total_rate(3.0) == pytest.approx(10.0, rel=0.05)  # from the start
    assert stream(60.0).total_rate(100.0) < 3.0  # two half-lives of silence


def test_ttft_long_wait_ratio_widens_ties_only_by_the_best_workers_wait() -> None:
    """``long_wait_ratio``: a long request's window is that many times its predicted wait at
    its best worker, so it widens only when every worker has a queue (past capacity, where
    the long request should leave the shortest queue to the short ones) and not while an
    idle worker can start it at once (``long_tie_ratio``'s window, a share of the whole
    TTFT, widens there too and sends it to a busy worker)."""

    def tracker(idle: bool) -> LoadTracker:
        loads = LoadTracker(order_key=CostModel().queue_key)
        for w in WORKERS:
            loads.add_worker(w)
        loads.started("w1", 8000, now=0.0)  # the longest-waiting worker, the longest queue
        for t, w in enumerate(("w0", "w2"), start=1):
            loads.started(w, 4000, now=float(t))
        rid = loads.started("w3", 4000, now=10.0)  # the most recent send
        if idle:
            loads.finished(rid)
        return loads

    def choose(loads: LoadTracker, request: RouteRequest, **params: float) -> str:
        pol = make_policy("ttft", **{"cold_wait_ratio": 0.0, **params})  # (test below)
        return pol.choose(request, PoolView.from_matches(loads, {}), PolicyContext()).worker

    long_request = RouteRequest([], 20_000, BS)
    busy = tracker(idle=False)
    assert choose(busy, long_request) == "w0"  # exact: the shortest queue, oldest of equals
    assert choose(busy, long_request, long_wait_ratio=3.0) == "w1"  # past capacity: widened
    assert choose(busy, RouteRequest([], 100, BS), long_wait_ratio=3.0) == "w0"  # short
    idle = tracker(idle=True)
    assert choose(idle, long_request, long_wait_ratio=3.0) == "w3"  # no wait: no widening
    assert choose(idle, long_request, long_tie_ratio=1.0) != "w3"
    with pytest.raises(ValueError, match=">= 0"):
        make_policy("ttft", long_wait_ratio=-1.0)


def test_reuse_is_the_recent_share_of_prompt_tokens_predicted_cached() -> None:
    loads = LoadTracker()
    assert loads.reuse() == 0.0 and loads.sent == 0  # nothing sent yet
    loads.started("w0", 500, now=0.0)
    assert loads.reuse() == 0.0  # nothing predicted cached
    loads.started("w1", 500, now=0.0, cached_tokens=1500)
    assert loads.mean_cached_tokens == 750 and loads.reuse() == pytest.approx(0.6)
    assert loads.sent == 2


def test_ttft_opens_the_long_wait_window_by_default_only_in_a_cold_pool() -> None:
    """The default (``cold_wait_ratio`` 3 below ``cold_reuse`` 0.3): past capacity (every
    worker queued), a long request leaves the shortest queue when the pool's recent requests
    found little of their prompts cached (long prompts, mostly cold: spreading loses no
    cache), and takes it when they found most of it (multi-turn chat: where a first turn goes
    is where its conversation's cache will be); a short request takes it either way, and
    ``cold_wait_ratio: 0`` keeps the exact comparison in a cold pool too."""

    def tracker(cached: int) -> LoadTracker:
        loads = LoadTracker(order_key=CostModel().queue_key)
        for w in WORKERS:
            loads.add_worker(w)
        loads.started("w1", 8000, now=0.0, cached_tokens=cached)  # the longest wait, queue
        for t, w in enumerate(("w0", "w2", "w3"), start=1):
            loads.started(w, 4000, now=float(t), cached_tokens=cached)
        return loads

    def choose(loads: LoadTracker, request: RouteRequest, **params: float) -> str:
        params.setdefault("cold_min_requests", 0)  # these pools sent 4 requests
        pol = make_policy("ttft", **params)
        return pol.choose(request, PoolView.from_matches(loads, {}), PolicyContext()).worker

    long_request = RouteRequest([], 20_000, BS)
    cold, warm = tracker(cached=500), tracker(cached=20_000)
    assert cold.reuse() < 0.3 < warm.reuse()
    assert choose(cold, long_request) == "w1"  # cold pool: the window opens
    assert choose(warm, long_request) == "w0"  # reuse to keep: the shortest queue
    assert choose(cold, RouteRequest([], 100, BS)) == "w0"  # short: the shortest queue
    assert choose(cold, long_request, cold_wait_ratio=0.0) == "w0"  # turned off
    assert choose(cold, long_request, cold_reuse=0.01) == "w0"  # a lower gate: closed
    # the default asks for evidence: 4 requests are too few to call the pool cold ...
    assert choose(cold, long_request, cold_min_requests=32) == "w0"
    for t in range(28):  # ... 32 are enough (more of the same: short, mostly uncached)
        cold.first_token(cold.started("w2", 10, now=10.0 + t, cached_tokens=1))
    assert cold.sent == 32 and cold.reuse() < 0.3
    assert choose(cold, long_request, cold_min_requests=32) == "w1"
    # an explicit long_wait_ratio applies whatever the reuse
    assert choose(warm, long_request, long_wait_ratio=3.0) == "w1"
    with pytest.raises(ValueError, match=">= 0"):
        make_policy("ttft", cold_wait_ratio=-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        make_policy("ttft", cold_min_requests=-1)
