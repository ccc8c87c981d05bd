"""KV cache of one simulated worker: a block pool and a token radix tree over it (seed design).

Pure and synchronous. Two decoupled parts:

* ``BlockAllocator`` — a fixed pool of ``num_blocks`` block ids with a free list. It knows
  nothing about tokens.
* ``RadixCache`` — a radix tree over token ids whose nodes hold runs of *full* blocks. A node
  splits at the mismatch index, always on a block boundary. Running requests pin their node
  and its ancestors with reference counts; unpinned leaves are evicted least recently used
  first, and a parent left childless becomes a candidate right after.

Token ids are stored as ``uint32`` little-endian ``bytes`` (4 bytes per token): comparing a
prompt against a node is one ``bytes.startswith`` (a memcmp), not a Python loop, and the same
bytes are what SGLang hashes. Work is per node, never per token.

The tree's key *atoms* have a configurable width (``atom_bytes``): by default one token, but
SGLang with EAGLE/MTP speculative decoding keys its tree by bigrams ``(t_i, t_i+1)``, which
are 8-byte atoms here (``bigram_atoms``: t_i then t_i+1, both uint32 LE). A block then holds
``block_size`` atoms, one per KV slot, and the tree neither knows nor cares what an atom
means; the caller converts tokens to atoms.

LoRA adapters: blocks computed with an adapter hold other KV than the base model's for the
same tokens, so each adapter has a tree of its own (a root per adapter, one block pool and
one LRU for all); ``lora`` selects it, and stored events name it.

Cache changes are recorded as neutral events (``BlocksStored`` / ``BlocksRemoved`` /
``AllBlocksCleared``) naming physical block ids; ``events.py`` turns them into an engine's
wire format and hashes.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Union

import numpy as np
from mypy_extensions import mypyc_attr

__all__ = [
    "BIGRAM_BYTES",
    "TOKEN_BYTES",
    "AllBlocksCleared",
    "BlockAllocator",
    "BlocksRemoved",
    "BlocksStored",
    "CacheMatch",
    "KVEvent",
    "PoolExhausted",
    "RadixCache",
    "bigram_atoms",
    "pack_tokens",
    "unpack_tokens",
]

TOKEN_BYTES = 4
BIGRAM_BYTES = 2 * TOKEN_BYTES


def pack_tokens(tokens: Sequence[int] | bytes) -> bytes:
    """Token ids as uint32 little-endian bytes (bytes pass through unchanged)."""
    if isinstance(tokens, bytes):
        return tokens
    return array("I", tokens).tobytes()  # this platform is little-endian (x86-64, arm64)


def unpack_tokens(data: bytes) -> list[int]:
    out = array("I")
    out.frombytes(data)
    return out.tolist()


def bigram_atoms(tokens_le: bytes) -> bytes:
    """Packed tokens ``t_0..t_n-1`` -> the n-1 bigram atoms ``t_i || t_i+1`` (8 bytes each).

    Vectorised (numpy), no loop per token.
    """
    t = np.frombuffer(tokens_le, dtype="<u4")
    if len(t) < 2:
        return b""
    out = np.empty((len(t) - 1, 2), dtype="<u4")
    out[:, 0] = t[:-1]
    out[:, 1] = t[1:]
    return out.tobytes()


# -- neutral events --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive new blocks chained under ``parent_block_id`` (None: the first block)."""

    block_ids: list[int]
    parent_block_id: int | None
    tokens: bytes  # the blocks' key atoms: uint32 LE tokens (or bigrams), block_size per block
    lora: str | None = None  # the LoRA adapter the blocks were computed with


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks evicted from one node, in tree order (shallowest first)."""

    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole cache was reset."""


KVEvent = Union[BlocksStored, BlocksRemoved, AllBlocksCleared]  # noqa: UP007 - runtime alias


# -- block pool ------------------------------------------------------------------------------


@mypyc_attr(native_class=False)  # compiled: an exception stays a Python class
class PoolExhausted(RuntimeError):
    """More blocks were asked for than are free."""


