"""Shadow prefix index: which worker holds which canonical block, and prefix matching.

Pure, synchronous, no I/O: the gateway's event consumer, the offline cluster simulator and
the benchmarks all drive this same object.

Representation: a compressed radix tree over canonical block keys. Because a key names a
whole prefix (``key_i = H(key_{i-1}, block_i)``), every key has exactly one parent and chains
never re-converge, so the keys form a tree. A node is a *run* of consecutive keys that every
worker in the node's ``mask`` holds in full (one bit per worker slot); runs split wherever
the set of holders changes and merge back when it becomes equal again. ``match`` therefore
walks a few nodes and compares each run against the request with one C-level list-slice
comparison, instead of probing a dict per block (a 1M-entry dict costs ~0.25 µs per probe in
cache misses here, 120 µs for an 8k-token prompt). A ``key -> node`` map serves removals.

Speculative entries (a routing decision's keys attributed to the chosen worker for a TTL
until its real events arrive) are bits in ``mask`` that are also in the node's ``spec``; a
real store turns them real, expiry clears only bits that are still speculative.

Rules (docs/protocol.md, "Index semantics"):

* stores and removes are idempotent; duplicates are counted, never double-applied;
* a worker's match stops at its first missing block, whatever it holds further down;
* a store whose parent the worker does not hold is counted (``orphan_stores``) and applied;
  if the parent key is unknown to the index altogether the chain is kept detached and
  attached when the parent appears (it cannot match before that);
* a remove of a key the worker does not hold is counted and ignored;
* a key that arrives under a different parent than the one it is indexed under is a hash
  collision or a broken publisher: counted (``conflicts``) and the rest of that store skipped;
* memory is bounded by what workers hold: nodes nobody holds are pruned at once, except
  empty interior nodes that still lead to held descendants.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat

from gateway.routing.keys import LazyKeys

__all__ = ["IndexStats", "ShadowIndex"]


@dataclass
class IndexStats:
    """Counters exported as metrics by whoever owns the index."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    duplicate_stores: int = 0
    unknown_removes: int = 0
    orphan_stores: int = 0
    conflicts: int = 0
    clears: int = 0
    speculative_blocks: int = 0
    speculative_confirmed: int = 0
    speculative_expired: int = 0


class _Node:
    __slots__ = ("anchor", "children", "keys", "mask", "parent", "spec")

    def __init__(self, keys: list[int], mask: int, spec: int, parent: _Node | None) -> None:
        self.anchor: int | None = None  # placeholders only: the missing parent key
        self.keys = keys
        self.mask = mask  # slots holding every key of the run (really or speculatively)
        self.spec = spec  # the subset of ``mask`` that is speculative
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first key of child run -> child


