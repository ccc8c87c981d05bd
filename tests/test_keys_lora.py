"""LoRA adapter chains: an adapter's blocks are keyed on a chain of their own.

The base model's keys must stay bit-identical (no protocol break for base models); an
adapter's chain must never meet the base chain or another adapter's.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.keys import BlockKeyer, PrefixKeys, reference_keys

#: Pinned (also in docs/protocol.md): seed "kvroute", C = 16, adapter "sql-lora", tokens 1..32.
ADAPTER_ROOT = 0x6172FE4796FBCBFC
ADAPTER_KEYS = [0x8AD72617906B8E79, 0x90C7311F985690E8]
#: The base vector of docs/protocol.md, unchanged by adapters.
BASE_ROOT = 0x5225DCA7204E7F27
BASE_KEYS = [0xD732EA8CFEAA54D1, 0x8865F1C43F0B41D1]

tokens = st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=160)
names = st.text(min_size=1, max_size=20)


def test_pinned_adapter_vector_and_base_unchanged() -> None:
    k = BlockKeyer("kvroute", 16)
    assert k.root_state() == BASE_ROOT
    assert k.keys(list(range(1, 33))) == BASE_KEYS
    assert k.adapter_root(None) is None
    assert k.adapter_root("sql-lora") == ADAPTER_ROOT
    assert k.keys(list(range(1, 33)), k.adapter_root("sql-lora")) == ADAPTER_KEYS
    assert k.keys(list(range(1, 33))) == BASE_KEYS  # asking for an adapter changes nothing


@settings(max_examples=100, deadline=None)
@given(toks=tokens, bs=st.sampled_from([1, 4, 16, 64]), name=names)
def test_adapter_keys_follow_the_recurrence_from_the_adapter_start(
    toks: list[int], bs: int, name: str
) -> None:
    k = BlockKeyer("s", bs)
    root = k.adapter_root(name)
    assert root is not None and 0 < root < 2**64
    assert k.keys(toks, root) == reference_keys(k, toks, root)
    assert k.keys(toks) == reference_keys(k, toks)  # the base: the reference from S
    assert k.keys_many([(toks, root), (toks, None)]) == [k.keys(toks, root), k.keys(toks)]


@settings(max_examples=100, deadline=None)
@given(a=tokens, b=tokens, n1=names, n2=names)
def test_adapter_chains_are_disjoint_from_base_and_each_other(
    a: list[int], b: list[int], n1: str, n2: str
) -> None:
    k = BlockKeyer("s", 16)
    base = set(k.keys(a)) | set(k.keys(b))
    one = set(k.keys(a, k.adapter_root(n1))) | set(k.keys(b, k.adapter_root(n1)))
    assert not base & one
    if n1 != n2:
        two = set(k.keys(a, k.adapter_root(n2))) | set(k.keys(b, k.adapter_root(n2)))
        assert not one & two and not base & two
        assert k.adapter_root(n1) != k.adapter_root(n2)


def test_adapter_root_depends_on_seed_and_block_size() -> None:
    roots = {BlockKeyer(seed, bs).adapter_root("a") for seed in ("s1", "s2") for bs in (16, 32)}
    assert len(roots) == 4


def test_prefix_keys_keep_base_and_adapter_chains_of_one_prefix_apart() -> None:
    keyer = BlockKeyer("s", 4)
    memo = PrefixKeys(keyer, 10_000)
    root = keyer.adapter_root("lora-a")
    prefix = tuple(range(40))
    ids = [*prefix, 7, 8, 9, 10, 11]
    assert memo.keys(ids, (), prefix) == keyer.keys(ids)
    assert memo.keys(ids, prefix, None, root) == keyer.keys(ids, root)  # not the base's
    assert memo.keys(ids, (), prefix, root) == keyer.keys(ids, root)
    assert memo.keys(ids, prefix, None, root) == keyer.keys(ids, root)  # memoised now
    assert memo.keys(ids, prefix) == keyer.keys(ids)
    assert memo.hits == 2
