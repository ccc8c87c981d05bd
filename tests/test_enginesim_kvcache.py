"""The simulator's KV cache against a reference model (hypothesis state machine).

The reference knows nothing of nodes, splits or heaps: it is a dict of cached block-level
prefixes with a last-access time and a pin count, evicting the least recently used unpinned
prefix that nothing extends. Every operation is applied to both and compared; the
invariants (blocks conserved, pinned blocks never evicted, cached prefixes hold exactly the
tokens stored) are checked after every step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from loadtest.enginesim.kvcache import (
    BIGRAM_BYTES,
    AllBlocksCleared,
    BlockAllocator,
    BlocksRemoved,
    BlocksStored,
    PoolExhausted,
    RadixCache,
    bigram_atoms,
    pack_tokens,
    unpack_tokens,
)

BS = 2  # tokens per block
POOL = 12

Prefix = tuple[tuple[int, ...], ...]


def blocks_of(tokens: list[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + BS]) for i in range(0, len(tokens) - BS + 1, BS)]


class RefCache:
    """Block-prefix model of an LRU prefix cache with pins (the seed's semantics)."""

    def __init__(self) -> None:
        self.cached: dict[Prefix, float] = {}  # prefix -> last access
        self.pins: Counter[Prefix] = Counter()

    def match(self, blocks: list[tuple[int, ...]]) -> int:
        n = 0
        while n < len(blocks) and tuple(blocks[: n + 1]) in self.cached:
            n += 1
        return n

    def touch(self, blocks: list[tuple[int, ...]], lo: int, hi: int, now: float) -> None:
        for i in range(lo + 1, hi + 1):
            self.cached[tuple(blocks[:i])] = now

    def pin(self, blocks: list[tuple[int, ...]], lo: int, hi: int, delta: int) -> None:
        for i in range(lo + 1, hi + 1):
            self.pins[tuple(blocks[:i])] += delta

    def evictable(self) -> int:
        return sum(1 for p in self.cached if not self.pins[p])

    def evict_one(self) -> Prefix:
        extended = {p[:-1] for p in self.cached}
        leaves = [p for p in self.cached if not self.pins[p] and p not in extended]
        victim = min(leaves, key=lambda p: self.cached[p])
        del self.cached[victim]
        return victim


@dataclass
class Held:
    tokens: list[int]
    node: Any
    blocks: int  # pinned prefix length in blocks


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(POOL)
        self.cache = RadixCache(self.alloc, BS)
        self.ref = RefCache()
        self.held: list[Held] = []
        self.now = 0.0
        self.block_prefix: dict[int, Prefix] = {}  # from events: block id -> prefix it holds
        self.removed_pinned = False

    @initialize(whole=st.booleans())
    def mode(self, whole: bool) -> None:
        # Exact LRU comparison holds for block-wise trimming; node-wise eviction is checked
        # through the invariants only.
        self.cache.evict_whole_nodes = whole

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    # -- events -> block map ---------------------------------------------------------------

    def apply_events(self) -> list[Prefix]:
        removed: list[Prefix] = []
        for ev in self.cache.take_events():
            if isinstance(ev, BlocksStored):
                parent: Prefix = ()
                if ev.parent_block_id is not None:
                    parent = self.block_prefix[ev.parent_block_id]
                toks = unpack_tokens(ev.tokens)
                for i, b in enumerate(ev.block_ids):
                    parent = (*parent, tuple(toks[i * BS : (i + 1) * BS]))
                    assert b not in self.block_prefix
                    self.block_prefix[b] = parent
            elif isinstance(ev, BlocksRemoved):
                for b in ev.block_ids:
                    p = self.block_prefix.pop(b)
                    if self.ref.pins[p]:
                        self.removed_pinned = True
                    removed.append(p)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.block_prefix.clear()
        return removed

    def evict_both(self, n: int) -> None:
        freed = self.cache.evict(n)
        removed = self.apply_events()
        assert len(removed) == freed
        if not self.cache.evict_whole_nodes:
            expected = [self.ref.evict_one() for _ in range(freed)]
            assert sorted(removed) == sorted(expected)
        else:
            for p in removed:
                del self.ref.cached[p]

    # -- rules -----------------------------------------------------------------------------

    def _acquire(self, tokens: list[int], limit: int | None) -> Held:
        blocks = blocks_of(tokens)
        data = pack_tokens(tokens)
        m = self.cache.match(data, limit)
        expect = self.ref.match(blocks[:limit] if limit is not None else blocks)
        assert m.blocks == expect
        pins = self.ref.pins
        assert m.unpinned == sum(1 for i in range(1, expect + 1) if not pins[tuple(blocks[:i])])
        now = self.tick()
        node = self.cache.acquire(m, now)
        self.ref.touch(blocks, 0, m.blocks, now)
        self.ref.pin(blocks, 0, m.blocks, +1)
        return Held(tokens, node, m.blocks)

    def _extend(self, h: Held, k: int) -> None:
        """Cache ``k`` more blocks of ``h`` (evicting first if the pool is short)."""
        blocks = blocks_of(h.tokens)
        short = k - self.alloc.num_free
        if short > 0:
            if short > self.cache.evictable_blocks:
                with pytest.raises(PoolExhausted):
                    self.alloc.allocate(k)
                return
            self.evict_both(short)
        ids = self.alloc.allocate(k)
        now = self.tick()
        h.node = self.cache.insert(h.node, pack_tokens(h.tokens), h.blocks, ids, now)
        self.apply_events()
        for i in range(h.blocks + 1, h.blocks + k + 1):
            self.ref.cached[tuple(blocks[:i])] = now
        self.ref.pin(blocks, h.blocks, h.blocks + k, +1)
        h.blocks += k

    def _release(self, h: Held) -> None:
        now = self.tick()
        self.cache.release(h.node, now)
        blocks = blocks_of(h.tokens)
        self.ref.pin(blocks, 0, h.blocks, -1)
        self.ref.touch(blocks, 0, h.blocks, now)

    @rule(
        tokens=st.lists(st.integers(1, 2), min_size=BS, max_size=8 * BS),
        limit=st.none() | st.integers(0, 8),
        hold=st.booleans(),
    )
    def serve(self, tokens: list[int], limit: int | None, hold: bool) -> None:
        """A request: match, pin, cache the rest of its blocks, maybe finish at once."""
        h = self._acquire(tokens, limit)
        room = len(blocks_of(tokens)) - h.blocks
        if room:
            self._extend(h, room)
        if hold:
            self.held.append(h)
        else:
            self._release(h)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(self.held))
        self.held.remove(h)
        self._release(h)

    @rule(n=st.integers(1, POOL))
    def evict(self, n: int) -> None:
        self.evict_both(min(n, self.cache.evictable_blocks))

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def blocks_conserved(self) -> None:
        assert self.alloc.num_free + self.cache.cached_blocks == POOL
        assert self.cache.cached_blocks == len(self.ref.cached) == len(self.block_prefix)
        assert self.cache.evictable_blocks == self.ref.evictable()

    @invariant()
    def no_pinned_block_evicted(self) -> None:
        assert not self.removed_pinned

    @invariant()
    def cached_prefixes_hold_their_tokens(self) -> None:
        seen: set[Prefix] = set()
        for full, ids, ref in self.cache.nodes():
            toks = unpack_tokens(full)
            assert len(toks) % BS == 0
            start = len(toks) // BS - len(ids)
            for j, b in enumerate(ids):
                prefix = tuple(blocks_of(toks)[: start + j + 1])
                assert self.block_prefix[b] == prefix  # the block holds exactly these tokens
                assert self.ref.pins[prefix] == ref
                seen.add(prefix)
        assert seen == set(self.ref.cached)


CacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheAgainstReference = CacheMachine.TestCase


def test_split_keeps_pinned_boundary() -> None:
    """A node split by a later insert keeps the earlier request's pin where it was."""
    alloc = BlockAllocator(16)
    cache = RadixCache(alloc, 2)
    a = pack_tokens([1, 1, 2, 2, 3, 3, 4, 4])
    first = cache.insert(cache.acquire(cache.match(a), 0.0), a, 0, alloc.allocate(4), 1.0)
    b = pack_tokens([1, 1, 2, 2, 9, 9])
    m = cache.match(b)
    assert m.blocks == 2
    node_b = cache.acquire(m, 2.0)
    cache.insert(node_b, b, 2, alloc.allocate(1), 3.0)
    assert cache.match(a).blocks == 4
    cache.release(first, 4.0)
    assert cache.pinned_blocks == 3  # [1,1][2,2] shared + [9,9]
    assert cache.evict(16) == 2  # only [3,3][4,4] may go
    assert cache.match(a).blocks == 2


def test_duplicate_insert_returns_blocks() -> None:
    alloc = BlockAllocator(8)
    cache = RadixCache(alloc, 2)
    t = pack_tokens([5, 5, 6, 6])
    n1 = cache.acquire(cache.match(t), 0.0)
    n2 = cache.acquire(cache.match(t), 0.0)
    cache.insert(n1, t, 0, alloc.allocate(2), 1.0)
    cache.insert(n2, t, 0, alloc.allocate(2), 1.0)  # same content: blocks go back
    assert cache.cached_blocks == 2 and alloc.num_free == 6
    stored = [e for e in cache.take_events() if isinstance(e, BlocksStored)]
    assert len(stored) == 1


