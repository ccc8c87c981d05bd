"""KV events of the simulator: hashes, exact bytes, decoding with the engines' field lists
(written here from engines.md, independently of the encoder), and the ZMQ replay protocol.

``decode_batch`` and ``check_chain`` are reused by the live-server tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import pickle
import random
import struct
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from loadtest.enginesim.config import CacheConfig, EventsConfig, SchedulerConfig, SimConfig
from loadtest.enginesim.events import EventEncoder, WireFormat
from loadtest.enginesim.hashing import (
    VLLM_NONE_HASH,
    sglang_event_hash,
    sglang_page_hashes,
    vllm_block_hashes,
    vllm_event_hash,
)
from loadtest.enginesim.kvcache import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    pack_tokens,
)
from loadtest.enginesim.publisher import END_SEQ, EventPublisher
from loadtest.enginesim.scheduler import EngineCore
from loadtest.enginesim.timing import timing_model

# -- an independent decoder, from the field lists in engines.md ------------------------------

FIELDS: dict[tuple[str, str], dict[str, list[str]]] = {
    ("vllm", "map"): {  # vLLM 0.33
        "BlockStored": [
            "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
            "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
            "lookahead_token_ids",
        ],
        "BlockRemoved": ["block_hashes", "medium", "group_idx", "locality", "ownership"],
        "AllBlocksCleared": [],
    },
    ("vllm", "array"): {  # vLLM 0.23
        "BlockStored": [
            "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
            "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
        ],
        "BlockRemoved": ["block_hashes", "medium", "group_idx"],
        "AllBlocksCleared": [],
    },
    ("sglang", "map"): {  # SGLang 0.5.23
        "BlockStored": [
            "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
            "cache_salt", "session_id", "lora_name",
        ],
        "BlockRemoved": ["block_hashes", "medium"],
        "AllBlocksCleared": [],
    },
    ("sglang", "array"): {  # SGLang 0.5.15
        "BlockStored": [
            "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        ],
        "BlockRemoved": ["block_hashes", "medium"],
        "AllBlocksCleared": [],
    },
}  # fmt: skip
# Fields without a default: present in every map-encoded event even when null.
ALWAYS = {
    "vllm": {
        "BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size",
                        "lora_id", "medium", "lora_name"},
        "BlockRemoved": {"block_hashes", "medium"},
    },
    "sglang": {
        "BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"},
        "BlockRemoved": {"block_hashes"},
    },
}  # fmt: skip


def decode_batch(
    payload: bytes, engine: str, encoding: str
) -> tuple[float, list[dict[str, Any]], Any]:
    """``[ts, events, dp_rank]`` with every event as a dict that has a ``type`` key."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 3
    ts, events, rank = batch
    assert isinstance(ts, float)
    fields = FIELDS[(engine, encoding)]
    out = []
    for ev in events:
        if encoding == "map":
            assert isinstance(ev, dict)
            tag = ev["type"]
            assert set(ev) - {"type"} <= set(fields[tag]), f"unknown fields in {ev}"
            assert ALWAYS[engine].get(tag, set()) <= set(ev)
            out.append(dict(ev))
        else:
            assert isinstance(ev, list)
            tag, values = ev[0], ev[1:]
            assert len(values) == len(fields[tag]), f"{tag} has {len(values)} fields"
            out.append({"type": tag, **dict(zip(fields[tag], values, strict=True))})
    return ts, out, rank


def ref_vllm_hash(parent: bytes | None, block: list[int]) -> bytes:
    none = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    return hashlib.sha256(pickle.dumps((parent or none, tuple(block), None), protocol=5)).digest()


def ref_sglang_hash(parent: bytes | None, page: list[int]) -> bytes:
    data = (parent or b"") + struct.pack(f"<{len(page)}I", *page)
    return hashlib.sha256(data).digest()


