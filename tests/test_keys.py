"""Canonical block keys: the contract between agent and gateway."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.keys import BlockKeyer, InvalidTokens, PrefixKeys, reference_keys
from gateway.tokenization import Tokenizer, bundled_test_tokenizer

#: Pinned test vector (also in docs/protocol.md): changing the key function breaks every
#: deployed agent/gateway pair, so it must be a deliberate protocol version change.
VECTOR_SEED = "kvroute-test-vector"
VECTOR_ROOT = 0x7BBE34DCF7BAE205
VECTOR_KEYS = [15225148760064851001, 15175461092400971817]

tokens = st.lists(st.integers(0, 2**31 - 1), max_size=200)
#: both implementations of the key function: the numpy path and the compiled one (which must
#: have been built: tests/test_ckeys.py::test_compiled_module_is_built)
paths = pytest.mark.parametrize("native", [False, True], ids=["numpy", "compiled"])


@paths
def test_pinned_vector(native: bool) -> None:
    k = BlockKeyer(VECTOR_SEED, 16, native=native)
    assert k.root_state() == VECTOR_ROOT
    assert k.keys(list(range(1, 33))) == VECTOR_KEYS


@paths
@settings(max_examples=200, deadline=None)
@given(tokens, st.sampled_from([1, 2, 16, 64, 100, 512]))
def test_vectorised_equals_reference_recurrence(native: bool, toks: list[int], bs: int) -> None:
    k = BlockKeyer("s", bs, native=native)
    assert k.keys(toks) == reference_keys(k, toks)
    assert k.keys(np.array(toks, dtype=np.int64)) == reference_keys(k, toks)


@paths
@settings(max_examples=200, deadline=None)
@given(tokens, st.integers(0, 200))
def test_chain_continues_from_any_parent(native: bool, toks: list[int], cut: int) -> None:
    k = BlockKeyer("s", 4, native=native)
    full = k.keys(toks)
    b = min(cut // 4, len(full))
    if b:
        assert k.keys(toks[4 * b :], parent=full[b - 1]) == full[b:]
    assert k.extend(full[:b], toks) == full


@paths
@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(tokens, st.one_of(st.none(), st.integers(0, 2**64 - 1))), max_size=12),
    st.sampled_from([1, 4, 16, 100]),
)
def test_keys_many_equals_keys_and_reference(
    native: bool, chains: list[tuple[list[int], int | None]], bs: int
) -> None:
    """The agent's batched path (``keys_many``) is the single-chain path, chain by chain."""
    k = BlockKeyer("s", bs, native=native)
    many = k.keys_many(chains)
    assert many == [k.keys(t, p) for t, p in chains]
    assert many == [reference_keys(k, t, p) for t, p in chains]


@paths
def test_input_types_and_the_unkeyed_tail(native: bool) -> None:
    """Lists, tuples and arrays key alike; tokens past the last full block are never read."""
    k = BlockKeyer("s", 16, native=native)
    toks = list(range(5, 5 + 16 * 40))
    want = reference_keys(k, toks)
    assert k.keys(toks) == k.keys(tuple(toks)) == k.keys(np.array(toks, np.uint32)) == want
    assert k.keys([*toks, -1]) == k.keys([*toks, "x", 2**70]) == want  # type: ignore[list-item]
    assert k.keys(toks[:-1]) == want[:-1]
    for bad in ([*toks[:16], -1, *toks[17:]], [*toks[:31], 2**64]):
        with pytest.raises(InvalidTokens):
            k.keys(bad)


@paths
def test_partial_tail_is_never_keyed_and_keys_are_64_bit(native: bool) -> None:
    k = BlockKeyer("s", 16, native=native)
    assert k.keys(list(range(15))) == []
    ks = k.keys(list(range(16 * 50 + 7)))
    assert len(ks) == 50 and len(set(ks)) == 50
    assert all(0 <= x < 2**64 for x in ks)


