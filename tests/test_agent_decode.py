"""Decoding engine KV event batches of every supported engine version."""

from __future__ import annotations

import msgspec
import pytest
from agent_helpers import FLAVORS, batch_payload, cleared_event, removed_event, stored_event

from worker_agent.engines.decode import (
    AllCleared,
    BadBatch,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    decode_batch,
)

TOKENS = list(range(1, 33))


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_each_version_decodes(flavor: str) -> None:
    f = FLAVORS[flavor]
    h1, h2 = (-(2**63), 2**63 - 1) if f.signed else (2**64 - 1, 7)
    payload = batch_payload(
        [
            stored_event(f, [h1, h2], None, TOKENS, 16),
            removed_event(f, [h2]),
            cleared_event(f),
        ],
        rank=3,
        ts=1.5,
    )
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.rank == 3 and batch.bad == []
    st, rm, cl = batch.events
    assert isinstance(st, BlockStored)
    assert st.hashes == [h1, h2] and st.parent is None and st.token_ids == TOKENS
    assert st.block_size == 16 and st.medium == "GPU" and not st.keyed_extra
    assert isinstance(rm, BlockRemoved) and rm.hashes == [h2] and rm.medium == "GPU"
    assert isinstance(cl, AllCleared)


def test_reference_bytes_from_engines_md() -> None:
    """The byte-level examples of reference/engines.md §1.4, both encodings."""
    maps = bytes.fromhex(
        "93cb3ff8000000000000928"
        "4a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfffffffffffffffff"
        "a66d656469756da3475055a967726f75705f696478008"
        "1a474797065b0416c6c426c6f636b73436c656172656400"
    )
    arrays = bytes.fromhex(
        "93cb3ff800000000000092"
        "94ac426c6f636b52656d6f76656491cfffffffffffffffffa347505500"
        "91b0416c6c426c6f636b73436c656172656400"
    )
    for data in (maps, arrays):
        batch = decode_batch(data)
        assert batch.ts == 1.5 and batch.rank == 0
        rm, cl = batch.events
        assert isinstance(rm, BlockRemoved) and rm.hashes == [2**64 - 1] and rm.group_idx == 0
        assert isinstance(cl, AllCleared)


def test_bytes_hashes_and_old_two_item_batch() -> None:
    f = FLAVORS["vllm-0.23"]
    h = b"\x01" * 32
    data = msgspec.msgpack.encode([2.0, [stored_event(f, [h], b"\x02" * 32, TOKENS[:16], 16)]])
    batch = decode_batch(data)
    assert batch.rank is None
    (st,) = batch.events
    assert isinstance(st, BlockStored) and st.hashes == [h] and st.parent == b"\x02" * 32


def test_oldest_vllm_layout_without_medium() -> None:
    data = msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, TOKENS[:16], 16, None]]])
    (st,) = decode_batch(data).events
    assert isinstance(st, BlockStored) and st.medium is None


def test_unknown_fields_ignored_and_extra_keys_flagged() -> None:
    f = FLAVORS["vllm-0.33"]
    ev = stored_event(f, [1], None, TOKENS[:16], 16, future_field={"x": 1})
    salted = stored_event(FLAVORS["sglang-0.5.23"], [2], None, TOKENS[:16], 16, cache_salt="s")
    lora = stored_event(f, [3], None, TOKENS[:16], 16, lora_name="adapter")
    mm = stored_event(f, [4], None, TOKENS[:16], 16, extra_keys=[["img", 0]])
    batch = decode_batch(batch_payload([ev, salted, lora, mm]))
    # a LoRA block is keyed on its adapter's chain (test_agent_lora.py), not dropped
    assert [e.keyed_extra for e in batch.events] == [False, True, False, True]  # type: ignore[union-attr]
    assert batch.events[2].lora_name == "adapter"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1garbage", "msgpack"),
        (msgspec.msgpack.encode({"ts": 1}), "batch_shape"),
        (msgspec.msgpack.encode([1.0]), "batch_shape"),
        (msgspec.msgpack.encode(["x", []]), "batch_shape"),
        (msgspec.msgpack.encode([1.0, [], "rank"]), "batch_shape"),
    ],
)
def test_bad_batches(payload: bytes, reason: str) -> None:
    with pytest.raises(BadBatch) as exc:
        decode_batch(payload)
    assert exc.value.reason == reason