class BlockAllocator:
    """A fixed pool of block ids with a LIFO free list (allocation is a slice, no loop)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} blocks, {len(self._free)} free")
        if n <= 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        return out

    def free(self, blocks: Iterable[int]) -> None:
        self._free.extend(blocks)


# -- radix tree ------------------------------------------------------------------------------


class _Node:
    __slots__ = (
        "blocks", "children", "key", "last_access", "lora", "parent", "ref", "stamp", "tokens",
    )  # fmt: skip

    def __init__(
        self,
        parent: _Node | None,
        tokens: bytes,
        blocks: list[int],
        key: bytes,
        lora: str | None = None,
    ) -> None:
        self.parent = parent
        self.lora: str | None = parent.lora if parent is not None else lora  # its tree
        self.tokens = tokens
        self.blocks = blocks
        self.key = key  # first block's token bytes: the key in the parent's children
        self.children: dict[bytes, _Node] = {}
        self.ref = 0  # requests whose pinned path runs through this node
        self.last_access = 0.0
        self.stamp = -1  # id of this node's live entry in the eviction heap


@dataclass(slots=True)
class CacheMatch:
    """Result of a lookup: ``blocks`` full blocks of the query are cached.

    ``unpinned`` counts the matched blocks nobody pins yet (pinning them takes them out of
    the evictable set). Pass it to ``RadixCache.acquire`` unchanged and before any other
    change to the cache.
    """

    blocks: int
    unpinned: int
    _node: _Node = field(repr=False)
    _partial: _Node | None = field(default=None, repr=False)
    _partial_blocks: int = 0


class RadixCache:
    """Token radix tree over a ``BlockAllocator`` (see the module docstring).

    ``evict_whole_nodes`` selects SGLang's behaviour (evict a leaf node at a time); by
    default only as many blocks as needed are trimmed from the LRU leaf's tail, as vLLM
    frees blocks one by one. ``atom_bytes`` is the width of one key atom (a block holds
    ``block_size`` of them): ``TOKEN_BYTES``, or ``BIGRAM_BYTES`` for bigram keys; every
    ``tokens`` argument is then a sequence of such atoms.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        *,
        evict_whole_nodes: bool = False,
        record_events: bool = True,
        atom_bytes: int = TOKEN_BYTES,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if atom_bytes < 1:
            raise ValueError(f"atom_bytes must be >= 1, got {atom_bytes}")
        self.allocator = allocator
        self.block_size = block_size
        self.atom_bytes = atom_bytes
        self.evict_whole_nodes = evict_whole_nodes
        self.record_events = record_events
        self._bb = block_size * atom_bytes  # bytes per block
        self._root = _Node(None, b"", [], b"")
        self._roots: dict[str | None, _Node] = {None: self._root}  # a tree per LoRA adapter
        self._heap: list[tuple[float, int, _Node]] = []
        self._stamp = 0
        self._nodes = 0
        self.cached_blocks = 0  # blocks held by the tree
        self.pinned_blocks = 0  # of those, blocks in nodes with ref > 0
        self.events: list[KVEvent] = []

    # -- queries ---------------------------------------------------------------------------

    @property
    def evictable_blocks(self) -> int:
        """Blocks that eviction can free (every unpinned node is, leaves first)."""
        return self.cached_blocks - self.pinned_blocks

    @property
    def num_nodes(self) -> int:
        return self._nodes

    def match(
        self, tokens: bytes, max_blocks: int | None = None, lora: str | None = None
    ) -> CacheMatch:
        """Longest cached prefix of ``tokens`` in full blocks (at most ``max_blocks``),
        computed with LoRA adapter ``lora`` (None: the base model).

        Pure: changes nothing, so a scheduler can check that a request fits first.
        """
        bb = self._bb
        limit = len(tokens) // bb * bb
        if max_blocks is not None:
            limit = min(limit, max_blocks * bb)
        node = self._roots.get(lora)
        if node is None:
            node = self._roots[lora] = _Node(None, b"", [], b"", lora)  # an empty tree
        pos, unpinned = 0, 0
        while pos < limit:
            child = node.children.get(tokens[pos : pos + bb])
            if child is None:
                break
            seg = child.tokens
            if len(seg) <= limit - pos and tokens.startswith(seg, pos):
                node, pos = child, pos + len(seg)
                if child.ref == 0:
                    unpinned += len(child.blocks)
                continue
            m = _common_blocks(tokens, pos, limit, seg, bb)
            if child.ref == 0:
                unpinned += m
            return CacheMatch(pos // bb + m, unpinned, node, child, m)
        return CacheMatch(pos // bb, unpinned, node)

    def nodes(self) -> Iterable[tuple[bytes, list[int], int]]:
        """Every node as (full prefix atom bytes, its blocks, ref count), for checks."""
        stack: list[tuple[_Node, bytes]] = [
            (c, b"") for root in self._roots.values() for c in root.children.values()
        ]
        while stack:
            node, prefix = stack.pop()
            full = prefix + node.tokens
            yield full, list(node.blocks), node.ref
            stack.extend((c, full) for c in node.children.values())

    # -- request lifecycle -----------------------------------------------------------------

    def acquire(self, m: CacheMatch, now: float) -> _Node:
        """Pin the matched path (splitting a partly matched node) and return its end node."""
        node = m._node
        if m._partial is not None:
            node = self._split(m._partial, m._partial_blocks)
        self._pin_path(node, None, now)
        return node

    def insert(
        self, at: _Node, tokens: bytes, start_block: int, blocks: list[int], now: float
    ) -> _Node:
        """Cache ``blocks`` holding blocks ``start_block..`` of ``tokens`` below pinned ``at``.

        ``at`` must end exactly at ``start_block`` (it is what ``acquire`` or a previous
        ``insert`` returned). Blocks whose content is already cached (another request got
        there first) go back to the allocator. The caller's pin moves to the returned node.
        """
        bb = self._bb
        pos = start_block * bb
        end = pos + len(blocks) * bb
        node, bi = at, 0
        while pos < end:
            child = node.children.get(tokens[pos : pos + bb])
            if child is None:
                self._add_leaf(node, tokens[pos:end], blocks[bi:], now)
                node = node.children[tokens[pos : pos + bb]]
                break
            seg = child.tokens
            if len(seg) <= end - pos and tokens.startswith(seg, pos):
                m = len(child.blocks)
            else:
                m = _common_blocks(tokens, pos, end, seg, bb)
                child = self._split(child, m)
            self.allocator.free(blocks[bi : bi + m])
            bi += m
            pos += m * bb
            node = child
        self._pin_path(node, at, now)
        return node

    def release(self, node: _Node, now: float) -> None:
        """Unpin a path pinned by ``acquire``/``insert``; its nodes count as used ``now``."""
        while node.parent is not None:
            node.ref -= 1
            node.last_access = now
            if node.ref == 0:
                self.pinned_blocks -= len(node.blocks)
                if not node.children:
                    self._push(node)
            node = node.parent

    def evict(self, n: int) -> int:
        """Free at least ``n`` blocks from unpinned leaves, LRU first; returns blocks freed."""
        freed = 0
        heap = self._heap
        while freed < n and heap:
            _, stamp, node = heapq.heappop(heap)
            if node.stamp != stamp or node.ref or node.children or node.parent is None:
                continue  # stale entry
            take = n - freed
            if not self.evict_whole_nodes and take < len(node.blocks):
                removed = node.blocks[-take:]
                del node.blocks[-take:]
                node.tokens = node.tokens[: -take * self._bb]
                self._push(node)
            else:
                removed = node.blocks
                parent = node.parent
                del parent.children[node.key]
                node.parent = None
                self._nodes -= 1
                if parent.parent is not None and parent.ref == 0 and not parent.children:
                    self._push(parent)
            self.allocator.free(removed)
            self.cached_blocks -= len(removed)
            freed += len(removed)
            if self.record_events:
                self.events.append(BlocksRemoved(list(removed)))
        return freed

    def clear(self) -> bool:
        """Drop everything cached; refused (False) while any block is pinned."""
        if self.pinned_blocks:
            return False
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            self.allocator.free(node.blocks)
            node.parent = None
            stack.extend(node.children.values())
        for root in self._roots.values():
            root.children.clear()
        self._heap.clear()
        self._nodes = 0
        self.cached_blocks = 0
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out

    # -- internals -------------------------------------------------------------------------

    def _add_leaf(self, parent: _Node, tokens: bytes, blocks: list[int], now: float) -> None:
        leaf = _Node(parent, tokens, blocks, tokens[: self._bb])
        leaf.last_access = now
        parent.children[leaf.key] = leaf
        self._nodes += 1
        self.cached_blocks += len(blocks)
        if self.record_events:
            parent_block = parent.blocks[-1] if parent.parent is not None else None
            self.events.append(BlocksStored(list(blocks), parent_block, tokens, leaf.lora))

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut ``node`` after ``m`` blocks; the new upper part is returned.

        The original object keeps the lower part, so a request pinning it still ends where
        it did: a pinned node's end boundary never moves.
        """
        cut = m * self._bb
        parent = node.parent
        assert parent is not None and 0 < m < len(node.blocks)
        upper = _Node(parent, node.tokens[:cut], node.blocks[:m], node.key)
        upper.ref = node.ref
        upper.last_access = node.last_access
        node.tokens = node.tokens[cut:]
        node.blocks = node.blocks[m:]
        node.key = node.tokens[: self._bb]
        node.parent = upper
        upper.children[node.key] = node
        parent.children[upper.key] = upper
        self._nodes += 1
        return upper

    def _pin_path(self, node: _Node, stop: _Node | None, now: float) -> None:
        while node is not stop and node.parent is not None:
            if node.ref == 0:
                self.pinned_blocks += len(node.blocks)
            node.ref += 1
            node.last_access = now
            node = node.parent

    def _push(self, node: _Node) -> None:
        self._stamp += 1
        node.stamp = self._stamp
        heapq.heappush(self._heap, (node.last_access, self._stamp, node))
        if len(self._heap) > 2 * self._nodes + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries (each node has at most one live entry)."""
        self._heap = [
            e
            for e in self._heap
            if e[2].stamp == e[1] and not e[2].ref and not e[2].children and e[2].parent is not None
        ]
        heapq.heapify(self._heap)


def _common_blocks(tokens: bytes, pos: int, limit: int, seg: bytes, bb: int) -> int:
    """Whole blocks ``tokens[pos:limit]`` and ``seg`` share (the first block is known equal).

    Binary search over block-aligned prefixes: O(log n) memcmps instead of a token loop.
    """
    lo, hi = 1, min(len(seg), limit - pos) // bb
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tokens.startswith(seg[: mid * bb], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo
