"""The simulator's Responses and Messages APIs, as vLLM serves them: the input rendered as the
chat it converts to (same tokens as ``/v1/chat/completions``), each API's body and named SSE
events, cached tokens in each API's usage, errors in each API's shape; SGLang has no
``/v1/messages``; ``/reset_prefix_cache`` and ``/flush_cache`` empty the cache."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from gateway.tokenization import Tokenizer
from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import SimConfig, TimingConfig
from loadtest.enginesim.text import load_tokenizer

SYSTEM = "You are a careful assistant. " * 20


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tk = load_tokenizer(None, None)
    assert tk is not None
    return tk


async def post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, json.loads(await r.text())


async def events(s: aiohttp.ClientSession, url: str, body: Any) -> list[tuple[str | None, Any]]:
    """(event name, data) of every SSE event, ``[DONE]`` as a string."""
    async with s.post(url, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    out: list[tuple[str | None, Any]] = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        assert data is not None, block
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


async def test_responses_render_as_the_chat_and_report_cached_tokens(tokenizer: Tokenizer) -> None:
    cfg = SimConfig(timing=TimingConfig(speedup=1000.0))
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster, aiohttp.ClientSession() as s:
        url = cluster.workers[0].http_url + "/v1/responses"
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there."}]
        body = {"model": "kvroute-sim", "instructions": SYSTEM, "input": "Hi there.",
                "max_output_tokens": 8}  # fmt: skip
        st, r1 = await post(s, url, body)
        assert st == 200 and r1["object"] == "response" and r1["status"] == "completed"
        assert r1["usage"]["input_tokens"] == len(tokenizer.encode_chat(chat))
        assert r1["usage"]["input_tokens_details"]["cached_tokens"] == 0
        answer = r1["output"][0]["content"][0]["text"]
        assert answer == " the" * 8 and r1["usage"]["output_tokens"] == 8
        # turn 2 as input items: the first turn (answer included) is a cached prefix
        items = [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi there."}]},
            {"type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": answer, "annotations": []}]},
            {"role": "user", "content": "And again?"},
        ]  # fmt: skip
        turn2 = [*chat, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "And again?"}]  # fmt: skip
        evs = await events(s, url, {"instructions": SYSTEM, "input": items,
                                    "max_output_tokens": 3, "stream": True})  # fmt: skip
        names = [n for n, _ in evs]
        assert names[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"]  # fmt: skip
        assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]  # fmt: skip
        assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
        deltas = "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
        assert deltas == " the" * 3
        usage = evs[-1][1]["response"]["usage"]
        assert usage["input_tokens"] == len(tokenizer.encode_chat(turn2))
        first_len = len(tokenizer.encode_chat(chat)) + 8 - 1
        assert usage["input_tokens_details"]["cached_tokens"] == first_len // 16 * 16
        st, err = await post(s, url, {"input": 7})
        assert st == 400 and err["error"]["message"]
        st, err = await post(s, url, {"input": "x", "previous_response_id": "resp_1"})
        assert st == 404


async def test_messages_render_as_the_chat_and_report_cache_reads(tokenizer: Tokenizer) -> None:
    cfg = SimConfig(timing=TimingConfig(speedup=1000.0))
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster, aiohttp.ClientSession() as s:
        url = cluster.workers[0].http_url + "/v1/messages"
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there."}]
        body = {"model": "kvroute-sim", "system": [{"type": "text", "text": SYSTEM}],
                "messages": [{"role": "user", "content": "Hi there."}], "max_tokens": 8}  # fmt: skip
        st, m1 = await post(s, url, body)
        assert st == 200 and m1["type"] == "message" and m1["stop_reason"] == "max_tokens"
        assert m1["usage"]["input_tokens"] == len(tokenizer.encode_chat(chat))
        assert m1["usage"]["cache_read_input_tokens"] == 0
        answer = m1["content"][0]["text"]
        turn2 = [*chat, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "And again?"}]  # fmt: skip
        msgs = [*body["messages"], {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                {"role": "user", "content": [{"type": "text", "text": "And again?"}]}]  # fmt: skip
        evs = await events(s, url, {**body, "messages": msgs, "max_tokens": 3, "stream": True})
        names = [n for n, _ in evs]
        assert names == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                         "content_block_stop", "message_delta", "message_stop", None]  # fmt: skip
        assert evs[-1][1] == "[DONE]"
        text = "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta")
        assert text == " the" * 3
        usage = evs[-3][1]["usage"]
        cached = (len(tokenizer.encode_chat(chat)) + 8 - 1) // 16 * 16
        assert usage["cache_read_input_tokens"] == cached
        assert usage["input_tokens"] + cached == len(tokenizer.encode_chat(turn2))
        st, err = await post(s, url, {"messages": [{"role": "user", "content": "x"}]})
        assert st == 400 and err["type"] == "error" and err["error"]["message"]


async def test_sglang_has_no_messages_endpoint_and_flushes(tokenizer: Tokenizer) -> None:
    cfg = SimConfig(flavor="sglang", timing=TimingConfig(speedup=1000.0))
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster, aiohttp.ClientSession() as s:
        base = cluster.workers[0].http_url
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        async with s.post(base + "/v1/messages", json=body) as r:
            assert r.status == 404
        st, r1 = await post(s, base + "/v1/responses", {"input": "Hello", "max_output_tokens": 2})
        assert st == 200 and r1["usage"]["output_tokens"] == 2
        assert cluster.workers[0].core.used_blocks >= 0
        async with s.post(base + "/flush_cache") as r:
            assert r.status == 200
