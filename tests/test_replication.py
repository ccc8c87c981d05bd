"""Hot prefixes: holders sized from demand, warm-ups instead of cold spills (replication.py)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.keys import BlockKeyer
from gateway.routing.policy import make_policy
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


def hot_stream(r: Router, n: int, gap: float, t0: float = 0.0, base: int = 7) -> list[str]:
    """``n`` requests of one 6,000-token prefix, ``gap`` s apart, all left in flight."""
    prefix = ids(base, 6000)
    reasons = []
    for i in range(n):
        toks = prefix + ids(1000 + i, 64)
        now = t0 + i * gap
        d = r.route(KEYER.keys(toks), len(toks), now=now)
        r.started(d, len(toks), now=now)
        reasons.append(d.reason)
    return reasons


def test_a_hot_prefix_is_warmed_not_spilled() -> None:
    """20 req/s of a 6,000-token prefix on 4 workers warrant 3 holders: two warm-ups are
    asked for (one per new holder), no request is sent anywhere cold to replicate, and the
    warming workers are speculated as holders (requests queue behind the warm-up)."""
    r = router(seed=1)
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
    for i in range(8):
        toks = prefix + ids(5000 + i, 64)
        d = r.route(KEYER.keys(toks), len(toks), now=1.0 + i * 0.05)
        r.started(d, len(toks), now=1.0 + i * 0.05)
        assert d.matched_tokens == 6000
        got[d.worker] += 1
    assert set(got) - {"w0"}, got  # the warmed workers serve the prefix from cache


def test_spill_mode_keeps_the_cold_replicate_path() -> None:
    r = router(seed=4, warmup=False)
    reasons = hot_stream(r, 30, 0.05)
    assert reasons.count("replicate") >= 1
    assert r.ctx.warmups.asked == 0
