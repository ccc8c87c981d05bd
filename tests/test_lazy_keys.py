"""Lazy block keys: the same keys as the eager path, and the same routing decisions.

``LazyKeys`` computes keys only as far as they are read and the router defers speculation
over them (``ShadowIndex.speculate_later``); nothing a caller can observe may differ from
eager keys: keys, decisions (worker, matched tokens) and the index left behind.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.contract.wire import EngineReport
from gateway.routing.index import ShadowIndex
from gateway.routing.keys import BlockKeyer, LazyKeys, PrefixKeys
from gateway.routing.policy import make_policy
from gateway.routing.router import Router

BS = 4
KEYER = BlockKeyer("lazy-test", BS)
token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=120)


@given(token_lists, st.lists(st.integers(0, 40), max_size=6), st.booleans())
@settings(max_examples=200, deadline=None)
def test_lazy_keys_equal_eager(tokens: list[int], reads: list[int], adapter: bool) -> None:
    root = KEYER.adapter_root("a") if adapter else None
    eager = KEYER.keys(tokens, root)
    lazy = LazyKeys(KEYER, tokens, root)
    assert len(lazy) == len(eager)
    for k in reads:  # any order of partial reads leaves a prefix of the eager keys
        got = lazy.upto(k)
        assert len(got) >= min(k, len(eager)) and got == eager[: len(got)]
        if k < len(eager):
            assert lazy[k] == eager[k] and lazy[-1 - k] == eager[-1 - k]
        assert lazy[:k] == eager[:k] and lazy[k:] == eager[k:]
    assert list(lazy) == eager and lazy.all() == eager and lazy.computed == len(eager)


@given(token_lists, st.integers(0, 30))
@settings(max_examples=100, deadline=None)
def test_lazy_keys_from_known_prefix(tokens: list[int], known: int) -> None:
    eager = KEYER.keys(tokens)
    known = min(known, len(eager))
    lazy = LazyKeys(KEYER, tokens, None, eager[:known])
    assert lazy.computed == known and lazy.all() == eager


@given(token_lists, st.integers(0, 120), st.integers(0, 40), st.booleans())
@settings(max_examples=200, deadline=None)
def test_lazy_keys_extended_to_a_longer_prompt_equal_its_eager_keys(
    tokens: list[int], cut: int, read: int, adapter: bool
) -> None:
    """Keys made from a prompt's first ids and extended to all of them (a prompt routed on its
    known ids while the rest is encoded) are the eager keys of the whole prompt, however far
    they were read before."""
    root = KEYER.adapter_root("a") if adapter else None
    first = tokens[: min(cut, len(tokens))]
    lazy = LazyKeys(KEYER, first, root)
    before = list(lazy.upto(read))
    assert before == KEYER.keys(first, root)[: len(before)]
    lazy.extend(tokens)
    assert len(lazy) == len(tokens) // BS
    assert lazy.all() == KEYER.keys(tokens, root) and list(lazy) == KEYER.keys(tokens, root)


def test_lazy_keys_cannot_be_extended_to_fewer_blocks() -> None:
    lazy = LazyKeys(KEYER, list(range(12)))
    with pytest.raises(ValueError, match="fewer blocks"):
        lazy.extend(list(range(7)))
    lazy.extend(list(range(13)))  # same blocks: nothing to add
    assert lazy.all() == KEYER.keys(list(range(12)))


def test_prefix_keys_lazy_reuses_and_completes() -> None:
    memo = PrefixKeys(KEYER, 10_000)
    rng = random.Random(1)
    first = [rng.randrange(1000) for _ in range(50)]
    remembered = tuple(first)
    lazy = memo.lazy(first, (), remembered)
    assert lazy.computed == 0  # nothing computed until read
    ids = first + [rng.randrange(1000) for _ in range(30)]
    follow = memo.lazy(ids, remembered, tuple(ids))
    assert memo.hits == 1 and follow.computed == len(first) // BS
    assert follow.all() == KEYER.keys(ids) and lazy.all() == KEYER.keys(first)
    # a shorter prefix remembered beside it (a chat's system prompt, ``lead``): a new
    # conversation under it starts from its keys
    lead = tuple(ids[:40])
    memo.lazy(ids, remembered, tuple(ids), None, lead)
    other = [*lead, *(rng.randrange(1000) for _ in range(25))]
    fresh = memo.lazy(other, lead)
    assert memo.hits == 3 and fresh.computed == len(lead) // BS
    assert fresh.all() == KEYER.keys(other)


# -- decisions: lazy keys against eager keys, same inputs -------------------------------------

WORKERS = [f"w{i}" for i in range(6)]


def _router(seed: int) -> Router:
    router = Router(make_policy("ttft"), BS, index=ShadowIndex(), rng=random.Random(seed))
    for w in WORKERS:
        router.add_worker(w)
    return router


prefixes = st.lists(st.lists(st.integers(0, 50), min_size=0, max_size=40), min_size=1, max_size=4)
#: (prefix, tail, holders and how many blocks each holds): index contents
stores = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 2**16), st.lists(st.integers(0, 40), max_size=3)),
    max_size=12,
)
#: (prefix, tail seed, tail length, via PrefixKeys's follow-up path)
requests = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 2**16), st.integers(0, 60), st.booleans()),
    min_size=1,
    max_size=12,
)


def _tail(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(60) for _ in range(n)]


@given(prefixes, stores, requests, st.lists(st.integers(0, 9), min_size=6, max_size=6))
@settings(max_examples=150, deadline=None)
def test_lazy_decisions_equal_eager(
    sys_prompts: list[list[int]],
    contents: list[tuple[int, int, list[int]]],
    reqs: list[tuple[int, int, int, bool]],
    loads: list[int],
) -> None:
    eager, lazy = _router(7), _router(7)
    memo = PrefixKeys(KEYER, 100_000)
    for router in (eager, lazy):
        for i, w in enumerate(WORKERS):
            report = EngineReport(running=loads[i] % 4, waiting=loads[i] // 4, kv_usage=0.3)
            router.loads.report(w, report, now=0.0)
        for p, seed, held in contents:
            keys = KEYER.keys(sys_prompts[p % len(sys_prompts)] + _tail(seed, 40))
            for j, blocks in enumerate(held):
                router.index.stored(WORKERS[(seed + j) % len(WORKERS)], None, keys[:blocks])
    previous: dict[int, tuple[int, ...]] = {}
    now = 0.0
    for p, seed, n, follow in reqs:
        prefix = sys_prompts[p % len(sys_prompts)]
        ids = prefix + _tail(seed, n)
        known = previous.get(p, ()) if follow else ()
        if known and ids[: len(known)] != list(known):
            known = ()
        remembered = tuple(ids)
        lk = memo.lazy(ids, known, remembered)
        d1 = eager.route(KEYER.keys(ids), len(ids), now)
        d2 = lazy.route(lk, len(ids), now)
        assert (d2.worker, d2.matched_tokens, d2.reason) == (
            d1.worker,
            d1.matched_tokens,
            d1.reason,
        )
        eager.started(d1, len(ids), now)
        lazy.started(d2, len(ids), now)
        previous[p] = remembered
        now += 0.5
        if seed % 3 == 0:  # the gateway settles after forwarding; or the next reader does
            lazy.index.settle()
        eager.tick(now)
        lazy.tick(now)
    assert sorted(lazy.index.iter_runs()) == sorted(eager.index.iter_runs())
    assert lazy.index.stats == eager.index.stats
    lazy.index.check_invariants()


@given(token_lists, st.integers(0, 30))
@settings(max_examples=100, deadline=None)
def test_adopted_keys_continue_the_chain(tokens: list[int], known: int) -> None:
    """``adopt`` takes a prefix's keys without copying them; the rest chains on exactly."""
    eager = KEYER.keys(tokens)
    lazy = LazyKeys(KEYER, tokens)
    prefix = eager[: min(known, len(eager))]
    lazy.adopt(prefix)
    assert lazy.computed == len(prefix) and lazy.all() == eager


def test_adopt_refuses_keys_it_cannot_take() -> None:
    tokens = list(range(3 * BS))
    eager = KEYER.keys(tokens)
    lazy = LazyKeys(KEYER, tokens)
    with pytest.raises(ValueError):
        lazy.adopt([*eager, 1])  # more keys than the tokens have blocks
    lazy.upto(1)
    with pytest.raises(ValueError):
        lazy.adopt(eager[:1])  # keys already computed: adopting would drop or double them
    assert lazy.all() == eager