def test_clear_refused_while_pinned() -> None:
    alloc = BlockAllocator(8)
    cache = RadixCache(alloc, 2)
    t = pack_tokens([5, 5, 6, 6])
    node = cache.insert(cache.acquire(cache.match(t), 0.0), t, 0, alloc.allocate(2), 1.0)
    assert not cache.clear()
    cache.release(node, 2.0)
    assert cache.clear()
    assert cache.cached_blocks == 0 and alloc.num_free == 8 and cache.match(t).blocks == 0
    assert isinstance(cache.take_events()[-1], AllBlocksCleared)


def test_bigram_atoms_pair_each_token_with_the_next() -> None:
    assert bigram_atoms(pack_tokens([7, 8, 2**32 - 1])) == pack_tokens([7, 8, 8, 2**32 - 1])
    assert bigram_atoms(pack_tokens([7])) == b"" == bigram_atoms(b"")


def test_cache_over_bigram_atoms_splits_and_matches_on_whole_pairs() -> None:
    """Blocks of 2 bigram atoms (8 bytes each): a block is reused only if all its pairs match,
    so a difference in the token after a block breaks that block's match."""
    alloc = BlockAllocator(8)
    cache = RadixCache(alloc, 2, atom_bytes=BIGRAM_BYTES)
    a = bigram_atoms(pack_tokens([1, 2, 3, 4, 5, 6, 7]))  # 6 atoms: 3 blocks
    node = cache.insert(cache.acquire(cache.match(a), 0.0), a, 0, alloc.allocate(3), 1.0)
    cache.release(node, 1.0)
    (stored,) = cache.take_events()
    assert isinstance(stored, BlocksStored) and stored.tokens == a
    b = bigram_atoms(pack_tokens([1, 2, 3, 4, 9, 6, 7]))  # block 1 is (3,4)(4,9)
    assert cache.match(b).blocks == 1
    assert cache.match(a, max_blocks=2).blocks == 2
    m = cache.match(b)
    node = cache.insert(cache.acquire(m, 2.0), b, 1, alloc.allocate(2), 2.0)
    assert cache.num_nodes == 3 and cache.cached_blocks == 5  # split after block 0
    assert sorted(len(t) for t, _, _ in cache.nodes()) == [16, 48, 48]
