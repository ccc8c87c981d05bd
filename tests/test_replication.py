"""Hot prefixes: holders sized from demand, warm-ups instead of cold spills (replication.py)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.keys import BlockKeyer
from gateway.routing.policy import Decision, make_policy
from gateway.routing.popularity import PrefixPopularity
from gateway.routing.replication import WarmupBook, WarmupIntent, holders_needed
from gateway.routing.router import Router

BS = 16
KEYER = BlockKeyer("replication-tests", BS)
WORKERS = [f"w{i}" for i in range(4)]


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100_000) for _ in range(n)]


def router(seed: int = 0, **params: object) -> Router:
    r = Router(make_policy("ttft", **params), BS, rng=random.Random(seed))
    for w in WORKERS:
        r.add_worker(w)
        r.index.add_worker(w)
    return r


# -- sizing -----------------------------------------------------------------------------------


def test_holders_follow_work_not_request_count() -> None:
    # 10 req/s of a 123 ms prefill = 1.23 s of engine time per second: two workers
    assert holders_needed(10.0, 123.0, 8) == 2
    # the same request rate of a prefix 10x cheaper to prefill fits one worker
    assert holders_needed(10.0, 12.3, 8) == 1
    assert holders_needed(100.0, 123.0, 8) == 8  # clamped to the pool
    assert holders_needed(0.0, 123.0, 8) == 1  # a prefix has at least its holder
    assert holders_needed(10.0, 123.0, 8, replication=2.0) == 3  # headroom
    assert holders_needed(10.0, 100.0, 8) == 1  # exactly one worker's second: one holder
    assert holders_needed(5.0, 100.0, 0) == 0
    with pytest.raises(ValueError, match="capacity_ms"):
        holders_needed(1.0, 1.0, 2, capacity_ms=0.0)


def reference_rate(times: list[float], now: float, half_life: float, min_window: float) -> float:
    """The decayed arrival rate computed from scratch: every arrival's weight
    ``2^-(age / half_life)``, over the decayed length of the span since the first one."""
    lam = math.log(2) / half_life
    weight = sum(math.exp(-lam * (now - t)) for t in times)
    age = max(now - times[0], min_window)
    return weight * lam / (1 - math.exp(-lam * age))


@settings(max_examples=200, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=60),
    after=st.floats(0.0, 30.0),
    prefill_ms=st.floats(1.0, 3000.0),
    workers=st.integers(1, 64),
    replication=st.floats(0.1, 4.0),
)
def test_sizing_matches_a_reference_model(
    gaps: list[float], after: float, prefill_ms: float, workers: int, replication: float
) -> None:
    pop = PrefixPopularity(half_life=20.0, min_window=0.25, floor=0.0)
    times, t = [], 0.0
    for g in gaps:
        t += g
        times.append(t)
        pop.observe(7, t)
    now = t + after
    rate = pop.rate(7, now)
    ref = reference_rate(times, now, 20.0, 0.25)
    assert rate == pytest.approx(ref, rel=1e-6)
    need = holders_needed(rate, prefill_ms, workers, replication)
    # the reference need, computed on both sides of the rounding edge
    demand = replication * ref * prefill_ms / 1000.0
    lo = min(workers, max(1, math.ceil(demand * (1 - 1e-6) - 1e-9)))
    hi = min(workers, max(1, math.ceil(demand * (1 + 1e-6) - 1e-9)))
    assert lo <= need <= hi
    # a steady stream at r req/s is measured as r from the first moments on
    assert 1 <= need <= workers
    assert holders_needed(rate * 2, prefill_ms, workers, replication) >= need


def test_a_steady_rate_is_measured_from_the_first_second() -> None:
    pop = PrefixPopularity(half_life=20.0, min_window=0.25)
    for i in range(20):  # 20 req/s for one second
        pop.observe(1, i * 0.05)
    assert pop.rate(1, 1.0) == pytest.approx(20.0, rel=0.1)
    assert pop.weight(1, 1.0) == pytest.approx(19.8, rel=0.05)  # the count alone: 20, not 20/s
    # the rate decays when the prefix stops arriving: the holder set shrinks with it
    assert pop.rate(1, 61.0) < 20.0 / 7


def test_rate_can_count_the_request_being_routed() -> None:
    """``plus`` adds requests arriving now: a prefix seen once before counts two."""
    pop = PrefixPopularity(half_life=20.0, min_window=0.25)
    assert pop.rate(1, 0.0) == 0.0
    span = -math.expm1(-math.log(2) / 20.0 * 0.25) / (math.log(2) / 20.0)
    assert pop.rate(1, 0.0, plus=1.0) == pytest.approx(1.0 / span)
    pop.observe(1, 0.0)
    assert pop.rate(1, 0.1, plus=1.0) == pytest.approx(pop.rate(1, 0.1) * 2, rel=0.01)


def test_rate_counts_from_when_the_prefix_was_first_sent() -> None:
    """``since``: a prefix first matched now but first sent 3 s ago (the request that put
    it on its holder) is one request over 3 s, not one over ``min_window``."""
    pop = PrefixPopularity(half_life=20.0, min_window=0.1)
    lam = math.log(2) / 20.0
    assert pop.rate(1, 10.0, plus=1.0, since=7.0) == pytest.approx(lam / -math.expm1(-lam * 3.0))
    assert pop.rate(1, 10.0, plus=1.0) == pytest.approx(lam / -math.expm1(-lam * 0.1))
    pop.observe(1, 5.0)  # observed since: the earlier of the two counts
    assert pop.rate(1, 10.0, since=7.0) == pytest.approx(pop.rate(1, 10.0))
    assert pop.rate(1, 10.0, since=2.0) < pop.rate(1, 10.0)


# -- the warm-up book -------------------------------------------------------------------------


def intent(worker: str, key: int = 5, at: float = 0.0) -> WarmupIntent:
    return WarmupIntent(worker, key, 2, 32, at)


def test_one_warmup_per_prefix_and_worker_until_seen_or_timed_out() -> None:
    book = WarmupBook(timeout=10.0)
    assert book.want(intent("a"))
    assert not book.want(intent("a", at=1.0))  # already pending: not asked twice
    assert book.want(intent("b"))
    assert sorted(book.pending(5, holders=(), now=1.0)) == ["a", "b"]
    # the index shows "a" holding the prefix: done, no longer pending
    assert book.pending(5, holders=("a",), now=2.0) == ["b"]
    # "b" failed silently (never showed): after the timeout it may be asked again, not before
    assert not book.want(intent("b", at=9.0))
    assert book.pending(5, holders=(), now=10.0) == []
    assert book.want(intent("b", at=10.0))
    assert len(book) == 1
    with pytest.raises(ValueError, match="timeout"):
        WarmupBook(timeout=0)


def test_take_gives_the_intents_a_prompt_can_serve() -> None:
    book = WarmupBook()
    keys = KEYER.keys(ids(1, 64))  # 4 blocks
    book.want(WarmupIntent("a", keys[1], 2, 32, 0.0))
    book.want(WarmupIntent("b", 12345, 2, 32, 0.0))  # another prefix
    book.want(WarmupIntent("c", keys[3], 9, 144, 0.0))  # longer than this prompt
    got = book.take(keys)
    assert [i.worker for i in got] == ["a"]
    assert book.take(keys) == []  # taken once
    assert sorted(i.worker for i in book.drain()) == ["b", "c"]


def test_the_outbox_is_bounded_when_nobody_takes_it() -> None:
    book = WarmupBook(max_outbox=3)
    assert [book.want(intent(f"w{i}", key=i)) for i in range(5)] == [True] * 3 + [False] * 2
    assert len(book.drain()) == 3


def test_expired_prefixes_are_forgotten() -> None:
    book = WarmupBook(timeout=1.0)
    for k in range(100):
        book.want(intent("a", key=k, at=float(k)))
    assert len(book) <= 66  # the ones older than the timeout went when the table grew


# -- the policy -------------------------------------------------------------------------------


def siblings(
    r: Router, prefix: list[int], n: int, gap: float, t0: float = 0.0, tail: int = 1000
) -> list[Decision]:
    """``n`` requests of ``prefix`` and 64 tokens of their own (seeds ``tail``, ``tail + 1``,
    ...), ``gap`` s apart from ``t0``, each routed and left in flight."""
    out = []
    for i in range(n):
        toks = prefix + ids(tail + i, 64)
        now = t0 + i * gap
        d = r.route(KEYER.keys(toks), len(toks), now=now)
        r.started(d, len(toks), now=now)
        out.append(d)
    return out


def hot_stream(r: Router, n: int, gap: float, t0: float = 0.0, base: int = 7) -> list[str]:
    """The reasons of ``n`` requests of one 6,000-token prefix, ``gap`` s apart."""
    return [d.reason for d in siblings(r, ids(base, 6000), n, gap, t0)]


def test_a_hot_prefix_is_warmed_not_spilled() -> None:
    """20 req/s of a 6,000-token prefix on 4 workers warrant 3 holders: once the first
    holder has computed the prefix, two warm-ups are asked for (one per new holder), no
    request is sent anywhere cold to replicate, and the warming workers are speculated as
    holders (requests queue behind the warm-up)."""
    r = router(seed=1)
    prefix = ids(7, 6000)
    first = prefix + ids(999, 64)
    d = r.route(KEYER.keys(first), len(first), now=-1.0)
    assert d.predicted_ttft_ms is not None
    done = -1.0 + d.predicted_ttft_ms / 1000.0  # as predicted: the calibration stays at 1
    r.first_token(r.started(d, len(first), now=-1.0), now=done)
    r.index.stored(d.worker, None, KEYER.keys(prefix))  # the engine reports it computed
    reasons = hot_stream(r, 30, 0.05)
    assert "replicate" not in reasons
    book = r.ctx.warmups
    intents = book.drain()
    holders = {w for n, ws in r.index.match_levels(KEYER.keys(ids(7, 6000))) for w in ws}
    assert len(intents) == 2 == book.asked
    assert len({i.worker for i in intents}) == 2
    assert all(i.tokens == 6000 and i.blocks == 375 for i in intents)
    assert {i.worker for i in intents} <= holders  # speculated


def test_warmups_shrink_with_demand() -> None:
    """After the prefix cools down (a low rate), it warrants one holder: no more warm-ups."""
    r = router(seed=2)
    hot_stream(r, 6, 2.0)  # 0.5 req/s of 123 ms: far below one worker's second
    assert r.ctx.warmups.asked == 0


def test_a_warmed_worker_takes_traffic_once_it_holds_the_prefix() -> None:
    """The index shows the warmed worker holding the prefix (its engine's events): the next
    requests go there while the first holder is busy, with a full cache hit."""
    r = router(seed=3)
    r.speculate = False  # only the engine's events count here
    prefix = ids(9, 6000)
    pkeys = KEYER.keys(prefix)
    r.index.stored("w0", None, pkeys)  # the first holder
    hot_stream(r, 12, 0.05, base=9)
    intents = r.ctx.warmups.drain()
    assert intents and all(i.worker != "w0" for i in intents)
    for it in intents:  # each warm-up completes: the engine stores the prefix
        r.index.stored(it.worker, None, pkeys[: it.blocks])
    got: Counter[str] = Counter()
    for d in siblings(r, prefix, 8, 0.05, t0=1.0, tail=5000):
        assert d.matched_tokens == 6000
        got[d.worker] += 1
    assert set(got) - {"w0"}, got  # the warmed workers serve the prefix from cache


def test_the_onset_goes_cold_to_idle_workers_while_the_holder_computes() -> None:
    """A hot prefix's second request arrives while its only holder is still prefilling
    it: waiting there is no faster than a cold prefill on an idle worker, and the demand
    (counting this request) warrants another holder, so it goes there cold at once, as
    round robin would send it, instead of queueing behind the first prefill. Each onset
    request takes a new worker, never more than the workers there are."""
    r = router(seed=5)
    reasons = hot_stream(r, 4, 0.05)
    assert reasons[:2] == ["cold", "replicate"]
    holders = r.index.match_levels(KEYER.keys(ids(7, 6000)))
    assert holders and len(holders[0][1]) == len({*holders[0][1]}) >= 2
    assert r.ctx.warmups.asked == 0


def test_the_onset_waits_when_the_cold_worker_would_be_slower() -> None:
    """The only non-holder is itself busy with a long prefill: the cold request there would
    wait for it, so the request queues behind the holder's prefill instead."""
    r = Router(make_policy("ttft"), BS, rng=random.Random(6))
    for w in ("a", "b"):
        r.add_worker(w)
        r.index.add_worker(w)
    prefix = ids(8, 6000)
    other = ids(80, 8000)
    d = r.route(KEYER.keys(other), len(other), now=0.0)
    r.started(d, len(other), now=0.0)
    toks = prefix + ids(81, 64)
    d0 = r.route(KEYER.keys(toks), len(toks), now=0.01)
    r.started(d0, len(toks), now=0.01)
    assert d0.worker != d.worker
    toks = prefix + ids(82, 64)
    d1 = r.route(KEYER.keys(toks), len(toks), now=0.02)
    assert (d1.worker, d1.reason, d1.matched_tokens) == (d0.worker, "cache", 6000)


def test_a_pair_of_siblings_of_a_modest_prefix_stays_together() -> None:
    """A 2,000-token prefix's second request during its first prefill: a cold prefill on
    an idle worker would be faster for it, but one holder carries that demand, so it stays
    with the first (speculation keeps sibling bursts together)."""
    r = router(seed=7)
    prefix = ids(9, 2000)
    got = siblings(r, prefix, 2, 0.02, tail=90)
    assert got[1].worker == got[0].worker and got[1].reason == "cache"


def test_onset_siblings_count_the_request_being_prefilled() -> None:
    """``onset_siblings``: the request its holder is prefilling counts as demand when the
    new one shares only a prefix of its prompt (a sibling), so the pair of the test above
    splits, the second going cold to an idle worker as round robin would send it. A
    conversation's next turn (its match is the whole of the previous prompt) still stays
    with its holder."""
    r = router(seed=7, onset_siblings=True)
    got = siblings(r, ids(9, 2000), 2, 0.02, tail=90)
    assert got[1].worker != got[0].worker and got[1].reason == "replicate"
    assert got[1].matched_tokens == 0
    r = router(seed=7, onset_siblings=True)
    first = ids(9, 2000) + ids(90, 64)
    d0 = r.route(KEYER.keys(first), len(first), now=0.0)
    r.started(d0, len(first), now=0.0)
    turn = first + ids(91, 64)  # the next turn: the whole previous prompt, then more
    d1 = r.route(KEYER.keys(turn), len(turn), now=0.02)
    assert (d1.worker, d1.reason, d1.matched_tokens) == (d0.worker, "cache", len(first) // BS * BS)


def test_a_prefill_longer_than_the_speculation_keeps_its_attribution() -> None:
    """A prefix routed at t = 0 is attributed to its worker speculatively for
    ``speculative_ttl`` (5 s) until the engine reports it. A request matching it there
    before that (the prefill still under way: a long prompt, a slow engine) computes it
    there too, so it renews the attribution: at 8 s the prefix still points at its worker.
    Before, only the new request's own blocks were attributed, and on hot-prefix-8 (10 s
    cold prefills) the prefix lapsed mid-prefill on every worker, sending requests to the
    holders left in the index, then cold to workers already computing it. Without such a
    request the attribution lapses as before."""

    def run(second_at: float | None) -> tuple[Router, str, list[int]]:
        r = router(seed=3)
        prefix = ids(7, 6000)
        first = prefix + ids(200, 64)
        d0 = r.route(KEYER.keys(first), len(first), now=0.0)
        r.started(d0, len(first), now=0.0)
        if second_at is not None:
            second = prefix + ids(201, 64)
            d1 = r.route(KEYER.keys(second), len(second), now=second_at)
            r.started(d1, len(second), now=second_at)
            assert (d1.worker, d1.reason) == (d0.worker, "cache")
        r.tick(8.0)
        return r, d0.worker, KEYER.keys(prefix)

    r, worker, pkeys = run(4.0)
    assert r.index.match(pkeys) == {worker: len(pkeys)}
    assert r.index.speculated_at(worker, pkeys[-1]) == 4.0
    r, worker, pkeys = run(None)
    assert r.index.match(pkeys) == {}


def test_requests_arriving_within_one_prefill_count_as_demand() -> None:
    """The cost model may think a prefill cheap (uncalibrated, it says 48 ms for 2,000
    tokens, too little for 20 req/s to warrant a second holder), but while no holder has
    finished computing the prefix, every request seen since it appeared arrived within one
    prefill: the third such request takes a second worker cold."""
    r = router(seed=12)
    prefix = ids(14, 2000)
    reasons = [d.reason for d in siblings(r, prefix, 3, 0.05, tail=140)]
    assert reasons == ["cold", "cache", "replicate"]


def test_no_cold_onset_once_the_prefix_is_computed() -> None:
    """The holder has its prefix (the first request got its first token): a second request
    is a cache hit there, not a cold spill (a conversation's next turn stays put)."""
    r = router(seed=8)
    prefix = ids(10, 6000)
    toks = prefix + ids(100, 64)
    d0 = r.route(KEYER.keys(toks), len(toks), now=0.0)
    r.first_token(r.started(d0, len(toks), now=0.0), now=1.3)
    toks = prefix + ids(101, 64)
    d1 = r.route(KEYER.keys(toks), len(toks), now=1.31)
    assert (d1.worker, d1.reason) == (d0.worker, "cache")


def test_a_conversation_turn_behind_its_queued_previous_turn_is_not_an_onset() -> None:
    """Open-loop traffic past capacity: a conversation's next turn arrives while its
    previous turn still waits in its holder's queue, so the holder's match is speculative
    and its queue holds the prefix. A next turn is not a hot prefix's onset, however soon it
    follows (3 s or 50 ms: one request gives no rate): it stays with the holder (a cache hit
    behind the queue) instead of going cold to another worker, which would compute the
    whole conversation again. A sibling (a request sharing only a prefix of the queued
    prompt) 50 ms after it is an onset, and still spills. With ``next_turns: false`` (the
    rule before) the 50 ms turn spilled too: on chat-eviction with the engines' own cost
    model such turns went cold by the dozen (docs/benchmarks.md, "Next turns are not an
    onset")."""

    def second(gap: float, sibling: bool = False, **params: object) -> Decision:
        r = Router(make_policy("ttft", **params), BS, rng=random.Random(15))
        for w in ("a", "b"):
            r.add_worker(w)
            r.index.add_worker(w)
        first = ids(16, 12_000)
        r.index.speculate("a", KEYER.keys(first), 0.0)  # turn 1 routed to "a" at t = 0
        r.loads.started("a", 8_000, 0.0)  # someone else's prompt ahead of it
        r.loads.started("a", len(first), 0.0)  # turn 1, still queued
        r.loads.started("b", 4_000, 0.0)  # "b" busy too (past capacity)
        toks = (first[:11_200] if sibling else first) + ids(17, 64)
        return r.route(KEYER.keys(toks), len(toks), now=gap)

    for gap in (3.0, 0.05):
        later = second(gap)
        assert (later.worker, later.reason, later.matched_tokens) == ("a", "cache", 12_000)
    burst = second(0.05, sibling=True)  # the prefix twice within 50 ms: two holders' demand
    assert (burst.worker, burst.reason) == ("b", "replicate")
    old = second(0.05, next_turns=False)
    assert (old.worker, old.reason) == ("b", "replicate")


def test_no_cold_onset_when_the_holder_is_busy_with_other_work() -> None:
    """The holder has computed the prefix (the engine reported it) and is busy with an
    unrelated long prefill: its queue is not this prefix's, so no onset spill; the usual
    cost decides (a cache hit behind the queue beats a cold prefill here)."""
    r = router(seed=10)
    prefix = ids(12, 6000)
    r.index.stored("w0", None, KEYER.keys(prefix))
    r.loads.started("w0", 8000, 0.0)  # someone else's cold prompt
    toks = prefix + ids(120, 64)
    d = r.route(KEYER.keys(toks), len(toks), now=0.01)
    assert (d.worker, d.reason) == ("w0", "cache")


def _hot_pair() -> tuple[Router, list[int], list[int]]:
    """Workers "a" and "b", and a 6,000-token prefix seen at 20 req/s: demand for more
    holders than one. Returns the router, the prefix's ids and its keys."""
    r = Router(make_policy("ttft"), BS, rng=random.Random(11))
    prefix = ids(13, 6000)
    pkeys = KEYER.keys(prefix)
    for w in ("a", "b"):
        r.add_worker(w)
        r.index.add_worker(w)
    for i in range(40):
        r.ctx.popularity.observe(pkeys[-1], i * 0.05)
    return r, prefix, pkeys


def test_a_busy_worker_with_only_decodes_is_warmed_beside_a_queued_holder() -> None:
    """No worker is idle: the holder has a 6,000-token prefill queued, the other only four
    sequences decoding. The other is the lighter one (a shorter predicted wait, though more
    sequences run there), so the hot prefix's new holder is warmed there."""
    r, prefix, pkeys = _hot_pair()
    r.index.stored("a", None, pkeys)
    r.loads.started("a", 6000, 0.0)  # someone else's long prompt, queued
    for _ in range(4):  # b: four sequences past their first token
        r.loads.first_token(r.loads.started("b", 100, 0.0))
    toks = prefix + ids(130, 64)
    d = r.route(KEYER.keys(toks), len(toks), now=2.0)
    assert (d.worker, d.reason) == ("a", "cache")
    assert [i.worker for i in r.ctx.warmups.drain()] == ["b"]


def test_at_the_onset_a_busy_newcomer_takes_the_request_cold_not_a_warmup() -> None:
    """The hot prefix's only holder is still computing it (its match is speculative) and no
    worker is idle: the other has 3,000 tokens of someone else's prefill queued, so a cold
    request there is predicted slower than waiting for the holder (no onset spill), but it
    is the lighter worker, so it becomes the new holder. Not by a warm-up: beside the
    holder's prefill that computes the prefix a second time for nobody, and the requests
    the index then sends there are admitted while it is still being chunked and compute it
    once more (hot-sudden past capacity: p50 1.3x round robin's). This request goes there
    cold itself, as round robin would send it."""
    r, prefix, _ = _hot_pair()
    r.loads.started("b", 3000, 2.0)  # someone else's prompt, queued
    first = prefix + ids(129, 64)
    d0 = r.route(KEYER.keys(first), len(first), now=2.0)
    r.started(d0, len(first), now=2.0)
    assert (d0.worker, d0.reason) == ("a", "cold")  # the idle one; computing it now
    toks = prefix + ids(130, 64)
    d = r.route(KEYER.keys(toks), len(toks), now=2.01)
    assert (d.worker, d.reason, d.matched_tokens) == ("b", "replicate", 0)
    assert r.ctx.warmups.drain() == [] and r.ctx.warmups.asked == 0


def test_busy_holders_of_a_hot_prefix_take_turns() -> None:
    """Two busy holders of a prefix whose demand warrants several holders, their predicted
    TTFTs a few milliseconds apart (within ``hot_step_ties`` decode steps): the one that
    waited longest gets the request, though it looks heavier (that difference is the
    engines' step phase). Without the demand, the lighter one wins, as before."""

    def pick(hot: bool) -> str:
        r = Router(make_policy("ttft"), BS, rng=random.Random(9))
        prefix = ids(11, 6000)
        pkeys = KEYER.keys(prefix)
        for w in ("a", "b"):
            r.add_worker(w)
            r.index.add_worker(w)
            r.index.stored(w, None, pkeys)
        r.loads.started("a", 300, 0.0)  # a: waited longest, 200 tokens more queued
        r.loads.started("b", 100, 0.5)
        if hot:
            for i in range(40):  # 20 req/s of a 6,000-token prefix: 3 holders' worth
                r.ctx.popularity.observe(pkeys[-1], i * 0.05)
        toks = prefix + ids(110, 64)
        return r.route(KEYER.keys(toks), len(toks), now=2.0, dry_run=True).worker

    assert pick(hot=False) == "b"
    assert pick(hot=True) == "a"


def test_spill_mode_keeps_the_cold_replicate_path() -> None:
    r = router(seed=4, warmup=False)
    reasons = hot_stream(r, 30, 0.05)
    assert reasons.count("replicate") >= 1
    assert r.ctx.warmups.asked == 0


def _shared_prefix_stream(suffix: int, **params: object) -> tuple[Router, list[Decision]]:
    """Long, mostly cold prompts sharing one 512-token prefix (``trace-production``'s shape),
    2 s apart on 4 workers, each prefilled and left decoding: every worker it went to stays
    busy. The first one's worker reports the prefix computed."""
    r = router(seed=8, **params)
    prefix = ids(21, 512)
    out = []
    for i in range(6):
        toks = prefix + ids(3000 + i, suffix)
        now = 2.0 * i
        d = r.route(KEYER.keys(toks), len(toks), now=now)
        r.first_token(r.started(d, len(toks), now=now), now=now + 0.5)
        if i == 0:
            r.index.stored(d.worker, None, KEYER.keys(prefix))
        out.append(d)
    return r, out


def test_idle_workers_without_a_shared_prefix_are_warmed_in_a_cold_pool() -> None:
    """Each request prefers the prefix's busy holder (a decode step riding along its
    prefill) to an idle worker that would recompute the 512 tokens, and a prefix that short
    needs one holder for its compute: without ``warm_idle`` the other workers are never sent
    anything. With it (the default), in a cold pool, an idle non-holder is warmed with the
    prefix (one per request, never the same one twice), and the index counts it a holder
    from then on (speculated), so the next requests take the warmed workers, idle holders."""
    r, ds = _shared_prefix_stream(5000)  # the default: on
    holder = ds[0].worker
    intents = r.ctx.warmups.drain()
    warmed = [i.worker for i in intents]
    assert warmed, "no warm-up of an idle worker"
    assert len(set(warmed)) == len(warmed) and holder not in warmed
    assert all(i.tokens == 512 and i.blocks == 32 for i in intents)
    used = {d.worker for d in ds}
    assert len(used) > 1 and used <= {holder, *warmed}
    assert all(d.matched_tokens == 512 for d in ds[1:])  # every one a cache hit

    r, ds = _shared_prefix_stream(5000, warm_idle=False)  # off: one worker takes them all
    assert {d.worker for d in ds} == {ds[0].worker}
    assert r.ctx.warmups.asked == 0


def test_idle_workers_are_not_warmed_when_the_pool_reuses_much() -> None:
    """The same stream with short suffixes: the shared prefix is most of every prompt
    (recent reuse above ``cold_reuse``), where idle workers' caches are worth keeping (and
    a prefix worth more holders gets them from its demand): no warm-up."""
    r, _ = _shared_prefix_stream(100)
    assert r.loads.reuse() > 0.3
    assert r.ctx.warmups.asked == 0
