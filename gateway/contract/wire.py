"""The wire contract between worker agents and gateways (docs/protocol.md, section by section).

Both sides import this module and nothing else of each other, so the bytes one writes are the
bytes the other reads:

* canonical events (``Stored``, ``Removed``, ``Cleared``) batched in a stream ``Entry`` with the
  agent's epoch and a gap-free sequence number (sections 3-4);
* a ``Snapshot``: a worker's whole canonical key set and the stream position it matches
  (section 5);
* a ``WorkerInfo`` registration and an ``EngineReport`` load report (section 6);
* ``Placements``: gateway replicas' speculative inserts, shared between replicas (section 9);
* the Redis layout of all of them (section 2) and ``key_digest``, the order-independent digest
  of a key set that both sides publish so convergence can be checked from outside.

The block keys themselves (section 1) are ``gateway.routing.keys``.
"""

from __future__ import annotations

import binascii
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import numpy as np

#: Entries and snapshots carry this; readers refuse a larger one (docs/protocol.md).
PROTOCOL_VERSION = 1


# -- canonical events (the payload of a stream entry) ----------------------------------------


class Stored(msgspec.Struct, array_like=True, tag=0, frozen=True):
    """The worker now holds ``keys``: a chain whose first key follows ``parent`` (None: root)."""

    parent: int | None
    keys: list[int]


class Removed(msgspec.Struct, array_like=True, tag=1, frozen=True):
    """The worker no longer holds ``keys``."""

    keys: list[int]


class Cleared(msgspec.Struct, array_like=True, tag=2, frozen=True):
    """The worker holds nothing (engine reset or restart, agent resync)."""


Event = Stored | Removed | Cleared


class Digest(msgspec.Struct, array_like=True, frozen=True):
    """The writer's whole key set after the entry that carries it (anti-entropy): its size
    and ``key_digest``. A reader that has applied that entry compares its own."""

    blocks: int
    digest: str


class Entry(msgspec.Struct, array_like=True):
    """One stream entry: a batch of canonical events from one agent run (epoch).

    ``seq`` counts entries of the epoch from 1 without gaps, so a reader that sees
    ``seq > last + 1`` knows it missed entries (trimmed or lost). ``ts`` is the engine's
    timestamp of the oldest engine batch inside (event-to-index lag), ``pts`` the publish
    time; ``eseq`` lists ``(dp_rank, first, last)`` engine sequence numbers covered.
    """

    v: int
    epoch: int
    seq: int
    ts: float
    pts: float
    eseq: list[tuple[int, int, int]]
    events: list[Event]
    digest: Digest | None = None


class Snapshot(msgspec.Struct, array_like=True):
    """A worker's whole canonical state after entry ``seq`` (stream id ``stream_id``)."""

    v: int
    epoch: int
    seq: int
    stream_id: str
    ts: float
    chains: list[tuple[int | None, list[int]]]

    def keys(self) -> set[int]:
        return {k for _, chain in self.chains for k in chain}


_entry_enc = msgspec.msgpack.Encoder()
_entry_dec = msgspec.msgpack.Decoder(Entry)
_snap_dec = msgspec.msgpack.Decoder(Snapshot)


def encode_entry(entry: Entry) -> bytes:
    if entry.digest is None:  # the 7 items of the original layout, byte for byte
        return _entry_enc.encode(msgspec.structs.astuple(entry)[:-1])
    return _entry_enc.encode(entry)


def decode_entry(data: bytes) -> Entry:
    """Raises ``msgspec.DecodeError`` / ``ValueError`` on garbage or a newer protocol."""
    entry = _entry_dec.decode(data)
    if entry.v > PROTOCOL_VERSION:
        raise ValueError(f"entry protocol v{entry.v} is newer than v{PROTOCOL_VERSION}")
    return entry


def encode_snapshot(snap: Snapshot) -> bytes:
    return _entry_enc.encode(snap)


def decode_snapshot(data: bytes) -> Snapshot:
    snap = _snap_dec.decode(data)
    if snap.v > PROTOCOL_VERSION:
        raise ValueError(f"snapshot protocol v{snap.v} is newer than v{PROTOCOL_VERSION}")
    return snap


# -- placements (gateway replica to gateway replica) -------------------------------------------

#: a canonical block key: 64 bits, unsigned (msgpack carries no more; the decoder refuses less)
_Key = Annotated[int, msgspec.Meta(ge=0)]