class ChainChecker:
    """Recomputes every stored hash from token ids with the engines' algorithms (this test's
    own implementation) and tracks which hashes are live."""

    def __init__(self, engine: str, block_size: int, as_bytes: bool = False) -> None:
        self.engine = engine
        self.bs = block_size
        self.as_bytes = as_bytes
        self.digest: dict[Any, bytes] = {}  # published hash -> digest

    def public(self, d: bytes) -> Any:
        if self.engine == "sglang":
            return int.from_bytes(d[:8], "big", signed=True)
        return d if self.as_bytes else int.from_bytes(d[-8:], "big")

    def apply(self, ev: dict[str, Any]) -> None:
        if ev["type"] == "BlockStored":
            parent = ev["parent_block_hash"]
            prev = None if parent is None else self.digest[parent]
            toks = ev["token_ids"]
            assert ev["block_size"] == self.bs and len(toks) == self.bs * len(ev["block_hashes"])
            for i, h in enumerate(ev["block_hashes"]):
                block = toks[i * self.bs : (i + 1) * self.bs]
                d = (
                    ref_vllm_hash(prev, block)
                    if self.engine == "vllm"
                    else ref_sglang_hash(prev, block)
                )
                assert self.public(d) == h
                self.digest[h] = prev = d
        elif ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                del self.digest[h]
        else:
            self.digest.clear()


# -- hashes ----------------------------------------------------------------------------------


def test_vllm_test_vector() -> None:
    assert VLLM_NONE_HASH.hex().startswith("066b1e89") and VLLM_NONE_HASH.hex().endswith("71198")
    (h0,) = vllm_block_hashes(None, list(range(1, 17)), 16)
    assert h0.hex().startswith("7b255da4") and h0.hex().endswith("7f4caf")
    assert vllm_event_hash(h0) == 1403909460543360175
    assert vllm_event_hash(h0, as_bytes=True) == h0


def test_vllm_hashes_chain() -> None:
    toks = list(range(100, 148))
    hs = vllm_block_hashes(None, toks, 16)
    assert len(hs) == 3
    assert vllm_block_hashes(hs[0], toks[16:], 16) == hs[1:]
    assert hs[1] == ref_vllm_hash(hs[0], toks[16:32])


def test_sglang_hashes_chain_and_sign() -> None:
    toks = list(range(7, 15))
    hs = sglang_page_hashes(None, pack_tokens(toks), 1)
    assert len(hs) == 8 and hs[0] == hashlib.sha256(struct.pack("<I", 7)).digest()
    assert hs[3] == ref_sglang_hash(hs[2], [10])
    assert all(-(2**63) <= sglang_event_hash(h) < 2**63 for h in hs)
    d = bytes.fromhex("ff" * 8 + "00" * 24)
    assert sglang_event_hash(d) == -1  # first 8 bytes, signed


# -- bytes -----------------------------------------------------------------------------------


def test_byte_level_example_from_engines_md() -> None:
    """engines.md §1.4: BlockRemoved(2**64-1, GPU, group 0) + AllBlocksCleared, ts 1.5."""
    map_hex = (
        "93cb3ff8000000000000" "92" "84" "a474797065" "ac426c6f636b52656d6f766564"
        "ac626c6f636b5f686173686573" "91cfffffffffffffffff" "a66d656469756d" "a3475055"
        "a967726f75705f696478" "00" "81" "a474797065" "b0416c6c426c6f636b73436c6561726564" "00"
    )  # fmt: skip
    array_hex = (
        "93cb3ff8000000000000" "92" "94" "ac426c6f636b52656d6f766564" "91cfffffffffffffffff"
        "a3475055" "00" "91" "b0416c6c426c6f636b73436c6561726564" "00"
    )  # fmt: skip
    for encoding, expected in (("map", map_hex), ("array", array_hex)):
        enc = EventEncoder(WireFormat("vllm", encoding, 16))  # type: ignore[arg-type]
        # a block whose digest ends in ff*8: plant it, then remove it
        enc._digest[1] = b"\x00" * 24 + b"\xff" * 8
        payload = enc.encode([BlocksRemoved([1]), AllBlocksCleared()], 1.5)
        assert payload.hex() == expected


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("encoding", ["map", "array"])
def test_encoded_events_decode_with_the_engines_field_lists(engine: str, encoding: str) -> None:
    bs = 4
    enc = EventEncoder(WireFormat(engine, encoding, bs))  # type: ignore[arg-type]
    toks = list(range(1, 13))
    events = [
        BlocksStored([10, 11], None, pack_tokens(toks[:8])),
        BlocksStored([12], 11, pack_tokens(toks[8:12])),
        BlocksRemoved([12]),
        BlocksRemoved([10, 11]),
        AllBlocksCleared(),
    ]
    ts, decoded, rank = decode_batch(enc.encode(events, 2.0), engine, encoding)
    assert ts == 2.0 and rank == 0
    checker = ChainChecker(engine, bs)
    for ev in decoded:
        checker.apply(ev)
        if ev["type"] != "AllBlocksCleared":
            assert ev["medium"] == "GPU"
    types = [e["type"] for e in decoded]
    if engine == "vllm":  # one event per store call; one per removed hash, deepest first
        assert types == ["BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved",
                         "BlockRemoved", "AllBlocksCleared"]  # fmt: skip
        assert decoded[0]["extra_keys"] == [None, None] and decoded[0]["group_idx"] == 0
        removed = [e["block_hashes"][0] for e in decoded if e["type"] == "BlockRemoved"]
        assert removed[1:] == decoded[0]["block_hashes"][::-1]
    elif encoding == "map":  # 0.5.23: a chain of pages coalesced; one removal per node
        assert types == ["BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved",
                         "AllBlocksCleared"]  # fmt: skip
        assert len(decoded[0]["block_hashes"]) == 2
    else:  # 0.5.15: one event per page
        assert types == ["BlockStored"] * 3 + ["BlockRemoved"] * 2 + ["AllBlocksCleared"]
        assert decoded[1]["parent_block_hash"] == decoded[0]["block_hashes"][0]


