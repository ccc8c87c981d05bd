"""The compiled key function (gateway/routing/_keys.c) against the numpy path and the
reference recurrence: the same keys and the same errors for every input either accepts.

tests/test_keys.py runs the protocol's tests on both paths; here the two are compared
directly over random seeds, block sizes, parents, adapter roots and input types.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing import _ckeys
from gateway.routing import keys as keys_mod
from gateway.routing.keys import BlockKeyer, InvalidTokens, native_available, reference_keys

block_sizes = st.sampled_from([1, 2, 3, 16, 31, 32, 33, 64, 65, 100, 130])
seeds = st.one_of(st.text(max_size=8), st.binary(max_size=8))
ids = st.lists(st.integers(0, 2**31 - 1), max_size=300)
parents = st.one_of(st.none(), st.integers(0, 2**64 - 1), st.sampled_from(["adapter"]))


def _pair(seed: str | bytes, bs: int) -> tuple[BlockKeyer, BlockKeyer]:
    return BlockKeyer(seed, bs, native=True), BlockKeyer(seed, bs, native=False)


def _root(k: BlockKeyer, parent: int | str | None) -> int | None:
    return k.adapter_root(parent) if isinstance(parent, str) else parent


class _Ids(Sequence[int]):
    """A sequence that is neither a list, a tuple nor a buffer (keyed through slicing)."""

    def __init__(self, items: list[int]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._items[i]


def _forms(toks: list[int]) -> list[object]:
    """The token list in every form the gateway, the agent and the benchmarks hand over."""
    wide = np.zeros(2 * len(toks), dtype=np.int64)
    wide[::2] = toks
    return [
        toks,
        tuple(toks),
        np.array(toks, dtype=np.int64),
        np.array(toks, dtype=np.uint32),
        np.array(toks, dtype=np.int32),
        wide[::2],  # strided
        array.array("Q", toks),
        _Ids(toks),
        [np.int64(t) for t in toks],  # ints by __index__
    ]


def test_compiled_module_is_built() -> None:
    """``pip install`` (scripts/setup) must have built it: this fails, not skips, if not."""
    assert native_available()
    assert BlockKeyer("s").native and not BlockKeyer("s", native=False).native


@settings(max_examples=300, deadline=None)
@given(seeds, block_sizes, ids, parents)
def test_compiled_equals_numpy_and_reference(
    seed: str | bytes, bs: int, toks: list[int], parent: int | str | None
) -> None:
    c, n = _pair(seed, bs)
    root = _root(c, parent)
    want = reference_keys(c, toks, root)
    assert n.keys(toks, root) == want
    for form in _forms(toks):
        assert c.keys(form, root) == want  # type: ignore[arg-type]
    assert c.root_state() == n.root_state() and _root(n, parent) == root


@settings(max_examples=100, deadline=None)
@given(
    seeds,
    block_sizes,
    st.lists(st.tuples(ids, parents), max_size=8),
)
def test_keys_many_and_extend_agree(
    seed: str | bytes, bs: int, chains: list[tuple[list[int], int | str | None]]
) -> None:
    c, n = _pair(seed, bs)
    plain = [(t, _root(c, p)) for t, p in chains]
    want = [reference_keys(c, t, p) for t, p in plain]
    assert c.keys_many(plain) == n.keys_many(plain) == want
    for (t, p), w in zip(plain, want, strict=True):
        half = w[: len(w) // 2]
        assert c.extend(half, t, p) == n.extend(half, t, p) == w


@settings(max_examples=200, deadline=None)
@given(
    block_sizes,
    ids,
    st.integers(0, 10_000),
    st.sampled_from([-1, -(2**63), 2**31, 2**32, 2**64, 2**70, 1.5, "x", None, b"\x01"]),
)
def test_invalid_ids_fail_alike(bs: int, toks: list[int], where: int, bad: object) -> None:
    """An invalid id in a keyed block raises InvalidTokens on both paths; past the last full
    block it is never read."""
    c, n = _pair("s", bs)
    bad_toks: list[object] = list(toks)
    bad_toks.insert(where % (len(toks) + 1), bad)
    keyed = (len(bad_toks) // bs) * bs
    if where % (len(toks) + 1) < keyed:
        for k in (c, n):
            with pytest.raises(InvalidTokens):
                k.keys(bad_toks)  # type: ignore[arg-type]
            with pytest.raises(InvalidTokens):
                k.keys(tuple(bad_toks))  # type: ignore[arg-type]
    else:
        assert c.keys(bad_toks) == n.keys(bad_toks) == reference_keys(c, toks)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "arr",
    [
        np.array([-1] + [0] * 15, dtype=np.int64),
        np.array([2**31] + [0] * 15, dtype=np.int64),
        np.array([2**63] + [0] * 15, dtype=np.uint64),
        np.array([-1] + [0] * 15, dtype=np.int8),
        array.array("q", [-5] * 16),
    ],
)
def test_invalid_buffers_fail_alike(arr: object) -> None:
    for native in (True, False):
        with pytest.raises(InvalidTokens):
            BlockKeyer("s", 16, native=native).keys(arr)  # type: ignore[arg-type]


def test_non_integer_arrays_take_the_numpy_path() -> None:
    """A buffer the compiled function does not read (floats, 2-D) is keyed as before."""
    toks = np.arange(64, dtype=np.float64)
    c, n = _pair("s", 16)
    assert c.keys(toks) == n.keys(toks) == reference_keys(c, list(range(64)))  # type: ignore[arg-type]


@pytest.mark.parametrize("parent", [-1, 2**64, 1.5, "x"])
def test_bad_parents_fail_alike(parent: object) -> None:
    toks = list(range(64))
    errors = []
    for native in (True, False):
        with pytest.raises((ValueError, TypeError)) as exc:
            BlockKeyer("s", 16, native=native).keys(toks, parent)  # type: ignore[arg-type]
        errors.append(exc.type)
    assert errors[0] is errors[1]


def test_a_list_shrinking_while_keyed_is_an_error_not_a_crash() -> None:
    """``__index__`` runs Python code that may shrink the list being read."""
    toks: list[object] = list(range(32))

    class Shrinks:
        def __index__(self) -> int:
            del toks[4:]
            return 3

    toks[2] = Shrinks()
    with pytest.raises(RuntimeError):
        BlockKeyer("s", 16, native=True).keys(toks)  # type: ignore[arg-type]


def test_without_the_compiled_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where it did not build, keyers use the numpy path and ``native=True`` says why."""
    monkeypatch.setattr(keys_mod, "_native_keys", None)
    assert not native_available()
    k = BlockKeyer("s", 16)
    assert not k.native
    assert k.keys(list(range(64))) == reference_keys(k, list(range(64)))
    with pytest.raises(ImportError):
        BlockKeyer("s", 16, native=True)


@settings(max_examples=200, deadline=None)
@given(block_sizes, ids, st.integers(0, 320), st.one_of(st.none(), st.integers(0, 320)), parents)
def test_a_range_is_keyed_in_place_as_its_slice(
    bs: int, toks: list[int], start: int, stop: int | None, parent: int | str | None
) -> None:
    """``keys(tokens, parent, start, stop)`` is ``keys(tokens[start:stop], parent)`` (LazyKeys
    and ``extend`` key a prompt's later blocks without copying them out)."""
    c, n = _pair("s", bs)
    root = _root(c, parent)
    if stop is not None and stop < start:
        for k in (c, n):
            with pytest.raises(ValueError):
                k.keys(toks, root, start, stop)
        return
    want = reference_keys(c, toks[start:stop], root)
    assert n.keys(toks, root, start, stop) == want
    for form in _forms(toks):
        assert c.keys(form, root, start, stop) == want  # type: ignore[arg-type]


def test_a_sequence_shorter_than_its_length_is_an_error() -> None:
    class Lies(_Ids):
        def __len__(self) -> int:
            return len(self._items) + 32

    toks = Lies(list(range(32)))
    for native in (True, False):
        with pytest.raises(ValueError):
            BlockKeyer("s", 16, native=native).keys(toks)


def test_the_compiled_function_checks_its_constants() -> None:
    """Its arguments come from BlockKeyer; wrong ones are errors, never wrong keys."""
    good = BlockKeyer("s", 16)._native_consts
    toks = list(range(32))
    with pytest.raises(TypeError):
        _ckeys.keys(toks, None)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _ckeys.keys(toks, None, list(good))  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # r of another block size
        _ckeys.keys(toks, None, (good[0], 8, *good[2:]))
    with pytest.raises(ValueError):  # a base that is no residue
        _ckeys.keys(toks, None, (*good[:2], 2**32, *good[3:]))
    with pytest.raises(OverflowError):
        _ckeys.keys(toks, None, (*good[:4], -1, *good[5:]))
