"""Engine block events of one data-parallel rank → canonical block keys.

Canonical keys are the core's ``BlockKeyer`` keys over the event's token ids at the pool's
canonical block size ``C``, chained from the canonical key that ends at the engine parent
block. Engine blocks of another size ``E`` are re-chunked:

* every engine block record keeps ``end_key`` (the key of the last canonical block that is
  complete at the block's end) and ``tail`` (the ``< C`` tokens after it), so a child
  block continues the chain with ``keyer.keys(tail + tokens, parent=end_key)``;
* an engine block *contributes* to every canonical block that holds one of its tokens; a
  canonical block whose tokens span several engine blocks (``E < C``, e.g. SGLang page
  size 1, or sizes that do not divide) is held only while all of them are: removing any
  contributor removes the key (the engine's own prefix match stops at that block too);
* a canonical block is published when its last token is stored; if an engine ancestor
  holding its first tokens is gone by then, that key is not published (the engine could
  not serve it), the chain continues after it.

Only GPU-resident, token-keyed blocks are canonical: other media (CPU, disk tiers), LoRA /
multimodal / salted blocks and non-full-attention groups are dropped and counted; their
removals are dropped alike, so they never touch the GPU key set.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gateway.keys import BlockKeyer, InvalidTokens
from worker_agent.engines.decode import BadEvent, BlockRemoved, BlockStored, EngineHash

__all__ = ["Chain", "RankCanonicaliser"]

#: (parent key or None for a root, keys) — a run of newly held keys.
Chain = tuple[int | None, list[int]]


@dataclass(slots=True)
class _Block:
    """What the agent remembers about one engine block it holds."""

    parent: EngineHash | None
    size: int
    end_key: int | None
    tail: tuple[int, ...]
    keys: list[int]  # canonical keys this block contributes tokens to


class RankCanonicaliser:
    """One DP rank's engine blocks and the canonical keys they make the rank hold."""

    def __init__(
        self,
        keyer: BlockKeyer,
        gpu_media: frozenset[str | None] = frozenset({None, "GPU"}),
        group_idx: int = 0,
    ) -> None:
        self.keyer = keyer
        self.gpu_media = gpu_media
        self.group_idx = group_idx
        self.blocks: dict[EngineHash, _Block] = {}
        self.held: set[int] = set()
        self.dropped: Counter[str] = Counter()  # blocks not canonicalised, by reason

    def stored(self, ev: BlockStored) -> list[Chain]:
        """Apply a BlockStored; returns chains of keys this rank newly holds."""
        reason = self._reject(ev.medium, ev.group_idx, ev.spec_kind, ev.keyed_extra)
        if reason:
            self.dropped[reason] += len(ev.hashes)
            return []
        base: int | None = None
        tail: tuple[int, ...] = ()
        owners: list[_Block] | None = []
        if ev.parent is not None:
            prec = self.blocks.get(ev.parent)
            if prec is None:
                self.dropped["unknown_parent"] += len(ev.hashes)
                return []
            base, tail = prec.end_key, prec.tail
            owners = self._tail_owners(ev.parent, len(tail))
        tokens = [*tail, *ev.token_ids] if tail else ev.token_ids
        try:
            keys = self.keyer.keys(tokens, base)
        except InvalidTokens:
            raise BadEvent("tokens") from None
        self._record(ev, tokens, len(tail), base, keys)
        skip_first = False
        if tail and keys:
            if owners is None:  # an ancestor holding the first tokens is gone
                skip_first = True
                self.dropped["broken_prefix"] += 1
            else:
                for owner in owners:
                    if keys[0] not in owner.keys:
                        owner.keys.append(keys[0])
        return self._newly_held(base, keys, skip_first)

    def removed(self, ev: BlockRemoved) -> list[int]:
        """Apply a BlockRemoved; returns keys this rank no longer holds."""
        reason = self._reject(ev.medium, ev.group_idx, None, False)
        if reason:
            self.dropped[reason] += len(ev.hashes)
            return []
        out: list[int] = []
        held = self.held
        for h in ev.hashes:
            block = self.blocks.pop(h, None)
            if block is None:
                self.dropped["unknown_remove"] += 1
                continue
            for k in block.keys:
                if k in held:
                    held.discard(k)
                    out.append(k)
        return out

    def cleared(self) -> list[int]:
        """Forget everything; returns the keys the rank held."""
        out = list(self.held)
        self.held.clear()
        self.blocks.clear()
        return out

    # -- internals --------------------------------------------------------------------------

    def _reject(
        self, medium: str | None, group: int | None, kind: str | None, keyed: bool
    ) -> str | None:
        if medium not in self.gpu_media:
            return "medium"
        if group is not None and group != self.group_idx:
            return "group"
        if kind is not None and kind != "full_attention":
            return "group"
        if keyed:
            return "extra_keys"
        return None

    def _tail_owners(self, parent: EngineHash, need: int) -> list[_Block] | None:
        """Engine blocks holding the last ``need`` tokens before a child (None: one is gone)."""
        owners: list[_Block] = []
        cur: EngineHash | None = parent
        while need > 0:
            block = self.blocks.get(cur) if cur is not None else None
            if block is None:
                return None
            owners.append(block)
            need -= block.size
            cur = block.parent
        return owners

    def _record(
        self, ev: BlockStored, tokens: list[int], offset: int, base: int | None, keys: list[int]
    ) -> None:
        cbs = self.keyer.block_size
        bs = ev.block_size
        n_keys = len(keys)
        prev = ev.parent
        blocks = self.blocks
        for i, h in enumerate(ev.hashes):
            start = offset + i * bs
            end = start + bs
            done = end // cbs  # canonical blocks complete at this block's end
            lo = start // cbs
            hi = min((end - 1) // cbs + 1, n_keys)
            own = keys[lo:hi] if lo < hi else []
            end_key = keys[done - 1] if done else base
            tail = tuple(tokens[done * cbs : end]) if done * cbs < end else ()
            blocks[h] = _Block(prev, bs, end_key, tail, own)
            prev = h

    def _newly_held(self, base: int | None, keys: list[int], skip_first: bool) -> list[Chain]:
        chains: list[Chain] = []
        held = self.held
        run: list[int] = []
        run_parent = base
        prev = base
        for i, k in enumerate(keys):
            if k in held or (skip_first and i == 0):
                if run:
                    chains.append((run_parent, run))
                    run = []
            else:
                if not run:
                    run_parent = prev
                run.append(k)
                held.add(k)
            prev = k
        if run:
            chains.append((run_parent, run))
        return chains
