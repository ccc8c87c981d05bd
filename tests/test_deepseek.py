"""DeepSeek-V3-shaped workers end to end (Redis + sim workers + agents + gateway, real
processes on loopback): vLLM with its one MLA KV-cache group, and SGLang with MTP
speculative decoding (bigram token pairs). For every request the gateway's predicted cached
tokens (``x-kvroute-matched-tokens``) are compared with what the engine reported reusing
(``usage.prompt_tokens_details.cached_tokens``), once the index has absorbed the previous
turns' events."""

from __future__ import annotations

import random
from pathlib import Path

import openai

from loadtest.stack import Stack, StackConfig, wait_for

MODEL = "sim-model"
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
]


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def converged(stack: Stack) -> bool:
    """The gateway's index equals every agent's mirror (by key digest)."""
    return not stack.diverged()


def run_chats(stack: Stack, conversations: int, turns: int) -> list[tuple[int, int, int]]:
    """(predicted, reported cached, prompt tokens) per request of multi-turn chats that
    share a system prompt, each request sent once the index caught up with the engines."""
    client = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="none", max_retries=0)
    rng = random.Random(12)
    system = text(rng, 300)
    chats = [[{"role": "system", "content": system}] for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for msgs in chats:
            msgs.append({"role": "user", "content": text(rng, rng.randint(20, 60))})
            assert wait_for(lambda: converged(stack), 15) is not None, stack.diverged()
            r = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=msgs,  # type: ignore[arg-type]
                max_tokens=8,
            )
            comp = r.parse()
            assert comp.usage and comp.usage.prompt_tokens_details
            out.append(
                (
                    int(r.headers["x-kvroute-matched-tokens"]),
                    comp.usage.prompt_tokens_details.cached_tokens or 0,
                    comp.usage.prompt_tokens,
                )
            )
            msgs.append({"role": "assistant", "content": comp.choices[0].message.content or ""})
    return out


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
    for predicted, reported, _ in rows[:3]:
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