class Placement(msgspec.Struct, array_like=True, frozen=True):
    """A gateway sent a request to ``worker`` that will leave ``keys`` (following ``parent``)
    cached there: its speculative insert (``ShadowIndex.outbox``)."""

    worker: str
    parent: _Key | None
    keys: list[_Key]


class Journal(msgspec.Struct, array_like=True, frozen=True):
    """One router's requests since the last batch (``Router.journal``): ``name`` is its pool
    (``pool`` or ``pool/decode``), each note ``(kind, rid, worker, uncached, cached,
    arrival)`` as ``gateway.routing.router.Note`` describes; ``adapters``: ``(rid,
    adapter)`` of its STARTs for a LoRA adapter (``Router.journal_adapters``). Appended
    last and defaulted, so a replica of either version reads the other's batches."""

    name: str
    notes: list[tuple[int, int, str, int, int, int]]
    adapters: list[tuple[int, str]] = []


class Placements(msgspec.Struct, array_like=True, frozen=True):
    """A batch of one gateway replica's placements; ``origin`` is its id (a replica skips
    its own). ``journals``: its requests' starts and ends (their load, and the prefix
    rates), for the others' load views (``gateway.routing.remote``)."""

    v: int
    origin: str
    items: list[Placement]
    journals: list[Journal] = []


_placements_dec = msgspec.msgpack.Decoder(Placements)


def encode_placements(batch: Placements) -> bytes:
    return _entry_enc.encode(batch)


def decode_placements(data: bytes) -> Placements:
    """Raises ``msgspec.DecodeError`` / ``ValueError`` on garbage, a negative key (checked by
    the decoder itself, not per key in Python) or a newer protocol."""
    batch = _placements_dec.decode(data)
    if batch.v > PROTOCOL_VERSION:
        raise ValueError(f"placements protocol v{batch.v} is newer than v{PROTOCOL_VERSION}")
    return batch