def test_replay_layout_follows_the_encoding_unless_set() -> None:
    assert EventsConfig(encoding="map").replay_topic_frame  # vLLM >= 0.26, SGLang >= 0.5.22
    assert not EventsConfig(encoding="array").replay_topic_frame
    assert EventsConfig(encoding="array", replay_layout="topic").replay_topic_frame
    assert not EventsConfig(encoding="map", replay_layout="legacy").replay_topic_frame


# The same scenario's payloads, hashed, as the encoder produced them before KV-cache groups
# and bigram keys existed (computed from that code): default settings must not change a byte.
GOLDEN = {
    ("vllm", "map", False): "a99d944675f5ec622bd33531a05d1b787b29a513953738b59ade14c9783cf9bc",
    ("vllm", "map", True): "069678eb6153616e3a89def9ec0d22d8cca03aa263a0414616ad3bf78f27eef5",
    ("vllm", "array", False): "e5b52835b69c36a76dc19917388409f01da3a8cd7225062469cbcc51825c5a0d",
    ("vllm", "array", True): "b3357cfc6e3b52000af63bdd7e6d72931f65d00e68048ba773de9454a5f44b93",
    ("sglang", "map", False): "37064867c6109936317e70446514a603fafadab7efa3644e7c689f7a966b0f83",
    ("sglang", "array", False): "67503f1d8bc7b5e4c4e632ce1464ba5dc653c13490e0025882d59b1d064e6df4",
}


def golden_scenario(evict_whole_nodes: bool) -> list[list[Any]]:
    """Cache event batches of a fixed workload: shared prefixes, cached outputs, evictions
    (a 48-block pool) and a final reset."""
    core = EngineCore(
        CacheConfig(kv_blocks=48, block_size=4),
        SchedulerConfig(max_num_batched_tokens=64),
        timing_model("mocker"),
        evict_whole_nodes=evict_whole_nodes,
        output_tokens=(5, 6, 7),
    )
    rng = random.Random(1234)
    shared = [rng.randrange(1, 50_000) for _ in range(22)]
    batches: list[list[Any]] = []
    t = 0.0
    for i in range(30):
        t += 0.05
        batches.extend(r.events for r in core.advance(t) if r.events)
        tail = [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 30))]
        core.add_request((shared if i % 3 else shared[:9]) + tail, rng.randrange(1, 12), now=t)
    batches.extend(r.events for r in core.advance(float("inf")) if r.events)
    assert core.reset_prefix_cache()
    batches.append(core.take_events())
    return batches


