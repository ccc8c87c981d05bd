"""DeepSeek-V3-shaped workers end to end (Redis + sim workers + agents + gateway, real
processes on loopback): vLLM with its one MLA KV-cache group, and SGLang with MTP
speculative decoding (bigram token pairs). For every request the gateway's predicted cached
tokens (``x-kvroute-matched-tokens``) are compared with what the engine reported reusing
(``usage.prompt_tokens_details.cached_tokens``), once the index has absorbed the previous
turns' events."""

from __future__ import annotations

from pathlib import Path

from chat_helpers import run_chats

from loadtest.stack import Stack, StackConfig


def test_vllm_mla_worker_predicted_hits_equal_the_engines(tmp_path: Path) -> None:
    cfg = StackConfig(
        workers=2,
        flavor="vllm",
        speedup=50,
        sim_args=["--set", "cache.kv_groups=[{kind: mla_attention}]"],
        log_dir=tmp_path,
    )
    with Stack(cfg) as stack:
        rows = run_chats(stack, conversations=3, turns=3)
    assert sum(r[1] for r in rows) > 0.5 * sum(r[2] for r in rows[3:])  # hits happened
    assert [r[0] for r in rows] == [r[1] for r in rows], rows


def test_sglang_mtp_worker_predicted_hits_match_the_engines(tmp_path: Path) -> None:
    """SGLang keys its cache by bigrams under MTP: the engine reuses a position only if the
    token after it matches too, and at most N - 2 positions of an N-token prompt. The index
    keys first tokens, so it may claim one page more where a prompt leaves a cached
    sequence exactly at a page end (docs/protocol.md). Follow-up turns resume where the
    conversation's cached sequence ends, so they are exact; the system prompt shared by new
    conversations may only ever be over-claimed, by one page."""
    cfg = StackConfig(
        workers=2,
        flavor="sglang",
        speedup=50,
        sim_args=["--set", "cache.bigram_keys=true"],
        log_dir=tmp_path,
    )
    with Stack(cfg) as stack:
        rows = run_chats(stack, conversations=3, turns=3)
    page = cfg.block_size
    follow_ups = rows[3:]  # turns 2 and 3 of each conversation
    assert sum(r[1] for r in follow_ups) > 0.5 * sum(r[2] for r in follow_ups)
    assert [r[0] for r in follow_ups] == [r[1] for r in follow_ups], rows
    for predicted, reported, *_ in rows[:3]:
        assert predicted - reported in (0, page), rows
    precision = sum(r[1] for r in rows) / max(1, sum(r[0] for r in rows))
    assert precision >= 0.98, rows


def test_hybrid_gpt_oss_worker_is_routed_on_its_full_attention_group(tmp_path: Path) -> None:
    """gpt-oss numbers its sliding-window group first; follow-ups still land on the worker
    that holds the conversation and hit its cache."""
    cfg = StackConfig(
        workers=2,
        flavor="vllm",
        speedup=50,
        sim_args=[
            "--set",
            "cache.kv_groups=[{kind: sliding_window, sliding_window: 128}, {kind: full_attention}]",
        ],
        log_dir=tmp_path,
    )
    with Stack(cfg) as stack:
        rows = run_chats(stack, conversations=2, turns=3)
        assert sum(ix["blocks"] for ix in stack.index().values()) > 0
    assert sum(r[1] for r in rows) > 0.5 * sum(r[2] for r in rows[2:])  # hits happened
    assert [r[0] for r in rows] == [r[1] for r in rows], rows