# -- registration and load ------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's registration record: what the gateway needs to route to it.

    ``epoch`` identifies the agent run that wrote it (entries of other epochs are stale).
    ``kv_capacity_blocks`` is in canonical blocks (``block_size`` tokens each). An engine
    with several data-parallel ranks registers each rank as a worker of its own (one prefix
    cache each): ``dp_rank`` is the rank the gateway pins requests to, ``engine_id`` the
    engine (agent) it belongs to; both are unset for an engine with one rank.
    ``kv_capacity_blocks`` is in canonical blocks (``block_size`` tokens each).
    ``seed_fingerprint`` (``gateway.contract.fingerprint``) lets a gateway refuse an agent
    keyed with another hash seed; empty from agents that predate it (accepted, unverified).
    """

    worker_id: str
    url: str
    model: str
    pool: str = ""
    engine: str = "vllm"
    engine_block_size: int = 16
    block_size: int = 16
    kv_capacity_blocks: int | None = None
    dp_size: int = 1
    dp_rank: int | None = None
    engine_id: str = ""
    role: str = ""
    bootstrap_port: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    epoch: int = 0
    started_at: float = 0.0
    version: int = PROTOCOL_VERSION
    #: LoRA adapters the engine serves (requests may name them as ``model``), from its
    #: ``/v1/models`` (cards whose ``parent`` is the base model)
    adapters: tuple[str, ...] = ()
    seed_fingerprint: str = ""


@dataclass(frozen=True)
class EngineReport:
    """A worker's load as its engine reports it (agent -> bus -> gateway).

    Counters are cumulative as the engine exports them; ``ts`` is the wall-clock time
    (``time.time()``) of the scrape, so consumers can judge its age.
    """

    running: int = 0  # requests being prefilled or decoded
    waiting: int = 0  # requests queued in the engine
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    waiting_prefill_tokens: int | None = None  # uncached prompt tokens queued, if the engine says
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # tokens found (cumulative)
    ts: float = 0.0
    #: LoRA adapters loaded on the GPU now, if the engine says (vLLM: the running and
    #: waiting adapters of ``vllm:lora_requests_info``); None: not reported
    adapters: tuple[str, ...] | None = None
    max_adapters: int | None = None  # adapters the engine keeps loaded at once (--max-loras)


_json_enc = msgspec.json.Encoder()
_worker_dec = msgspec.json.Decoder(WorkerInfo)
_report_dec = msgspec.msgpack.Decoder(EngineReport)


def encode_worker(info: WorkerInfo) -> bytes:
    """JSON, so that ``redis-cli GET`` shows a readable registration."""
    return _json_enc.encode(info)


def decode_worker(data: bytes) -> WorkerInfo:
    return _worker_dec.decode(data)


def encode_report(report: EngineReport) -> bytes:
    return _entry_enc.encode(report)


def decode_report(data: bytes) -> EngineReport:
    return _report_dec.decode(data)


def try_decode_entry(data: bytes) -> Entry | None:
    """The entry, or None if it is garbage or from a newer protocol."""
    try:
        return decode_entry(data)
    except (msgspec.DecodeError, ValueError):
        return None


# -- Redis layout (docs/protocol.md section 2) ----------------------------------------------

#: The one field of a stream entry: the encoded ``Entry``.
ENTRY_FIELD = b"e"
#: the placements stream's second field: the publishing replica's id
ORIGIN_FIELD = b"o"


#: Redis Cluster slots (keys hash to ``CRC16(tag) mod 16384``).
CLUSTER_SLOTS = 16384
#: hash tags a deployment's workers are spread over (a protocol constant: both sides must
#: agree on every key name, so it is not a setting)
STREAM_GROUPS = 60


def cluster_slot(tag: str) -> int:
    """The Redis Cluster slot of a hash tag (CRC16/XMODEM, as Redis computes it)."""
    return binascii.crc_hqx(tag.encode(), 0) % CLUSTER_SLOTS


def _group_tags(n: int) -> tuple[str, ...]:
    """``n`` tags whose slots fall one in each of ``n`` equal slot ranges, so that a
    cluster whose shards own equal contiguous ranges (``redis-cli --cluster create``) gets
    an equal share of groups: the first ``kv<i>.<j>`` whose slot is in range ``i``."""
    tags = []
    for i in range(n):
        lo, hi = i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n
        j = 0
        while not lo <= cluster_slot(f"kv{i}.{j}") < hi:
            j += 1
        tags.append(f"kv{i}.{j}")
    return tuple(tags)


_GROUP_TAGS = _group_tags(STREAM_GROUPS)


def stream_group(worker: str) -> int:
    """The group of a worker: a stable hash of its id (the same in every process)."""
    digest = hashlib.blake2b(worker.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % STREAM_GROUPS


@dataclass(frozen=True)
class RedisLayout:
    """Where each record of the contract lives in Redis, under one key ``prefix``.

    A worker's keys carry the hash tag of its stream group (``{kv<i>.<j>}``, one of
    ``STREAM_GROUPS``): on Redis Cluster its stream, snapshot, registration and load report
    share one slot (one shard), and the streams of one group can be read by one blocking
    XREAD (Redis refuses a multi-key command across slots, even on one node). Single-node
    Redis ignores the braces. The registry set is one key of its own, read with single-key
    commands only.
    """

    prefix: str = "kvroute:"

    @staticmethod
    def tag(worker: str) -> str:
        """The hash tag of ``worker``'s keys, braces included."""
        return "{" + _GROUP_TAGS[stream_group(worker)] + "}"

    def stream(self, worker: str) -> str:
        return f"{self.prefix}stream:{self.tag(worker)}:{worker}"

    def snapshot(self, worker: str) -> str:
        return f"{self.prefix}snapshot:{self.tag(worker)}:{worker}"

    def worker(self, worker: str) -> str:
        return f"{self.prefix}worker:{self.tag(worker)}:{worker}"

    def load(self, worker: str) -> str:
        return f"{self.prefix}load:{self.tag(worker)}:{worker}"

    @property
    def workers(self) -> str:
        return f"{self.prefix}workers"

    @property
    def placements(self) -> str:
        """The gateway replicas' shared placements stream (one key, read with XREAD)."""
        return f"{self.prefix}placements"

    def stream_worker(self, key: str) -> str:
        """The worker id of a stream key."""
        return key[len(self.prefix) + len("stream:") :].partition("}:")[2]


# -- key digest ------------------------------------------------------------------------------


def key_digest(keys: Iterable[int]) -> str:
    """Order-independent digest of a set of distinct keys: equal sets, equal digests. The
    gateway's ``/debug/index`` and the agent's ``/mirror`` publish it so convergence can be
    checked from outside both processes.

    The sha256 of the keys sorted, each as 8 little-endian bytes, computed in one pass over
    an array: the consumer checks a worker's digest on the event loop every few seconds, and
    the per-key version stalled it for 3.5-3.8x longer (``kvroute bench index``,
    ``antientropy_check_*``). A key outside [0, 2**64) raises OverflowError, as
    ``int.to_bytes`` did."""
    arr = np.fromiter(keys, dtype=np.uint64)
    arr.sort()
    return hashlib.sha256(arr.astype("<u8", copy=False).tobytes()).hexdigest()[:32]
