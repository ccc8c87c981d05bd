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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from loadtest.enginesim.hashing import (
    sglang_event_hash,
    sglang_page_hashes,
    vllm_block_hashes,
    vllm_event_hash,
)
from loadtest.enginesim.kvcache import (
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


@dataclass(frozen=True)
class WireFormat:
    """Which engine, which encoding, how hashes look."""

    engine: Literal["vllm", "sglang"]
    encoding: Literal["map", "array"]
    block_size: int
    hash_bytes: bool = False  # vLLM only: raw 32-byte digests instead of uint64
    medium: str = "GPU"
    dp_rank: int = 0

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
        self._enc = msgspec.msgpack.Encoder()
        self._stored_t, self._removed_t, self._cleared_t = _EVENT_TYPES[(fmt.engine, fmt.encoding)]

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
                self._digest.clear()
                wire.append(self._cleared_t())
        if self.fmt.engine == "vllm":
            return self._enc.encode(_VllmBatch(ts, wire, self.fmt.dp_rank))
        return self._enc.encode(_SglangBatch(ts, wire, self.fmt.dp_rank))

    def reset(self) -> None:
        """Forget every block (the engine restarted)."""
        self._digest.clear()

    # -- per engine ------------------------------------------------------------------------

    def _stored(self, ev: BlocksStored) -> list[Any]:
        fmt = self.fmt
        parent = None if ev.parent_block_id is None else self._digest[ev.parent_block_id]
        if fmt.engine == "vllm":
            tokens = unpack_tokens(ev.tokens)
            digests = vllm_block_hashes(parent, tokens, fmt.block_size)
        else:
            digests = sglang_page_hashes(parent, ev.tokens, fmt.block_size)
        self._digest.update(zip(ev.block_ids, digests, strict=True))
        if fmt.engine == "vllm":
            pub = [vllm_event_hash(d, fmt.hash_bytes) for d in digests]
            par = None if parent is None else vllm_event_hash(parent, fmt.hash_bytes)
            return [
                self._stored_t(
                    pub, par, tokens, fmt.block_size, None, fmt.medium, None,
                    extra_keys=[None] * len(pub), group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            ]  # fmt: skip
        spub = [sglang_event_hash(d) for d in digests]
        spar = None if parent is None else sglang_event_hash(parent)
        if fmt.encoding == "map":  # 0.5.23 coalesces a chain of pages into one event
            tokens = unpack_tokens(ev.tokens)
            return [self._stored_t(spub, spar, tokens, fmt.block_size, None, fmt.medium)]
        out = []  # 0.5.15: one event per page
        step = 4 * fmt.block_size
        for i, h in enumerate(spub):
            page = unpack_tokens(ev.tokens[i * step : (i + 1) * step])
            out.append(self._stored_t([h], spar, page, fmt.block_size, None, fmt.medium))
            spar = h
        return out

    def _removed(self, ev: BlocksRemoved) -> list[Any]:
        fmt = self.fmt
        digests = [self._digest.pop(b) for b in ev.block_ids]
        if fmt.engine == "vllm":  # one event per hash, deepest first (never orphan a child)
            return [
                self._removed_t([vllm_event_hash(d, fmt.hash_bytes)], fmt.medium, group_idx=0)
                for d in reversed(digests)
            ]
        return [self._removed_t([sglang_event_hash(d) for d in digests], fmt.medium)]