def test_bad_events_are_skipped_by_reason() -> None:
    f = FLAVORS["vllm-0.33"]
    good = stored_event(f, [1], None, TOKENS[:16], 16)
    events = [
        good,
        {"type": "Mystery"},
        {"type": "BlockStored", "block_hashes": "nope", "token_ids": [], "block_size": 16},
        stored_event(f, [1.5], None, TOKENS[:16], 16),  # float hash
        stored_event(f, [2], None, TOKENS[:15], 16),  # token count mismatch
        stored_event(f, [3], None, TOKENS[:16], 0),  # block size
        removed_event(f, [None]),  # type: ignore[list-item]
        42,
        [],
        removed_event(f, [9]),
    ]
    batch = decode_batch(batch_payload(events))
    assert len(batch.events) == 2
    assert sorted(batch.bad) == sorted(
        ["unknown_type", "wrong_type", "wrong_type", "token_count", "wrong_type", "wrong_type",
         "event_shape", "event_shape"]
    )  # fmt: skip


def test_limits() -> None:
    f = FLAVORS["vllm-0.33"]
    limits = DecodeLimits(max_frame_bytes=10_000, max_events=4, max_event_tokens=32)
    with pytest.raises(BadBatch, match="too_large"):
        decode_batch(batch_payload([cleared_event(f)] * 5), limits)
    with pytest.raises(BadBatch, match="too_large"):
        decode_batch(b"\x00" * 10_001, limits)
    big = stored_event(f, [1, 2, 3], None, list(range(48)), 16)
    batch = decode_batch(batch_payload([big]), limits)
    assert batch.events == [] and batch.bad == ["too_large"]


def _sglang_map_stored(hashes: list[int], tokens: list, bs: int) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": bs,
        "lora_id": None,
    }


def test_sglang_bigram_pairs_decode_to_their_first_tokens() -> None:
    """SGLang with EAGLE/MTP publishes ``[t_j, t_j+1]`` pairs: KV slot j holds ``t_j``."""
    raw = list(range(100, 109))  # 9 raw tokens: 8 bigrams, two pages of 4
    pairs = [[raw[j], raw[j + 1]] for j in range(8)]
    batch = decode_batch(msgspec.msgpack.encode([1.0, [_sglang_map_stored([-5, 7], pairs, 4)], 0]))
    assert batch.bad == []
    (st,) = batch.events
    assert isinstance(st, BlockStored)
    assert st.token_ids == raw[:8] and st.block_size == 4 and st.hashes == [-5, 7]


@pytest.mark.parametrize(
    "tokens",
    [
        [[1, 2], [2]],  # a pair of one
        [[1, 2], [2, 3, 4]],  # a triple
        [[1, 2], 3],  # mixed
        [[1, "2"], [2, 3]],  # not an int
        [[1, 2], [2, 3.0]],
    ],
)
def test_malformed_bigram_pairs_are_bad_events(tokens: list) -> None:
    batch = decode_batch(msgspec.msgpack.encode([1.0, [_sglang_map_stored([1], tokens, 2)], 0]))
    assert batch.events == [] and batch.bad == ["wrong_type"]


def test_sliding_window_stores_may_be_sparse_but_full_attention_stores_may_not() -> None:
    """vLLM 0.33 keeps only the tail a sliding-window group needs: its stores can carry no
    hashes, or tokens that do not line up with them. A whole-prefix group's cannot."""

    def stored(kind: str, hashes: list[int], n_tokens: int) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": list(range(n_tokens)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": kind,
        }

    events = [
        stored("sliding_window", [], 48),
        stored("mamba", [9], 48),
        stored("full_attention", [9], 48),
        stored("mla_attention", [], 16),
    ]
    batch = decode_batch(msgspec.msgpack.encode([1.0, events, 0]))
    assert [e.spec_kind for e in batch.events if isinstance(e, BlockStored)] == [
        "sliding_window",
        "mamba",
    ]
    assert batch.bad == ["token_count", "wrong_type"]
