"""Canonicalisation: engine blocks of any size → the core's canonical keys, exactly."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.contract.wire import Cleared, Removed, Stored
from gateway.routing.keys import BlockKeyer
from worker_agent.canonical import RankCanonicaliser
from worker_agent.engines.decode import BlockRemoved, BlockStored
from worker_agent.mirror import WorkerMirror, build_chains

KEYER = BlockKeyer("test-seed", 16)


def engine_blocks(tokens: list[int], bs: int, salt: str = "") -> list[tuple[str, list[int]]]:
    """(hash, tokens) of the full engine blocks; a hash names the whole prefix."""
    out = []
    for b in range(len(tokens) // bs):
        out.append((f"{salt}{tokens[: (b + 1) * bs]}", tokens[b * bs : (b + 1) * bs]))
    return out


def store_all(canon: RankCanonicaliser, blocks: list, cuts: list[int], bs: int) -> list:
    """Store ``blocks`` as events split at ``cuts``; returns the chains published."""
    chains = []
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(blocks))), len(blocks)]
    for lo, hi in itertools.pairwise(bounds):
        run = blocks[lo:hi]
        parent = blocks[lo - 1][0] if lo else None
        ev = BlockStored([h for h, _ in run], parent, [t for _, b in run for t in b], bs)
        chains.extend(canon.stored(ev))
    return chains


@settings(max_examples=150, deadline=None)
@given(
    bs=st.sampled_from([1, 3, 5, 16, 24, 32, 64]),
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=300),
    cuts=st.lists(st.integers(0, 300), max_size=8),
)
def test_rechunked_keys_equal_whole_sequence_keys(
    bs: int, tokens: list[int], cuts: list[int]
) -> None:
    canon = RankCanonicaliser(KEYER)
    blocks = engine_blocks(tokens, bs)
    chains = store_all(canon, blocks, cuts, bs)
    covered = len(blocks) * bs
    expected = KEYER.keys(tokens[:covered])
    published = [k for _, chain in chains for k in chain]
    assert published == expected  # in order, each once
    prev = None
    for parent, chain in chains:  # every chain hangs off the key before it
        assert parent == prev
        prev = chain[-1]


@settings(max_examples=60, deadline=None)
@given(
    bs=st.sampled_from([1, 5, 16, 64]),
    a=st.lists(st.integers(0, 1000), min_size=16, max_size=200),
    b_tail=st.lists(st.integers(0, 1000), min_size=1, max_size=100),
    split=st.integers(0, 200),
)
def test_branches_share_prefix_keys(bs: int, a: list[int], b_tail: list[int], split: int) -> None:
    canon = RankCanonicaliser(KEYER)
    blocks_a = engine_blocks(a, bs)
    store_all(canon, blocks_a, [], bs)
    shared = min(split, len(blocks_a)) * bs  # branch at an engine block boundary
    b = a[:shared] + b_tail
    blocks_b = engine_blocks(b, bs)[shared // bs :]
    if blocks_b:
        parent = blocks_a[shared // bs - 1][0] if shared else None
        canon.stored(
            BlockStored([h for h, _ in blocks_b], parent, [t for _, x in blocks_b for t in x], bs)
        )
    cov_a = len(blocks_a) * bs
    cov_b = (len(b) // bs) * bs
    assert canon.held == set(KEYER.keys(a[:cov_a])) | set(KEYER.keys(b[:cov_b]))


def test_leaf_evictions_follow_the_engine() -> None:
    """Random stores and leaf evictions: held keys == keys of what the engine still holds."""
    rng = random.Random(7)
    for bs in (1, 5, 16, 64):
        canon = RankCanonicaliser(KEYER)
        held: dict[str, tuple[str | None, list[int]]] = {}
        prefixes: list[list[int]] = []
        for step in range(100):
            if rng.random() < 0.6 or not held:
                base = rng.choice(prefixes) if prefixes and rng.random() < 0.6 else []
                toks = base[: rng.randint(0, min(len(base), 160))] + [
                    rng.randrange(1000) for _ in range(rng.randint(1, 60))
                ]
                prefixes.append(toks)
                blocks = engine_blocks(toks, bs)
                new = [i for i, (h, _) in enumerate(blocks) if h not in held]
                if not new:
                    continue
                lo = new[0]
                run = blocks[lo:]
                parent = blocks[lo - 1][0] if lo else None
                for i, (h, blk) in enumerate(run):
                    held[h] = (run[i - 1][0] if i else parent, blk)
                canon.stored(
                    BlockStored([h for h, _ in run], parent, [t for _, x in run for t in x], bs)
                )
            else:
                parents = {p for p, _ in held.values()}
                leaves = sorted(h for h in held if h not in parents)
                victims = rng.sample(leaves, min(len(leaves), rng.randint(1, 5)))
                for h in victims:
                    del held[h]
                canon.removed(BlockRemoved(victims))
            if step % 10 == 9:
                assert canon.held == expected_from(held)


def expected_from(held: dict[str, tuple[str | None, list[int]]]) -> set[int]:
    out: set[int] = set()
    for h in held:
        toks: list[int] = []
        cur: str | None = h
        while cur is not None:
            p, blk = held[cur]
            toks[:0] = blk
            cur = p
        out.update(KEYER.keys(toks))
    return out


def test_removing_any_contributor_removes_a_straddling_key() -> None:
    canon = RankCanonicaliser(KEYER)
    toks = list(range(100, 132))
    blocks = engine_blocks(toks, 8)  # 4 engine blocks, 2 canonical blocks
    store_all(canon, blocks, [1, 2, 3], 8)
    k0, k1 = KEYER.keys(toks)
    assert canon.removed(BlockRemoved([blocks[2][0]])) == [k1]
    assert canon.removed(BlockRemoved([blocks[0][0]])) == [k0]
    assert canon.held == set()


def test_store_after_a_missing_ancestor_skips_the_broken_key() -> None:
    canon = RankCanonicaliser(KEYER)
    toks = list(range(1, 33))
    blocks = engine_blocks(toks, 4)  # 8 engine blocks, 2 canonical blocks
    store_all(canon, blocks[:6], [1, 2, 3, 4, 5], 4)  # k0 held, blocks 4-5 start k1
    k0, _k1 = KEYER.keys(toks)
    assert canon.removed(BlockRemoved([blocks[4][0]])) == []  # k1 was not held yet
    run = blocks[6:]
    chains = canon.stored(BlockStored([h for h, _ in run], blocks[5][0], toks[24:], 4))
    assert chains == [] and canon.dropped["broken_prefix"] == 1
    assert canon.held == {k0}


def test_siblings_completing_the_same_key_are_counted() -> None:
    canon = RankCanonicaliser(KEYER)
    a = list(range(64))
    b = a[:16] + list(range(1000, 1048))  # same first canonical block, other engine block
    canon.stored(BlockStored(["A"], None, a, 64))
    canon.stored(BlockStored(["B"], None, b, 64))
    k0 = KEYER.keys(a)[0]
    assert k0 not in canon.removed(BlockRemoved(["A"]))
    assert k0 in canon.held
    assert k0 in canon.removed(BlockRemoved(["B"]))


def test_dropped_media_groups_extras_and_unknown_parents() -> None:
    canon = RankCanonicaliser(KEYER)
    toks = list(range(16))
    for ev in (
        BlockStored(["a"], None, toks, 16, medium="CPU"),
        BlockStored(["b"], None, toks, 16, medium="CPU_PINNED"),
        BlockStored(["c"], None, toks, 16, group_idx=1),
        BlockStored(["d"], None, toks, 16, spec_kind="sliding_window"),
        BlockStored(["e"], None, toks, 16, keyed_extra=True),
        BlockStored(["f"], "nobody", toks, 16),
    ):
        assert canon.stored(ev) == []
    assert canon.removed(BlockRemoved(["a"], medium="CPU")) == []
    assert canon.removed(BlockRemoved(["zz"])) == []
    assert dict(canon.dropped) == {
        "medium": 3,
        "group": 2,
        "extra_keys": 1,
        "unknown_parent": 1,
        "unknown_remove": 1,
    }
    assert canon.held == set() and canon.blocks == {}


def test_gpu_and_cpu_copies_of_a_block_stay_apart() -> None:
    canon = RankCanonicaliser(KEYER)
    toks = list(range(16))
    canon.stored(BlockStored(["h"], None, toks, 16, medium="GPU"))
    canon.stored(BlockStored(["h"], None, toks, 16, medium="CPU"))
    assert canon.removed(BlockRemoved(["h"], medium="CPU")) == []
    assert canon.held == set(KEYER.keys(toks))


def test_mirror_counts_ranks_and_builds_parent_first_chains() -> None:
    m = WorkerMirror()
    assert m.add([(None, [1, 2, 3])]) == [Stored(None, [1, 2, 3])]
    assert m.add([(None, [1, 2]), (2, [4])]) == [Stored(2, [4])]  # rank 2 holds 1, 2 too
    assert m.drop([1, 2]) == []  # still held by the first rank
    assert m.drop([1]) == [Removed([1])]
    assert m.keys() == {2, 3, 4}
    chains = build_chains({1: None, 2: 1, 3: 2, 4: 2, 5: 99, 6: 5}, max_len=2)
    seen: set[int] = set()
    for parent, chain in chains:
        assert parent is None or parent in seen or parent == 99
        seen.update(chain)
        assert len(chain) <= 2
    assert seen == {1, 2, 3, 4, 5, 6}
    assert m.clear() == [Cleared()] and len(m) == 0


@settings(max_examples=80, deadline=None)
@given(
    bs=st.sampled_from([1, 4, 16, 64]),
    chains=st.lists(
        st.tuples(
            st.lists(st.integers(0, 2**31 - 1), max_size=200),
            st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_keys_many_equals_the_keyer(bs: int, chains: list) -> None:
    keyer = BlockKeyer("test-seed", bs)
    assert keyer.keys_many(chains) == [keyer.keys(t, p) for t, p in chains]


def test_a_wave_of_many_stores_is_keyed_at_once() -> None:
    canon = RankCanonicaliser(KEYER)
    rng = random.Random(3)
    seqs = [[rng.randrange(1000) for _ in range(48)] for _ in range(12)]
    evs = [BlockStored([f"{i}-{b}" for b in range(3)], None, s, 16) for i, s in enumerate(seqs)]
    evs[5] = BlockStored(["bad"], None, [-1] * 16, 16)  # invalid tokens: counted, skipped
    out = canon.stored_many(evs)
    assert out[5] == [] and canon.bad["tokens"] == 1
    for i, s in enumerate(seqs):
        if i != 5:
            assert out[i] == [(None, KEYER.keys(s))]


def test_mla_group_is_indexed() -> None:
    """DeepSeek-V3/R1, Kimi-K2: one group of kind ``mla_attention``."""
    canon = RankCanonicaliser(KEYER)
    toks = list(range(64))
    blocks = engine_blocks(toks, 16)
    ev = BlockStored([h for h, _ in blocks], None, toks, 16, group_idx=0, spec_kind="mla_attention")
    assert canon.stored(ev) == [(None, KEYER.keys(toks))]
    assert canon.group == 0 and not canon.dropped


def _grouped(canon: RankCanonicaliser, kinds: list[str], blocks: list, parent: object) -> list:
    """Store ``blocks`` once per group, as vLLM does: same hashes, group order."""
    chains = []
    for g, kind in enumerate(kinds):
        ev = BlockStored(
            [h for h, _ in blocks],
            parent,
            [t for _, b in blocks for t in b],
            16,
            group_idx=g,
            spec_kind=kind,
        )
        chains.extend(canon.stored(ev))
    return chains


def test_hybrid_model_indexes_its_full_attention_group_by_kind_not_index() -> None:
    """gpt-oss / Gemma 3: sliding-window groups come first. The full-attention group is
    chosen by kind, and the sliding-window copies of the same hashes never touch it."""
    kinds = ["sliding_window", "sliding_window", "full_attention"]
    canon = RankCanonicaliser(KEYER)
    toks = list(range(96))
    blocks = engine_blocks(toks, 16)
    chains = _grouped(canon, kinds, blocks[:4], None)
    chains += _grouped(canon, kinds, blocks[4:], blocks[3][0])
    assert canon.group == 2
    assert {k for _, run in chains for k in run} == set(KEYER.keys(toks)) == canon.held
    assert canon.dropped["group"] == 2 * 6  # each sliding-window copy of six blocks
    # The sliding-window groups free their early blocks first: same hashes, other groups.
    for g in (0, 1):
        for h, _ in blocks[:4]:
            assert canon.removed(BlockRemoved([h], "GPU", group_idx=g)) == []
    assert canon.held == set(KEYER.keys(toks))
    # The full-attention group's own removal does remove.
    gone = canon.removed(BlockRemoved([blocks[5][0]], "GPU", group_idx=2))
    assert gone == [KEYER.keys(toks)[5]]


def test_group_selection_is_forgotten_on_clear() -> None:
    canon = RankCanonicaliser(KEYER)
    toks = list(range(16))
    ((h, _),) = engine_blocks(toks, 16)
    canon.stored(BlockStored([h], None, toks, 16, group_idx=1, spec_kind="full_attention"))
    assert canon.group == 1
    canon.cleared()
    assert canon.group is None
    canon.stored(BlockStored([h], None, toks, 16, group_idx=0, spec_kind="mla_attention"))
    assert canon.group == 0 and canon.held == set(KEYER.keys(toks))


def test_groups_without_kinds_keep_group_zero_only() -> None:
    """vLLM before kinds were published: group 0 is the plain model's one group."""
    canon = RankCanonicaliser(KEYER)
    toks = list(range(32))
    blocks = engine_blocks(toks, 16)
    hashes = [h for h, _ in blocks]
    assert canon.stored(BlockStored(hashes, None, toks, 16, group_idx=1)) == []
    assert canon.stored(BlockStored(hashes, None, toks, 16, group_idx=0)) != []
    assert canon.held == set(KEYER.keys(toks))
