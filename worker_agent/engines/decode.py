"""Engine KV event batches (msgpack) → normalised engine events.

One decoder serves vLLM and SGLang, every version in reference/engines.md: the outer batch
is positional (``[ts, events, dp_rank]``, a missing third item is None); each event is
either a tagged map (``{"type": "BlockStored", ...}``) or a tagged array (item 0 is the
tag). Fields are selected by name; for arrays, names come from the positional layouts
below, which are prefixes of one another across versions (vLLM ≤0.9, 0.23; SGLang 0.5.9,
0.5.15), so one layout serves all. Unknown fields and unknown trailing items are ignored.
Hashes may be uint64, int64 or bytes and are kept as they come (dict keys), never sent on.

Two shapes of ``BlockStored`` need more than field selection:

* SGLang with EAGLE/EAGLE3/NEXTN (DeepSeek MTP) speculative decoding keys its radix tree by
  bigrams and publishes ``token_ids`` as pairs ``[t_j, t_j+1]``: KV slot j holds token
  ``t_j``, so the canonical tokens are the first of each pair (``block_size`` counts pairs);
* vLLM's sliding-window and Mamba groups (hybrid models) may publish stores whose hashes are
  sparse or empty and whose tokens do not line up with them (0.33 keeps only the tail those
  groups need). They are decoded without the alignment check; the canonicaliser drops them.

A bad event is skipped and reported by reason; a batch that cannot be decoded at all
raises ``BadBatch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "PREFIX_KINDS",
    "AllCleared",
    "BadBatch",
    "BadEvent",
    "BlockRemoved",
    "BlockStored",
    "DecodeLimits",
    "DecodedBatch",
    "EngineEvent",
    "EngineHash",
    "decode_batch",
]

EngineHash = int | bytes

#: KV-cache group kinds (vLLM's ``kv_cache_spec_kind``) whose blocks serve a whole prefix.
PREFIX_KINDS = frozenset({"full_attention", "mla_attention"})

STORED_LAYOUT = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
REMOVED_LAYOUT = ("block_hashes", "medium", "group_idx", "locality", "ownership")


class BadBatch(ValueError):
    """The payload is not an engine event batch; ``reason`` labels the metric."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class BadEvent(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class BlockStored:
    hashes: list[EngineHash]
    parent: EngineHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    group_idx: int | None = None
    spec_kind: str | None = None
    keyed_extra: bool = False  # multimodal, cache salt, unnamed LoRA: not a token prefix
    lora_name: str | None = None  # the LoRA adapter the blocks were computed with


@dataclass(slots=True)
class BlockRemoved:
    hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllCleared:
    pass


EngineEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds that keep a hostile or broken publisher from stalling the agent."""

    max_frame_bytes: int = 64 << 20
    max_events: int = 1 << 16  # events per batch
    max_event_tokens: int = 1 << 20  # tokens per BlockStored


@dataclass
class DecodedBatch:
    ts: float
    rank: int | None
    events: list[EngineEvent] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # reasons of skipped events


_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes, limits: DecodeLimits | None = None) -> DecodedBatch:
    limits = limits or DecodeLimits()
    if len(payload) > limits.max_frame_bytes:
        raise BadBatch("too_large", f"{len(payload)} bytes")
    try:
        obj = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadBatch("msgpack", str(exc)) from None
    if not isinstance(obj, list) or len(obj) < 2:
        raise BadBatch("batch_shape", type(obj).__name__)
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) > 2 else None
    if not _is_number(ts) or not isinstance(events, list):
        raise BadBatch("batch_shape", "ts/events types")
    if rank is not None and not _is_int(rank):
        raise BadBatch("batch_shape", "dp rank type")
    if len(events) > limits.max_events:
        raise BadBatch("too_large", f"{len(events)} events")
    out = DecodedBatch(float(ts), rank)
    for raw in events:
        try:
            out.events.append(_event(raw, limits))
        except BadEvent as exc:
            out.bad.append(exc.reason)
    return out


def _event(raw: Any, limits: DecodeLimits) -> EngineEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        layout = STORED_LAYOUT if tag == "BlockStored" else REMOVED_LAYOUT
        fields = dict(zip(layout, raw[1:], strict=False))
    else:
        raise BadEvent("event_shape")
    if tag == "BlockStored":
        return _stored(fields, limits)
    if tag == "BlockRemoved":
        return BlockRemoved(
            _hashes(fields), _opt_str(fields, "medium"), _opt_int(fields, "group_idx")
        )
    if tag == "AllBlocksCleared":
        return AllCleared()
    raise BadEvent("unknown_type")


def _stored(f: dict[Any, Any], limits: DecodeLimits) -> BlockStored:
    kind = _opt_str(f, "kv_cache_spec_kind")
    aligned = kind is None or kind in PREFIX_KINDS
    hashes = _hashes(f, allow_empty=not aligned)
    parent = f.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise BadEvent("wrong_type")
    tokens = f.get("token_ids")
    if not isinstance(tokens, list):
        raise BadEvent("wrong_type")
    if len(tokens) > limits.max_event_tokens:
        raise BadEvent("too_large")
    if tokens and type(tokens[0]) is not int:
        tokens = _bigram_firsts(tokens)
    bs = f.get("block_size")
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise BadEvent("wrong_type")
    if aligned and len(tokens) != len(hashes) * bs:
        raise BadEvent("token_count")
    lora = _opt_str(f, "lora_name")
    extra = f.get("extra_keys")
    keyed = (
        (f.get("lora_id") is not None and lora is None)  # an adapter we cannot name
        or f.get("cache_salt") is not None
        or (isinstance(extra, list) and not all(_lora_only(x, lora) for x in extra))
    )
    return BlockStored(
        hashes,
        parent,
        tokens,
        bs,
        _opt_str(f, "medium"),
        _opt_int(f, "group_idx"),
        kind,
        keyed,
        lora,
    )


def _lora_only(extra: Any, lora: str | None) -> bool:
    """Whether one block's ``extra_keys`` entry holds nothing but the LoRA name (vLLM puts
    the adapter in every block's extra keys: ``[name]``, or the name alone)."""
    if extra is None:
        return True
    if lora is None:
        return False
    if isinstance(extra, list):
        return all(x == lora for x in extra)
    return bool(extra == lora)


def _bigram_firsts(pairs: list[Any]) -> list[int]:
    """SGLang's bigram ``token_ids`` (``[t_j, t_j+1]`` pairs) → the tokens ``t_j``."""
    out = []
    for p in pairs:
        if type(p) is not list or len(p) != 2 or type(p[0]) is not int or type(p[1]) is not int:
            raise BadEvent("wrong_type")
        out.append(p[0])
    return out


def _hashes(f: dict[Any, Any], allow_empty: bool = False) -> list[EngineHash]:
    hashes = f.get("block_hashes")
    if not isinstance(hashes, list) or not (hashes or allow_empty):
        raise BadEvent("wrong_type")
    for h in hashes:
        if not _is_hash(h):
            raise BadEvent("wrong_type")
    return hashes


def _opt_str(f: dict[Any, Any], name: str) -> str | None:
    v = f.get(name)
    if v is not None and not isinstance(v, str):
        raise BadEvent("wrong_type")
    return v


def _opt_int(f: dict[Any, Any], name: str) -> int | None:
    v = f.get(name)
    if v is not None and not _is_int(v):
        raise BadEvent("wrong_type")
    return v


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_number(v: Any) -> bool:
    return type(v) is int or type(v) is float


def _is_hash(v: Any) -> bool:
    return type(v) is int or type(v) is bytes
