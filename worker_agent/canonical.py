"""Engine block events of one data-parallel rank → canonical block keys.

Canonical keys are the core's ``BlockKeyer`` keys over the event's token ids at the pool's
canonical block size ``C``, chained from the canonical key that ends at the engine parent
block. Engine blocks of another size ``E`` are re-chunked:

* every engine block record keeps ``end_key`` (the key of the last canonical block that is
  complete at the block's end) and ``tail`` (the ``< C`` tokens after it), so a child
  block continues the chain with ``keyer.keys(tail + tokens, parent=end_key)``;
* an engine block *completes* the canonical blocks whose last token it holds and *starts*
  a canonical block it holds only the first tokens of (``E < C``, e.g. SGLang page size 1,
  or sizes that do not divide). A key is held while some engine block completing it is
  held (siblings larger than ``C`` can complete the same key, so completers are counted)
  and none of the blocks starting it was removed (they are ancestors of every completer:
  the engine's own prefix match stops there too);
* a canonical block is published when its last token is stored; if an engine ancestor
  holding its first tokens is gone by then, that key is not published (the engine could
  not serve it), the chain continues after it.

Only GPU-resident, token-keyed blocks of one KV-cache group are canonical. vLLM publishes
every block once per KV-cache group, with the same block hashes in every group, labelled with
the group's index and kind. The indexed group is chosen by kind, not by index: the first
group seen whose kind can serve a whole prefix (``full_attention``, ``mla_attention``: MLA
models such as DeepSeek-V3/R1 and Kimi-K2 have only that group; hybrid models such as gpt-oss
and Gemma 3 number their sliding-window groups first). Blocks are then keyed by (group, hash):
a store or removal of another group never touches the indexed group's blocks. Events without
a group (SGLang, older vLLM) are the one group. Other media (CPU, disk tiers), multimodal /
salted blocks and other groups are dropped and counted; docs/protocol.md says what a hit
means when a sliding-window or Mamba group limits it.

LoRA blocks (``lora_name``) are keyed on their adapter's chain: a root block continues from
``BlockKeyer.adapter_root(name)`` instead of the base start state, so its keys can only
match requests for that adapter; the chain is published with parent None like any root.
"""

from __future__ import annotations

from collections import Counter
from itertools import repeat
from typing import Final, NamedTuple

from gateway.routing.keys import BlockKeyer, InvalidTokens
from worker_agent.engines.decode import PREFIX_KINDS, BlockRemoved, BlockStored, EngineHash

__all__ = ["Chain", "RankCanonicaliser"]

#: (parent key or None for a root, keys) — a run of newly held keys.
Chain = tuple[int | None, list[int]]

#: Waves of at least this many chains are keyed in one vectorised call.
BATCH_KEYS_MIN = 8

# An engine block record is a plain tuple (this is the agent's per-block hot path):
# (engine parent, size in tokens, end_key, tail tokens, keys it completes, keys it starts)
_Block = tuple[
    EngineHash | None, int, int | None, tuple[int, ...], tuple[int, ...], tuple[int, ...]
]
_PARENT: Final = 0
_SIZE: Final = 1
_END: Final = 2
_TAIL: Final = 3
_COMPLETES: Final = 4
_SHARES: Final = 5


class _Prepared(NamedTuple):
    ev: BlockStored
    base: int | None
    tail: tuple[int, ...]
    owners: list[EngineHash] | None  # engine blocks holding ``tail``; None: one is gone
    tokens: list[int]