class ShadowIndex:
    """Which workers hold which canonical block keys; longest-prefix match per worker."""

    def __init__(self, speculative_ttl: float = 5.0) -> None:
        self.speculative_ttl = speculative_ttl
        self.stats = IndexStats()
        self._root = _Node([], 0, 0, None)
        self._node: dict[int, _Node] = {}  # key -> node whose run contains it
        self._detached: dict[int, _Node] = {}  # unknown parent key -> placeholder node
        self._nodes: list[set[_Node]] = []  # slot -> nodes whose mask has the slot's bit
        self._real_blocks: list[int] = []  # slot -> blocks really held
        self._worker: list[str | None] = []  # slot -> worker id
        self._slot: dict[str, int] = {}
        self._free: list[int] = []  # heap of free slots (lowest first keeps masks small)
        self._spec_log: deque[tuple[float, int, list[int]]] = deque()
        self._spec_exp: dict[int, float] = {}  # key | slot << 64 -> latest expiry
        self._decoded: dict[int, list[str]] = {}  # slot mask -> worker ids (match cache)
        #: speculate_later's calls, applied before the index is next read or changed
        self._pending: deque[tuple[str, Sequence[int], float, int]] = deque()
        #: bumped whenever a worker's slot is freed (its bit may then name another worker)
        self.slot_epoch = 0
        #: this index's own speculative inserts as (worker, parent, keys), for the gateway to
        #: share with its replicas (``gateway/placements.py``, which drains it); None: not kept
        self.outbox: list[tuple[str, int | None, list[int]]] | None = None

    # -- workers ----------------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        """Make ``worker`` known (stores do this implicitly)."""
        if self._pending:
            self.settle()
        self._slot_of(worker)

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` and everything it held; its slot becomes reusable."""
        if self._pending:
            self.settle()
        slot = self._slot.get(worker)
        if slot is None:
            return
        self._clear_slot(slot)
        self._forget_speculation(slot)
        del self._slot[worker]
        self._worker[slot] = None
        self._decoded.clear()
        heapq.heappush(self._free, slot)
        self.slot_epoch += 1

    def workers(self) -> list[str]:
        return list(self._slot)

    def bit(self, worker: str) -> int:
        """The bit of ``worker`` in match masks (``match_masks``); makes the worker known.
        A bit stays the worker's until ``remove_worker`` (``slot_epoch`` then changes)."""
        return 1 << self._slot_of(worker)

    def __contains__(self, worker: object) -> bool:
        return worker in self._slot

    # -- events -----------------------------------------------------------------------------

    def stored(self, worker: str, parent: int | None, keys: Sequence[int]) -> None:
        """``worker`` now holds ``keys``: a chain whose first block follows ``parent``."""
        if self._pending:
            self.settle()
        if not keys:
            return
        slot = self._slot_of(worker)
        bit = 1 << slot
        if parent is not None and not self._holds_real(parent, bit):
            self.stats.orphan_stores += 1
        self._add_chain(parent, keys, bit, speculative=False)

    def removed(self, worker: str, keys: Iterable[int]) -> None:
        """``worker`` no longer holds ``keys`` (any keys, not necessarily a chain)."""
        if self._pending:
            self.settle()
        slot = self._slot.get(worker)
        if slot is None:
            self.stats.unknown_removes += sum(1 for _ in keys)
            return
        bit = 1 << slot
        for k in keys:
            node = self._node.get(k)
            if node is None or not node.mask & bit:
                self.stats.unknown_removes += 1
                continue
            off = _offset(node, k)
            if not node.spec & bit:
                self.stats.removed_blocks += 1
            self._clear_range(node, off, off + 1, bit)

    def cleared(self, worker: str) -> None:
        """``worker`` dropped its whole cache (engine reset or restart, agent resync)."""
        if self._pending:
            self.settle()
        slot = self._slot.get(worker)
        if slot is None:
            return
        self.stats.clears += 1
        self._clear_slot(slot)
        self._forget_speculation(slot)

    # -- speculation ------------------------------------------------------------------------

    def speculate(self, worker: str, keys: Sequence[int], now: float, start: int = 0) -> int:
        """Attribute ``keys[start:]`` to ``worker`` until ``now + speculative_ttl``.

        Called after a routing decision (``keys`` is the request's chain from the root,
        ``start`` the blocks the worker already matched) so that a burst of requests sharing
        a new prefix follows the first one. An attribution lasts ``speculative_ttl`` after
        the latest decision that made it (the router renews a speculative match by
        attributing the whole prompt again). Returns the number of blocks newly attributed.
        """
        if self._pending:
            self.settle()
        return self._speculate(worker, keys, now, start)

    def speculate_later(self, worker: str, keys: Sequence[int], now: float, start: int = 0) -> None:
        """``speculate``, applied in order before the index is next read or changed (or by
        ``settle``): whoever looks sees exactly what an immediate ``speculate`` would have
        left, but a decision over lazy keys (:class:`LazyKeys`) returns without computing
        the rest of the prompt's keys; the gateway settles after forwarding the request."""
        self._pending.append((worker, keys, now, start))

    def settle(self) -> int:
        """Apply pending ``speculate_later`` calls; returns the blocks newly attributed.

        A call is dropped before it is applied, so one that fails (bad token ids in lazy
        keys) is not retried by every later reader of the index."""
        pending = self._pending
        added = 0
        while pending:
            worker, keys, now, start = pending.popleft()
            added += self._speculate(worker, keys, now, start)
        return added

    def _speculate(self, worker: str, keys: Sequence[int], now: float, start: int) -> int:
        if start >= len(keys) or self.speculative_ttl <= 0:
            return 0
        slot = self._slot_of(worker)
        bit = 1 << slot
        if isinstance(keys, LazyKeys):
            keys = keys.all()
        tail = keys[start:] if isinstance(keys, list) else list(keys[start:])
        parent = keys[start - 1] if start else None
        if self.outbox is not None:
            self.outbox.append((worker, parent, tail))
        return self._attribute(slot, bit, parent, tail, now)

    def _attribute(
        self, slot: int, bit: int, parent: int | None, tail: list[int], now: float
    ) -> int:
        added = self._add_chain(parent, tail, bit, speculative=True)
        expiry = now + self.speculative_ttl
        tag = slot << 64
        self._spec_exp.update(zip([k | tag for k in tail], repeat(expiry)))
        self._spec_log.append((expiry, slot, tail))
        self.stats.speculative_blocks += added
        return added

    def adopt(self, worker: str, parent: int | None, keys: list[int], now: float) -> int:
        """Another gateway replica's speculative insert: ``keys`` (following ``parent``)
        attributed to ``worker`` as this index's own would be, but not put in ``outbox``.
        A worker this index does not know is ignored (it left, or is not yet registered
        here). Returns the number of blocks newly attributed."""
        if self._pending:
            self.settle()
        slot = self._slot.get(worker)
        if slot is None or not keys or self.speculative_ttl <= 0:
            return 0
        return self._attribute(slot, 1 << slot, parent, keys, now)

    def expire(self, now: float) -> int:
        """Drop speculative attributions whose TTL has passed; returns how many blocks."""
        if self._pending:
            self.settle()
        log = self._spec_log
        exp = self._spec_exp
        dropped = 0
        while log and log[0][0] <= now:
            _, slot, keys = log.popleft()
            bit = 1 << slot
            tag = slot << 64
            due = []
            for k in keys:
                e = exp.get(k | tag)
                if e is not None and e <= now:
                    del exp[k | tag]
                    due.append(k)
            j = 0
            while j < len(due):
                node = self._node.get(due[j])
                if node is None or not node.spec & bit:
                    j += 1
                    continue
                off = _offset(node, due[j])
                span = max(1, _common_prefix(node.keys[off:], due, j))
                dropped += self._clear_range(node, off, off + span, bit, only_spec=True)
                j += span
        self.stats.speculative_expired += dropped
        return dropped

    def _forget_speculation(self, slot: int) -> None:
        tag = slot << 64
        kept: deque[tuple[float, int, list[int]]] = deque()
        for rec in self._spec_log:
            if rec[1] == slot:
                for k in rec[2]:
                    self._spec_exp.pop(k | tag, None)
            else:
                kept.append(rec)
        self._spec_log = kept

    # -- queries ----------------------------------------------------------------------------

    def match(self, keys: Sequence[int]) -> dict[str, int]:
        """For each worker holding a prefix of ``keys``: how many leading blocks it holds.

        ``keys`` is a request's chain from the root. A worker's match stops at its first
        missing block. Workers with no match are absent from the result.
        """
        return {w: n for n, ws in self.match_levels(keys) for w in ws}

    def match_levels(self, keys: Sequence[int]) -> list[tuple[int, list[str]]]:
        """``match`` grouped by length: ``[(matched blocks, workers), ...]``, longest first.

        Workers sharing a match length are interchangeable for the prefill they save, and
        there are few distinct lengths, so policies work per level instead of per worker.
        """
        decode = self._decode
        return [(blocks, decode(bits)) for blocks, bits in self.match_masks(keys)]

    def match_masks(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """``match_levels`` with each level's workers as a bit set (``bit(worker)`` each):
        ``[(matched blocks, bits), ...]``, longest first. A prefix held by most of a large
        fleet is one integer here, where a list of its holders costs a step per holder."""
        if self._pending:
            self.settle()
        n = len(keys)
        if not n:
            return []
        # Lazy keys are computed as far as the walk reads: a run and the key after it.
        lazy = keys if isinstance(keys, LazyKeys) else None
        if lazy is not None:
            keys = lazy.upto(1)  # grows in place as ``upto`` is called
        elif not isinstance(keys, list):
            keys = list(keys)
        node = self._root.children.get(keys[0])
        pos = 0
        alive = -1  # every slot
        drops: list[tuple[int, int]] = []  # (matched blocks, slots that stop there)
        while node is not None:
            run = node.keys
            m = len(run)
            if lazy is not None and pos + m >= len(keys):
                lazy.upto(pos + m + 1)
            # a key names its whole prefix (``_common_prefix``): the run matches as far as
            # the request reaches iff its last key there does; no key-by-key comparison
            end = min(m, len(keys) - pos)
            common = end if run[end - 1] == keys[pos + end - 1] else _common_prefix(run, keys, pos)
            if alive != -1 and alive & ~node.mask and pos:
                drops.append((pos, alive & ~node.mask))
            alive &= node.mask
            pos += common
            if not alive or common < m or pos >= n:
                break
            node = node.children.get(keys[pos])
        if alive not in (0, -1) and pos:
            drops.append((pos, alive))
        drops.reverse()
        return drops

    def _decode(self, bits: int) -> list[str]:
        """Worker ids of a slot mask. Holder sets recur (a system prompt's holders), so
        decoded masks are cached; the cache is dropped whenever slots change."""
        ws = self._decoded.get(bits)
        if ws is None:
            if len(self._decoded) >= 4096:
                self._decoded.clear()
            ws = []
            workers = self._worker
            b = bits
            while b:
                low = b & -b
                ws.append(workers[low.bit_length() - 1])  # type: ignore[arg-type]
                b ^= low
            self._decoded[bits] = ws
        return ws

    def blocks(self, worker: str) -> int:
        """Blocks ``worker`` really holds (speculation excluded)."""
        if self._pending:
            self.settle()
        slot = self._slot.get(worker)
        return 0 if slot is None else self._real_blocks[slot]

    def block_counts(self) -> dict[str, int]:
        if self._pending:
            self.settle()
        return {w: self._real_blocks[s] for w, s in self._slot.items()}

    def worker_keys(self, worker: str) -> frozenset[int]:
        """The keys ``worker`` really holds: what must equal the agent's mirror."""
        return frozenset(self.worker_key_list(worker))

    def worker_key_list(self, worker: str) -> list[int]:
        """:meth:`worker_keys` as a list, each key once, in no particular order: what a
        digest needs, without building a set of every key (anti-entropy's check runs on the
        event loop)."""
        if self._pending:
            self.settle()
        slot = self._slot.get(worker)
        if slot is None:
            return []
        bit = 1 << slot
        return [k for n in self._nodes[slot] if not n.spec & bit for k in n.keys]

    def holds(self, worker: str, key: int) -> bool:
        if self._pending:
            self.settle()
        slot = self._slot.get(worker)
        return slot is not None and self._holds_real(key, 1 << slot)

    def continues(self, worker: str, key: int) -> bool:
        """Whether ``worker`` holds (really or speculatively) the block ``key`` and a block
        right after it: the prompt that put ``key`` there went on past it. A request whose
        match ends at ``key`` while its holder's chain continues shares only that prefix
        with the holder's prompt (a sibling), not the whole of it (a next turn)."""
        if self._pending:
            self.settle()
        slot = self._slot.get(worker)
        node = self._node.get(key)
        if slot is None or node is None or not node.mask & (bit := 1 << slot):
            return False
        if node.keys[-1] != key:  # the run goes on, held by the same workers
            return True
        return any(child.mask & bit for child in node.children.values())

    def speculated_at(self, worker: str, key: int) -> float | None:
        """When the decision that attributed block ``key`` to ``worker`` speculatively was
        made (the latest one, if several), or None if that attribution is not speculative."""
        if self._pending:
            self.settle()
        slot = self._slot.get(worker)
        node = self._node.get(key)
        if slot is None or node is None or not node.mask & node.spec & (1 << slot):
            return None
        expiry = self._spec_exp.get(key | (slot << 64))
        return None if expiry is None else expiry - self.speculative_ttl

    def __len__(self) -> int:
        """Distinct keys in the tree (held, speculative or structural)."""
        if self._pending:
            self.settle()
        return len(self._node)

    def entries(self) -> int:
        """(block, worker) pairs really held."""
        if self._pending:
            self.settle()
        return sum(self._real_blocks[s] for s in self._slot.values())

    def speculative_entries(self) -> int:
        if self._pending:
            self.settle()
        return sum(
            len(n.keys) for s in self._slot.values() for n in self._nodes[s] if n.spec & (1 << s)
        )

    def node_count(self) -> int:
        if self._pending:
            self.settle()
        return len({id(n) for n in self._node.values()})

    def check_invariants(self) -> None:
        """Structural self-check for tests (O(size))."""
        if self._pending:
            self.settle()
        seen = 0
        stack = [self._root, *self._detached.values()]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node and child.keys and child.keys[0] == first
                assert child.spec & ~child.mask == 0
                assert child.mask or child.children, "empty leaf not pruned"
                if len(child.children) == 1 and child.mask:
                    (only,) = child.children.values()
                    assert (only.mask, only.spec) != (child.mask, child.spec), "unmerged run"
                for k in child.keys:
                    assert self._node[k] is child
                seen += len(child.keys)
                stack.append(child)
        assert seen == len(self._node), (seen, len(self._node))
        for s in self._slot.values():
            bit = 1 << s
            assert all(n.mask & bit for n in self._nodes[s])
            assert self._real_blocks[s] == sum(
                len(n.keys) for n in self._nodes[s] if not n.spec & bit
            )

    # -- tree edits -------------------------------------------------------------------------

    def _add_chain(
        self, parent: int | None, keys: Sequence[int], bit: int, speculative: bool
    ) -> int:
        """Set ``bit`` on the chain ``keys`` under ``parent``; returns blocks newly set."""
        stats = self.stats
        added = 0
        i = 0
        n = len(keys)
        prev = parent
        while i < n:
            node = self._node.get(keys[i])
            if node is None:
                # Only a detached chain can make a known key follow an unknown one.
                j = n
                if self._detached:
                    j = next((j for j in range(i + 1, n) if keys[j] in self._node), n)
                added += self._append_new(prev, keys[i:j], bit, speculative)
                i = j
                prev = keys[j - 1]
                continue
            off = _offset(node, keys[i])
            if self._predecessor(node, off) != prev:
                stats.conflicts += 1
                break
            run = node.keys
            span = min(len(run) - off, n - i)
            if run[off : off + span] != list(keys[i : i + span]):
                span = _common_prefix(run[off:], keys, i)
            added += self._set_range(node, off, off + span, bit, speculative)
            i += span
            prev = keys[i - 1]
        return added

    def _append_new(
        self, parent: int | None, keys: Sequence[int], bit: int, speculative: bool
    ) -> int:
        """Insert keys unknown to the index as a new run under ``parent``."""
        new = list(keys)
        spec = bit if speculative else 0
        if parent is None:
            host = self._root
        else:
            pnode = self._node.get(parent)
            if pnode is None:
                placeholder = self._detached.get(parent)
                if placeholder is None:
                    placeholder = self._detached[parent] = _Node([], 0, 0, None)
                    placeholder.anchor = parent
                host = placeholder
            else:
                if pnode.keys[-1] != parent:
                    self._split(pnode, _offset(pnode, parent) + 1)
                    pnode = self._node[parent]
                # fast path: extend a childless run with the same holders (tail append)
                if not pnode.children and pnode.mask == bit and pnode.spec == spec:
                    pnode.keys.extend(new)
                    self._node.update(zip(new, repeat(pnode)))
                    self._count(bit, len(new), speculative, +1)
                    self._adopt_detached(pnode, new)
                    return len(new)
                host = pnode
        node = _Node(new, bit, spec, host)
        host.children[new[0]] = node
        self._node.update(zip(new, repeat(node)))
        self._nodes[bit.bit_length() - 1].add(node)
        self._count(bit, len(new), speculative, +1)
        self._adopt_detached(node, new)
        return len(new)

    def _adopt_detached(self, node: _Node, new_keys: list[int]) -> None:
        """Attach chains that were waiting for one of ``new_keys`` as their parent."""
        if not self._detached:
            return
        for k in new_keys:
            ph = self._detached.pop(k, None)
            if ph is None:
                continue
            host = self._node[k]
            if host.keys[-1] != k:
                self._split(host, _offset(host, k) + 1)
                host = self._node[k]
            for first, child in ph.children.items():
                child.parent = host
                host.children[first] = child
            self._merge_around(host)

    def _set_range(self, node: _Node, off: int, end: int, bit: int, speculative: bool) -> int:
        """Make ``bit`` set (really, or speculatively) on ``node.keys[off:end]``."""
        span = end - off
        if node.mask & bit:
            if speculative or not node.spec & bit:
                if not speculative:
                    self.stats.duplicate_stores += span
                return 0
            # speculative -> real on this range
            node = self._isolate(node, off, end)
            node.spec &= ~bit
            self._real_blocks[bit.bit_length() - 1] += span
            self.stats.speculative_confirmed += span
            self._merge_around(node)
            return span
        node = self._isolate(node, off, end)
        node.mask |= bit
        if speculative:
            node.spec |= bit
        self._nodes[bit.bit_length() - 1].add(node)
        self._count(bit, span, speculative, +1)
        self._merge_around(node)
        return span

    def _clear_range(
        self, node: _Node, off: int, end: int, bit: int, only_spec: bool = False
    ) -> int:
        """Clear ``bit`` on ``node.keys[off:end]``; returns blocks cleared."""
        if not node.mask & bit or (only_spec and not node.spec & bit):
            return 0
        speculative = bool(node.spec & bit)
        span = end - off
        # fast path: popping the tail of a leaf held by this worker alone
        if end == len(node.keys) and not node.children and node.mask == bit and off > 0:
            for k in node.keys[off:]:
                del self._node[k]
            del node.keys[off:]
            self._count(bit, span, speculative, -1)
            return span
        node = self._isolate(node, off, end)
        node.mask &= ~bit
        node.spec &= ~bit
        self._nodes[bit.bit_length() - 1].discard(node)
        self._count(bit, span, speculative, -1)
        self._settle(node)
        return span

    def _clear_slot(self, slot: int) -> None:
        bit = 1 << slot
        for node in list(self._nodes[slot]):
            if node.mask & bit and node.keys:
                if not node.spec & bit:
                    self.stats.removed_blocks += len(node.keys)
                self._count(bit, len(node.keys), bool(node.spec & bit), -1)
                node.mask &= ~bit
                node.spec &= ~bit
                self._settle(node)
        self._nodes[slot] = set()

    def _count(self, bit: int, n: int, speculative: bool, sign: int) -> None:
        if not speculative:
            self._real_blocks[bit.bit_length() - 1] += sign * n

    def _isolate(self, node: _Node, off: int, end: int) -> _Node:
        """Split so that ``node.keys[off:end]`` is a node of its own; return that node."""
        if end < len(node.keys):
            node, _ = self._split(node, end)
        if off > 0:
            _, node = self._split(node, off)
        return node

    def _split(self, node: _Node, off: int) -> tuple[_Node, _Node]:
        """Split ``node`` before ``node.keys[off]``; returns (head, tail), tail the head's child.

        The shorter part becomes the new node, so only its keys are re-mapped: removals at
        either end of a long run cost little.
        """
        keys = node.keys
        parent = node.parent
        if 2 * off < len(keys) and parent is not None:
            head = keys[:off]  # copy the short part only; ``del`` moves the rest in place
            del keys[:off]
            new = _Node(head, node.mask, node.spec, parent)
            parent.children[head[0]] = new  # same first key: replaces ``node``
            new.children = {keys[0]: node}
            node.parent = new
            self._node.update(zip(head, repeat(new)))
            first, second = new, node
        else:
            tail = keys[off:]
            del keys[off:]
            new = _Node(tail, node.mask, node.spec, node)
            new.children = node.children
            for c in new.children.values():
                c.parent = new
            node.children = {tail[0]: new}
            self._node.update(zip(tail, repeat(new)))
            first, second = node, new
        m = new.mask
        while m:
            low = m & -m
            self._nodes[low.bit_length() - 1].add(new)
            m ^= low
        return first, second

    def _settle(self, node: _Node) -> None:
        """After ``node`` lost a bit: prune it if nobody needs it, else merge neighbours."""
        if not node.mask and not node.children:
            self._prune(node)
        else:
            self._merge_around(node)

    def _prune(self, node: _Node) -> None:
        while node.parent is not None and not node.mask and not node.children:
            parent = node.parent
            del parent.children[node.keys[0]]
            for k in node.keys:
                del self._node[k]
            node.parent = None
            if not parent.keys:  # root or a detached placeholder
                if parent.anchor is not None and not parent.children:
                    del self._detached[parent.anchor]
                return
            node = parent
        if node.parent is not None:
            self._merge_around(node)

    def _merge_around(self, node: _Node) -> None:
        parent = node.parent
        if (
            parent is not None
            and parent.keys
            and len(parent.children) == 1
            and parent.mask == node.mask
            and parent.spec == node.spec
        ):
            node = self._merge_into(parent, node)
        if len(node.children) == 1:
            (child,) = node.children.values()
            if child.mask == node.mask and child.spec == node.spec and node.keys:
                self._merge_into(node, child)

    def _merge_into(self, node: _Node, child: _Node) -> _Node:
        """Join ``node`` and its only child (identical holders); returns the survivor."""
        if len(child.keys) > len(node.keys) and node.parent is not None:
            # move the shorter run: the child absorbs the parent's keys at its front
            child.keys[:0] = node.keys
            self._node.update(zip(node.keys, repeat(child)))
            grand = node.parent
            del grand.children[node.keys[0]]
            grand.children[child.keys[0]] = child
            child.parent = grand
            node.keys = []
            node.children = {}
            node.parent = None
            dead, survivor = node, child
        else:
            node.keys.extend(child.keys)
            self._node.update(zip(child.keys, repeat(node)))
            node.children = child.children
            for c in node.children.values():
                c.parent = node
            child.keys = []
            child.children = {}
            child.parent = None
            dead, survivor = child, node
        m = dead.mask
        while m:
            low = m & -m
            self._nodes[low.bit_length() - 1].discard(dead)
            m ^= low
        return survivor

    def _predecessor(self, node: _Node, off: int) -> int | None:
        """The key before ``node.keys[off]`` in its chain (None for a first block)."""
        if off:
            return node.keys[off - 1]
        parent = node.parent
        assert parent is not None
        if parent.keys:
            return parent.keys[-1]
        return parent.anchor  # None for the root, the missing key for a placeholder

    def _holds_real(self, key: int, bit: int) -> bool:
        node = self._node.get(key)
        return node is not None and bool(node.mask & bit) and not node.spec & bit

    def _slot_of(self, worker: str) -> int:
        slot = self._slot.get(worker)
        if slot is not None:
            return slot
        if self._free:
            slot = heapq.heappop(self._free)
            self._worker[slot] = worker
            self._nodes[slot] = set()
            self._real_blocks[slot] = 0
        else:
            slot = len(self._worker)
            self._worker.append(worker)
            self._nodes.append(set())
            self._real_blocks.append(0)
        self._slot[worker] = slot
        self._decoded.clear()
        return slot

    def iter_runs(self) -> Iterator[tuple[list[int], int]]:
        """(run keys, holder mask) for every node: for debugging and memory accounting."""
        if self._pending:
            self.settle()
        stack = [self._root, *self._detached.values()]
        while stack:
            node = stack.pop()
            if node.keys:
                yield node.keys, node.mask
            stack.extend(node.children.values())


def _offset(node: _Node, key: int) -> int:
    keys = node.keys
    if keys[-1] == key:
        return len(keys) - 1
    return keys.index(key)


def _common_prefix(run: list[int], keys: Sequence[int], pos: int) -> int:
    """Length of the common prefix of ``run`` and ``keys[pos:]``.

    Chains never re-converge (a key names its whole prefix), so equality is monotone and a
    binary search finds the first difference.
    """
    lo, hi = 0, min(len(run), len(keys) - pos)
    while lo < hi:
        mid = (lo + hi) // 2
        if run[mid] == keys[pos + mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