def test_seed_and_block_size_change_every_key() -> None:
    toks = list(range(64))
    a = BlockKeyer("a", 16).keys(toks)
    assert set(a).isdisjoint(BlockKeyer("b", 16).keys(toks))
    assert set(a).isdisjoint(BlockKeyer("a", 32).keys(toks))


@paths
def test_prefix_identity(native: bool) -> None:
    """Equal keys at block i <=> equal token prefixes (no collisions on near-misses)."""
    k = BlockKeyer("s", 16, native=native)
    base = list(range(1000, 1000 + 16 * 8))
    ka = k.keys(base)
    for pos in range(0, len(base), 7):
        other = list(base)
        other[pos] += 1
        kb = k.keys(other)
        first = pos // 16
        assert ka[:first] == kb[:first]
        assert all(x != y for x, y in zip(ka[first:], kb[first:], strict=True))


@paths
@pytest.mark.parametrize("bad", [[-1] + [0] * 15, [2**31] + [0] * 15, ["x"] * 16, [1.5] * 16])
def test_invalid_tokens_rejected(bad: list, native: bool) -> None:
    with pytest.raises(InvalidTokens):
        BlockKeyer("s", 16, native=native).keys(bad)


@paths
def test_bad_arguments(native: bool) -> None:
    with pytest.raises(ValueError):
        BlockKeyer("s", 0)
    k = BlockKeyer("s", 16, native=native)
    with pytest.raises(ValueError):
        k.keys(list(range(16)), parent=-1)
    with pytest.raises(ValueError):
        k.extend([1, 2, 3], list(range(16)))


# -- PrefixKeys: follow-up turns hash only their new blocks ----------------------------------


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 10),  # which remembered prefix to start from (beyond: none)
            st.lists(st.integers(0, 50_000), max_size=60),  # the new tokens
            st.integers(0, 70),  # where this request's remembered prefix ends
        ),
        min_size=1,
        max_size=12,
    ),
    capacity=st.sampled_from([0, 40, 10_000]),
)
def test_prefix_keys_equal_full_keys(
    steps: list[tuple[int, list[int], int]], capacity: int
) -> None:
    """Against the plain key function: whatever prefix a request reuses (memoised or
    evicted) and whatever it leaves for the next, its keys are those of its whole ids."""
    keyer = BlockKeyer("s", 4)
    memo = PrefixKeys(keyer, capacity)
    remembered: list[tuple[int, ...]] = []
    for pick, new, cut in steps:
        reused = remembered[pick] if pick < len(remembered) else ()
        ids = [*reused, *new]
        keep = tuple(ids[:cut]) if len(reused) < cut <= len(ids) else None
        assert memo.keys(ids, reused, keep) == keyer.keys(ids)
        if keep is not None:
            remembered.append(keep)
        assert memo.tokens <= capacity


def test_follow_up_turns_reuse_the_keys_of_the_remembered_prefix() -> None:
    """With the real tokenizer and template: each turn of a conversation starts from the
    prefix the previous one left, and its keys chain on from that prefix's keys."""
    tok = Tokenizer.load(bundled_test_tokenizer(), "deepseek-v3")
    keyer = BlockKeyer("s", 16)
    memo = PrefixKeys(keyer, 100_000)
    chat = [{"role": "system", "content": "You are terse. " * 80}]
    for turn in range(4):
        chat.append({"role": "user", "content": f"Question {turn}: " + "why? " * 40})
        ids = asyncio.run(tok.aencode_chat_ids(chat))
        assert ids.ids == tok.encode(tok.render_chat(chat), add_special_tokens=False)
        assert memo.keys(ids.ids, ids.reused, ids.remembered) == keyer.keys(ids.ids)
        assert memo.hits == turn  # the first turn has nothing to start from
        chat.append({"role": "assistant", "content": f"Answer {turn}. " * 60})
    assert len(memo) == 4 and memo.misses == 1