@pytest.mark.parametrize(("engine", "encoding", "as_bytes"), sorted(GOLDEN))
def test_default_settings_publish_the_same_bytes_as_before(
    engine: str, encoding: str, as_bytes: bool
) -> None:
    batches = golden_scenario(evict_whole_nodes=engine == "sglang")
    kinds = {type(e).__name__ for b in batches for e in b}
    assert kinds == {"BlocksStored", "BlocksRemoved", "AllBlocksCleared"}
    sim = SimConfig(flavor=engine, events=EventsConfig(encoding=encoding))  # type: ignore[arg-type]
    fmt = WireFormat.for_sim(sim)
    assert fmt == WireFormat(engine, encoding, 16)  # type: ignore[arg-type]
    fmt = dataclasses.replace(fmt, block_size=4, hash_bytes=as_bytes)
    enc = EventEncoder(fmt)
    digest = hashlib.sha256()
    for i, batch in enumerate(batches):
        digest.update(enc.encode(batch, float(i)))
    assert digest.hexdigest() == GOLDEN[(engine, encoding, as_bytes)]


def test_vllm_raw_digest_hashes() -> None:
    enc = EventEncoder(WireFormat("vllm", "map", 16, hash_bytes=True))
    _, (ev,), _ = decode_batch(
        enc.encode([BlocksStored([0], None, pack_tokens(range(1, 17)))], 1.0), "vllm", "map"
    )
    assert isinstance(ev["block_hashes"][0], bytes) and len(ev["block_hashes"][0]) == 32
    ChainChecker("vllm", 16, as_bytes=True).apply(ev)


# -- ZMQ transport and replay ----------------------------------------------------------------


async def _subscribed(
    ctx: zmq.asyncio.Context, pub: EventPublisher
) -> tuple[zmq.asyncio.Socket, int]:
    """A SUB socket that is known to receive: probe batches until one arrives."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub.endpoint)
    for _ in range(500):
        await pub.publish(b"probe")
        if await sub.poll(10):
            frames = await sub.recv_multipart()
            while await sub.poll(0):
                frames = await sub.recv_multipart()
            return sub, int.from_bytes(frames[1], "big")
    raise AssertionError("subscriber never received a probe")


async def _replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", b"bad"])  # malformed: ignored, not fatal
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            out.append(frames)
            if frames[-2] == END_SEQ:
                return out
    finally:
        dealer.close()


@pytest.mark.parametrize("topic_frame", [True, False])
async def test_replay_returns_exactly_the_missed_batches(topic_frame: bool) -> None:
    ctx = zmq.asyncio.Context()
    pub = await EventPublisher(
        ctx, "127.0.0.1", topic="kv", buffer_steps=50, replay_topic_frame=topic_frame
    ).start()
    try:
        sub, last = await _subscribed(ctx, pub)
        await pub.publish(b"a")
        pub.drop_next(2)
        await pub.publish(b"b")
        await pub.publish(b"c")
        await pub.publish(b"d")
        seen = []
        for _ in range(2):
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert topic == b"kv"
            seen.append((int.from_bytes(seq, "big"), payload))
        assert seen == [(last + 1, b"a"), (last + 4, b"d")]  # a gap of two
        reply = await _replay(ctx, pub.replay_endpoint or "", last + 2)
        *batches, end = reply
        want = [[b"", b"kv"]] if topic_frame else [[b""]]
        got = [(int.from_bytes(f[-2], "big"), f[-1]) for f in batches]
        assert got == [(last + 2, b"b"), (last + 3, b"c"), (last + 4, b"d")]
        assert all(f[: len(want[0])] == want[0] and len(f) == len(want[0]) + 2 for f in batches)
        assert end == ([b"", b"", END_SEQ, b""] if topic_frame else [b"", END_SEQ, b""])
        sub.close()
    finally:
        await pub.close()
        ctx.term()


async def test_replay_buffer_is_bounded() -> None:
    ctx = zmq.asyncio.Context()
    pub = await EventPublisher(ctx, "127.0.0.1", buffer_steps=3).start()
    try:
        for i in range(10):
            await pub.publish(bytes([i]))
        reply = await _replay(ctx, pub.replay_endpoint or "", 0)
        assert [f[-1] for f in reply[:-1]] == [b"\x07", b"\x08", b"\x09"]
        assert pub.next_seq == 10
    finally:
        await pub.close()
        ctx.term()
