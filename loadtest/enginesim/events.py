"""KV events on the wire: the engines' own msgspec structs per version, and an encoder.

The structs mirror the engines' definitions field for field (engines.md §1.1, §1.2, §2.1)
with the same msgspec options, so msgspec produces the bytes the engines produce:

* vLLM 0.33 — tagged maps (``{"type": "BlockStored", ...}``, defaults omitted);
* vLLM 0.23 — tagged arrays ``["BlockStored", hashes, parent, tokens, ...]``;
* SGLang 0.5.23 — tagged maps; SGLang 0.5.15 — tagged arrays;
* the outer batch is always the 3-item array ``[ts, events, dp_rank]``.

``EventEncoder`` turns the cache's neutral events (physical block ids + token bytes) into
one payload per engine step. It keeps the block id -> digest map that hash chaining and
removals need, so it must see every event the core produces, in order.

**vLLM KV-cache groups** (``WireFormat.kv_groups``; hybrid, MLA and sliding-window models).
vLLM hashes a request's blocks once, with no group id in the hash, and every group caches
the same blocks: each ``BlockStored`` is published once per group, in group order, with the
same hashes, parent and tokens, and that group's ``group_idx``, ``kv_cache_spec_kind`` and
(sliding kinds only) ``kv_cache_spec_sliding_window``. Each removal is published per group
too, one ``BlockRemoved`` per hash with its ``group_idx``. The simulator has one radix cache,
and it drives every group; what differs is that vLLM frees a sliding-window or Mamba group's
blocks early, while full-attention (and MLA) copies of the same hashes stay. That is emulated
deterministically: right after a chain is stored, each such group publishes removals for the
blocks of the chain (root to the new tip, earlier stores included) that lie entirely before
its last ``ceil((window - 1) / block_size)`` blocks (Mamba: all but the last block). These
blocks are gone from that group only; when the shared cache later evicts them, only the
groups still holding them publish a removal. (Real vLLM frees them during the request and
publishes the removal lazily, when the block is reused, and 0.33 stores only sparse SW tails;
the emulation keeps what matters to a consumer: the same hash is removed from one group and
kept in another, so a consumer keying blocks by hash alone, not by (group, hash), loses
blocks.) Other kinds (``chunked_local_attention``, ...) are published like full attention.

**LoRA adapters** (``BlocksStored.lora``). vLLM puts the adapter in every block's hash
extra keys (0.33: ``("lora", name, path)``; the event publishes ``lora_id``, ``lora_name`` and
each block's extra keys untagged, ``[name]``); SGLang (0.5.22+, map encoding) seeds the
first page of an adapter's chain with the adapter (its ``extra_key``) and publishes
``lora_name``. Either way an adapter's blocks never share a hash with the base model's.

**SGLang bigram keys** (``WireFormat.bigram``; EAGLE/EAGLE3/NEXTN speculative decoding). The
cache's atoms are then 8-byte bigrams ``t_j || t_j+1``; ``token_ids`` is published as a list
of ``[t_j, t_j+1]`` pairs, ``block_size`` is the page size in pairs, and page hashes are
SGLang's SHA-256 chain over the pairs as uint32 LE words (the atom bytes themselves).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from loadtest.enginesim.config import SLIDING_KINDS, KvGroup, SimConfig
from loadtest.enginesim.hashing import (
    sglang_event_hash,
    sglang_page_hashes,
    vllm_block_hashes,
    vllm_event_hash,
)
from loadtest.enginesim.kvcache import (
    BIGRAM_BYTES,
    TOKEN_BYTES,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVEvent,
    unpack_tokens,
)

__all__ = ["EventEncoder", "WireFormat"]

Hash = int | bytes
_Fields = list[tuple[str, Any] | tuple[str, Any, Any]]

# Field lists per engine version, in wire order (engines.md §1.1, §1.2, §2.1). Fields with a
# default are omitted from maps when they hold it; arrays always carry every field.
_VLLM_STORED_023: _Fields = [
    ("block_hashes", list[Hash]),
    ("parent_block_hash", Hash | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
    ("lora_name", str | None),
    ("extra_keys", list[Any] | None, None),
    ("group_idx", int | None, None),
    ("kv_cache_spec_kind", str | None, None),
    ("kv_cache_spec_sliding_window", int | None, None),
]
_VLLM_STORED_033: _Fields = [
    *_VLLM_STORED_023,
    ("locality", str | None, None),
    ("ownership", str | None, None),
    ("session_id", str | None, None),
    ("lookahead_token_ids", list[list[int]] | None, None),
]
_VLLM_REMOVED_023: _Fields = [
    ("block_hashes", list[Hash]),
    ("medium", str | None),
    ("group_idx", int | None, None),
]
_VLLM_REMOVED_033: _Fields = [
    *_VLLM_REMOVED_023,
    ("locality", str | None, None),
    ("ownership", str | None, None),
]
_SGLANG_STORED_0515: _Fields = [
    ("block_hashes", list[int]),
    ("parent_block_hash", int | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None, None),
]
_SGLANG_STORED_0523: _Fields = [
    *_SGLANG_STORED_0515,
    ("cache_salt", str | None, None),
    ("session_id", str | None, None),
    ("lora_name", str | None, None),
]
_SGLANG_REMOVED: _Fields = [("block_hashes", list[int]), ("medium", str | None, None)]


def _event_types(stored: _Fields, removed: _Fields, arrays: bool) -> tuple[Any, Any, Any]:
    """(BlockStored, BlockRemoved, AllBlocksCleared) structs: tagged by class name, defaults
    omitted, as the engines declare them."""
    opts: dict[str, Any] = {"tag": True, "omit_defaults": True, "array_like": arrays, "gc": False}
    return (
        msgspec.defstruct("BlockStored", stored, **opts),
        msgspec.defstruct("BlockRemoved", removed, **opts),
        msgspec.defstruct("AllBlocksCleared", [], **opts),
    )


_EVENT_TYPES: dict[tuple[str, str], tuple[Any, Any, Any]] = {
    ("vllm", "map"): _event_types(_VLLM_STORED_033, _VLLM_REMOVED_033, arrays=False),
    ("vllm", "array"): _event_types(_VLLM_STORED_023, _VLLM_REMOVED_023, arrays=True),
    ("sglang", "map"): _event_types(_SGLANG_STORED_0523, _SGLANG_REMOVED, arrays=False),
    ("sglang", "array"): _event_types(_SGLANG_STORED_0515, _SGLANG_REMOVED, arrays=True),
}


class _VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _SglangBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


# -- encoder ---------------------------------------------------------------------------------


_DEFAULT_GROUPS = (KvGroup(),)


@dataclass(frozen=True)
class WireFormat:
    """Which engine, which encoding, how hashes look."""

    engine: Literal["vllm", "sglang"]
    encoding: Literal["map", "array"]
    block_size: int
    hash_bytes: bool = False  # vLLM only: raw 32-byte digests instead of uint64
    medium: str = "GPU"
    dp_rank: int = 0
    kv_groups: tuple[KvGroup, ...] = _DEFAULT_GROUPS  # vLLM only, in group order
    bigram: bool = False  # SGLang only: EAGLE/MTP bigram keys (the cache's atoms are pairs)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_groups", tuple(self.kv_groups))
        if not self.kv_groups:
            raise ValueError("kv_groups must list at least one group")
        if self.engine == "sglang" and self.kv_groups != _DEFAULT_GROUPS:
            raise ValueError("SGLang has no KV-cache groups")
        if self.engine == "vllm" and self.bigram:
            raise ValueError("bigram keys are SGLang's (vLLM has no bigram mode)")

    @classmethod
    def for_sim(cls, cfg: SimConfig) -> WireFormat:
        """The wire format a simulated worker configured by ``cfg`` publishes."""
        return cls(
            cfg.flavor,
            cfg.events.encoding,
            cfg.cache.block_size,
            cfg.events.hash_format == "bytes",
            kv_groups=tuple(cfg.cache.kv_groups),
            bigram=cfg.cache.bigram_keys,
        )

    @property
    def version(self) -> str:
        """The engine release whose field lists are used."""
        if self.engine == "vllm":
            return "0.33" if self.encoding == "map" else "0.23"
        return "0.5.23" if self.encoding == "map" else "0.5.15"


class EventEncoder:
    """Neutral cache events -> one msgpack payload per batch, in ``fmt``'s wire format."""

    def __init__(self, fmt: WireFormat) -> None:
        self.fmt = fmt
        self._digest: dict[int, bytes] = {}  # block id -> chain digest
        self._lora_ids: dict[str, int] = {}  # adapter -> vLLM's lora_int_id (1, 2, ...)
        self._enc = msgspec.msgpack.Encoder()
        self._stored_t, self._removed_t, self._cleared_t = _EVENT_TYPES[(fmt.engine, fmt.encoding)]
        self._atom = BIGRAM_BYTES if fmt.bigram else TOKEN_BYTES
        # vLLM groups: (group_idx, kind, sliding window or None) for every group, and
        # (group_idx, blocks kept) for the groups that free blocks early (module docstring).
        self._groups = [
            (g, k.kind, k.sliding_window if k.kind in SLIDING_KINDS else None)
            for g, k in enumerate(fmt.kv_groups)
        ]
        self._early: list[tuple[int, int]] = []
        for g, k in enumerate(fmt.kv_groups):
            if k.kind in SLIDING_KINDS:
                assert k.sliding_window is not None
                self._early.append((g, -(-(k.sliding_window - 1) // fmt.block_size)))
            elif k.kind == "mamba":
                self._early.append((g, 1))
        self._gone: dict[int, set[int]] = {g: set() for g, _ in self._early}  # freed early
        self._parent: dict[int, int | None] = {}  # block id -> parent block id (early only)
        self._depth: dict[int, int] = {}  # block id -> index in its chain (early only)

    def encode(self, events: Sequence[KVEvent], ts: float) -> bytes:
        """The payload (third ZMQ frame) for one batch of events."""
        wire: list[Any] = []
        for ev in events:
            if isinstance(ev, BlocksStored):
                wire.extend(self._stored(ev))
            elif isinstance(ev, BlocksRemoved):
                wire.extend(self._removed(ev))
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.reset()
                wire.append(self._cleared_t())
        if self.fmt.engine == "vllm":
            return self._enc.encode(_VllmBatch(ts, wire, self.fmt.dp_rank))
        return self._enc.encode(_SglangBatch(ts, wire, self.fmt.dp_rank))

    def reset(self) -> None:
        """Forget every block (the engine restarted)."""
        self._digest.clear()
        self._parent.clear()
        self._depth.clear()
        for gone in self._gone.values():
            gone.clear()

    # -- per engine ------------------------------------------------------------------------

    def _stored(self, ev: BlocksStored) -> list[Any]:
        fmt = self.fmt
        if len(ev.tokens) != len(ev.block_ids) * fmt.block_size * self._atom:
            raise ValueError(
                f"{len(ev.block_ids)} stored blocks hold {len(ev.tokens)} key bytes, not "
                f"{self._atom}-byte atoms x {fmt.block_size}: the cache and the wire format "
                "disagree (build it with WireFormat.for_sim)"
            )
        parent = None if ev.parent_block_id is None else self._digest[ev.parent_block_id]
        lora = ev.lora
        if fmt.engine == "vllm":
            tokens = unpack_tokens(ev.tokens)
            hash_extra = None if lora is None else (("lora", lora, f"/adapters/{lora}"),)
            digests = vllm_block_hashes(parent, tokens, fmt.block_size, hash_extra)
        else:
            seed = parent
            if seed is None and lora is not None:  # the adapter seeds its chain
                seed = hashlib.sha256(b"lora:" + lora.encode()).digest()
            digests = sglang_page_hashes(seed, ev.tokens, fmt.block_size, self._atom)
        self._digest.update(zip(ev.block_ids, digests, strict=True))
        if fmt.engine == "vllm":
            pub = [vllm_event_hash(d, fmt.hash_bytes) for d in digests]
            par = None if parent is None else vllm_event_hash(parent, fmt.hash_bytes)
            extra: list[Any] = [None if lora is None else [lora]] * len(pub)
            lora_id = (
                None if lora is None else self._lora_ids.setdefault(lora, len(self._lora_ids) + 1)
            )
            out = [
                self._stored_t(
                    pub, par, tokens, fmt.block_size, lora_id, fmt.medium, lora,
                    extra_keys=extra, group_idx=g, kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
                for g, kind, window in self._groups
            ]  # fmt: skip
            if self._early:
                out.extend(self._freed_early(ev))
            return out
        spub = [sglang_event_hash(d) for d in digests]
        spar = None if parent is None else sglang_event_hash(parent)
        if fmt.encoding == "map":  # 0.5.23 coalesces a chain of pages into one event
            ids = self._token_ids(ev.tokens)
            named = {} if lora is None else {"lora_name": lora}
            return [self._stored_t(spub, spar, ids, fmt.block_size, None, fmt.medium, **named)]
        out = []  # 0.5.15: one event per page
        step = self._atom * fmt.block_size
        for i, h in enumerate(spub):
            page = self._token_ids(ev.tokens[i * step : (i + 1) * step])
            out.append(self._stored_t([h], spar, page, fmt.block_size, None, fmt.medium))
            spar = h
        return out

    def _token_ids(self, atoms: bytes) -> list[Any]:
        """SGLang's ``token_ids``: token ids, or ``[t_j, t_j+1]`` pairs for bigram keys."""
        if self.fmt.bigram:
            pairs: list[list[int]] = np.frombuffer(atoms, dtype="<u4").reshape(-1, 2).tolist()
            return pairs
        return unpack_tokens(atoms)

    def _freed_early(self, ev: BlocksStored) -> list[Any]:
        """Removals from the sliding-window/Mamba groups of the blocks now outside their
        window: the chain's blocks before its last ``keep``, deepest first."""
        parent, depth = self._parent, self._depth
        prev = ev.parent_block_id
        d = 0 if prev is None else depth[prev] + 1
        for b in ev.block_ids:
            parent[b] = prev
            depth[b] = d
            prev, d = b, d + 1
        out = []
        for g, keep in self._early:
            gone = self._gone[g]
            cut = d - keep  # blocks at depth < cut lie before the window
            node: int | None = ev.block_ids[-1]
            # Walk up to the first block this group already freed: it frees a chain's
            # blocks from the root down, so everything above that one is freed too.
            while node is not None and node not in gone:
                if depth[node] < cut:
                    gone.add(node)
                    out.append(self._vllm_removed(self._digest[node], g))
                node = parent[node]
        return out

    def _vllm_removed(self, digest: bytes, group: int) -> Any:
        return self._removed_t(
            [vllm_event_hash(digest, self.fmt.hash_bytes)], self.fmt.medium, group_idx=group
        )

    def _removed(self, ev: BlocksRemoved) -> list[Any]:
        fmt = self.fmt
        digests = [self._digest.pop(b) for b in ev.block_ids]
        if fmt.engine == "sglang":
            return [self._removed_t([sglang_event_hash(d) for d in digests], fmt.medium)]
        # one event per hash and group, deepest first (never orphan a child); a group that
        # freed a block early has published its removal already
        if not self._early:
            return [self._vllm_removed(d, g) for g, _, _ in self._groups for d in reversed(digests)]
        out = []
        for g, _, _ in self._groups:
            gone = self._gone.get(g)
            for b, d in zip(reversed(ev.block_ids), reversed(digests), strict=True):
                if gone is not None and b in gone:
                    gone.discard(b)
                else:
                    out.append(self._vllm_removed(d, g))
        for b in ev.block_ids:
            self._parent.pop(b, None)
            self._depth.pop(b, None)
        return out