class RankCanonicaliser:
    """One DP rank's engine blocks and the canonical keys they make the rank hold.

    A key may be completed by several engine blocks when engine blocks are larger than, or
    not aligned with, canonical ones (siblings sharing the first tokens of a block), so the
    rank counts completing blocks per key; a block that only *starts* a key (a shared
    ancestor of every completer) takes the key away when it goes.
    """

    def __init__(
        self,
        keyer: BlockKeyer,
        gpu_media: frozenset[str | None] = frozenset({None, "GPU"}),
    ) -> None:
        self.keyer = keyer
        self.gpu_media = gpu_media
        self.group: int | None = None  # the indexed KV-cache group, once one is seen
        self.blocks: dict[EngineHash, _Block] = {}
        self.count: dict[int, int] = {}  # held key -> engine blocks completing it
        self.dropped: Counter[str] = Counter()  # blocks not canonicalised, by reason
        #: chain starts of the LoRA adapters seen: a chain continuing one is published as a
        #: root (parent None), like the base model's
        self.roots: set[int] = set()
        self.bad: Counter[str] = Counter()  # events rejected, by reason

    @property
    def held(self) -> set[int]:
        return set(self.count)

    def stored(self, ev: BlockStored) -> list[Chain]:
        """Apply a BlockStored; returns chains of keys this rank newly holds."""
        return self.stored_many([ev])[0]

    def stored_many(self, evs: list[BlockStored]) -> list[list[Chain]]:
        """Apply BlockStored events whose parents are not among each other's blocks
        (one wave: their keys are computed in one call); chains per event, in order."""
        prepared = [self._prepare(ev) for ev in evs]
        todo = [p for p in prepared if p is not None]
        all_keys = self._keys([(p.tokens, p.base) for p in todo])
        out: list[list[Chain]] = []
        it = iter(all_keys)
        for p in prepared:
            keys = next(it) if p is not None else None
            out.append([] if p is None or keys is None else self._apply(p, keys))
        return out

    def removed(self, ev: BlockRemoved) -> list[int]:
        """Apply a BlockRemoved; returns keys this rank no longer holds."""
        reason = self._reject_removal(ev.medium, ev.group_idx)
        if reason:
            self.dropped[reason] += len(ev.hashes)
            return []
        out: list[int] = []
        count = self.count
        # deepest first (an event lists a node's blocks root to leaf): the index then pops
        # keys off the end of its runs instead of splitting them key by key
        for h in reversed(ev.hashes):
            block = self.blocks.pop(h, None)
            if block is None:
                self.dropped["unknown_remove"] += 1
                continue
            for k in reversed(block[_COMPLETES]):
                c = count.get(k)
                if c is None:
                    continue
                if c > 1:
                    count[k] = c - 1
                else:
                    del count[k]
                    out.append(k)
            for k in block[_SHARES]:
                if count.pop(k, None) is not None:
                    out.append(k)
        return out

    def cleared(self) -> list[int]:
        """Forget everything; returns the keys the rank held."""
        out = list(self.count)
        self.count.clear()
        self.blocks.clear()
        self.group = None
        return out

    # -- internals --------------------------------------------------------------------------

    def _prepare(self, ev: BlockStored) -> _Prepared | None:
        reason = self._reject(ev.medium, ev.group_idx, ev.spec_kind, ev.keyed_extra)
        if reason:
            self.dropped[reason] += len(ev.hashes)
            return None
        if ev.parent is None:
            root = None
            if ev.lora_name is not None:  # an adapter's blocks: the adapter's own chain
                root = self.keyer.adapter_root(ev.lora_name)
                assert root is not None
                self.roots.add(root)
            return _Prepared(ev, root, (), [], ev.token_ids)
        prec = self.blocks.get(ev.parent)
        if prec is None:
            self.dropped["unknown_parent"] += len(ev.hashes)
            return None
        tail = prec[_TAIL]
        owners = self._tail_owners(ev.parent, len(tail)) if tail else []
        tokens = [*tail, *ev.token_ids] if tail else ev.token_ids
        return _Prepared(ev, prec[_END], tail, owners, tokens)

    def _keys(self, chains: list[tuple[list[int], int | None]]) -> list[list[int] | None]:
        """Keys per chain; None for a chain with invalid token ids (counted)."""
        try:
            if len(chains) >= BATCH_KEYS_MIN:
                many: list[list[int] | None] = list(self.keyer.keys_many(chains))
                return many
            return [self.keyer.keys(t, b) for t, b in chains]
        except InvalidTokens:
            pass
        out: list[list[int] | None] = []
        for t, b in chains:
            try:
                out.append(self.keyer.keys(t, b))
            except InvalidTokens:
                self.bad["tokens"] += 1
                out.append(None)
        return out

    def _apply(self, p: _Prepared, keys: list[int]) -> list[Chain]:
        broken = bool(p.tail and keys and p.owners is None)
        if broken:  # an ancestor holding the first tokens of keys[0] is gone
            self.dropped["broken_prefix"] += 1
        elif p.tail and keys and p.owners:
            for h in p.owners:
                rec = self.blocks[h]
                if keys[0] not in rec[_SHARES]:
                    self.blocks[h] = (*rec[:_SHARES], (*rec[_SHARES], keys[0]))
        ev = p.ev
        cbs = self.keyer.block_size
        if not p.tail and ev.block_size % cbs == 0 and self.blocks.keys().isdisjoint(ev.hashes):
            fresh = self._record_aligned(ev, keys, p.base)
        else:
            fresh = self._record(
                ev, p.tokens, len(p.tail), p.base, keys, keys[0] if broken else None
            )
        base = None if p.base in self.roots else p.base
        if len(fresh) == len(keys):
            return [(base, keys)] if keys else []
        return _chains(base, keys, fresh)

    def _reject(
        self, medium: str | None, group: int | None, kind: str | None, keyed: bool
    ) -> str | None:
        if medium not in self.gpu_media:
            return "medium"
        if kind is not None and kind not in PREFIX_KINDS:
            return "group"
        if group is not None and group != self.group:
            if self.group is not None or not _selects(group, kind):
                return "group"
            self.group = group  # the first whole-prefix group stored
        if keyed:
            return "extra_keys"
        return None

    def _reject_removal(self, medium: str | None, group: int | None) -> str | None:
        if medium not in self.gpu_media:
            return "medium"
        if group is not None and self.group is not None and group != self.group:
            return "group"
        return None

    def _tail_owners(self, parent: EngineHash, need: int) -> list[EngineHash] | None:
        """Engine blocks holding the last ``need`` tokens before a child (None: one is gone)."""
        owners: list[EngineHash] = []
        cur: EngineHash | None = parent
        while need > 0:
            block = self.blocks.get(cur) if cur is not None else None
            if block is None or cur is None:
                return None
            owners.append(cur)
            need -= block[_SIZE]
            cur = block[_PARENT]
        return owners

    def _record_aligned(self, ev: BlockStored, keys: list[int], base: int | None) -> set[int]:
        """Fast path: engine blocks a multiple of canonical ones, none known yet."""
        hashes = ev.hashes
        r = ev.block_size // self.keyer.block_size
        if r == 1:
            completes: list[tuple[int, ...]] = [(k,) for k in keys]
            ends: list[int] = keys
        else:
            completes = [tuple(keys[i * r : (i + 1) * r]) for i in range(len(hashes))]
            ends = keys[r - 1 :: r]
        parents = [ev.parent, *hashes[:-1]]
        self.blocks.update(
            zip(
                hashes,
                zip(parents, repeat(ev.block_size), ends, repeat(()), completes, repeat(())),
                strict=False,
            )
        )
        count = self.count
        if count.keys().isdisjoint(keys):
            count.update(zip(keys, repeat(1)))
            return set(keys)
        fresh = set()
        for k in keys:
            c = count.get(k)
            if c is None:
                count[k] = 1
                fresh.add(k)
            else:
                count[k] = c + 1
        return fresh

    def _record(
        self,
        ev: BlockStored,
        tokens: list[int],
        offset: int,
        base: int | None,
        keys: list[int],
        skip: int | None,
    ) -> set[int]:
        """Remember the event's blocks; returns the keys that became held."""
        cbs = self.keyer.block_size
        bs = ev.block_size
        n = len(keys)
        prev = ev.parent
        blocks = self.blocks
        count = self.count
        fresh: set[int] = set()
        for i, h in enumerate(ev.hashes):
            start = offset + i * bs
            end = start + bs
            done = end // cbs  # canonical blocks complete at this block's end
            if h in blocks:  # a re-announced block: nothing new
                prev = h
                continue
            completes = tuple(k for k in keys[start // cbs : min(done, n)] if k != skip)
            shares = (keys[done],) if end % cbs and done < n else ()
            end_key = keys[done - 1] if done else base
            tail = tuple(tokens[done * cbs : end]) if done * cbs < end else ()
            blocks[h] = (prev, bs, end_key, tail, completes, shares)
            for k in completes:
                c = count.get(k)
                if c is None:
                    count[k] = 1
                    fresh.add(k)
                else:
                    count[k] = c + 1
            prev = h
        return fresh


def _selects(group: int, kind: str | None) -> bool:
    """Whether a stored block of ``group`` (of a whole-prefix kind, or of no stated kind)
    makes it the indexed group. Without a kind (vLLM before kinds were published) only
    group 0 can: the one group of a plain model."""
    return kind is not None or group == 0


def _chains(base: int | None, keys: list[int], fresh: set[int]) -> list[Chain]:
    """Runs of ``fresh`` keys along the chain ``keys``, each with the key before it."""
    if not fresh:
        return []
    chains: list[Chain] = []
    run: list[int] = []
    run_parent = base
    prev = base
    for k in keys:
        if k in fresh:
            if not run:
                run_parent = prev
            run.append(k)
        elif run:
            chains.append((run_parent, run))
            run = []
        prev = k
    if run:
        chains.append((run_parent, run))
    return chains
