"""The engine simulator's vLLM routes that the peer routers call: ``/kv_event_sources`` (vLLM
0.32+'s object keyed by rank), ``/v1/chat/completions/render`` and ``/v1/completions/render``
(vLLM's render API: a ``GenerateRequest``), ``/tokenize`` and ``/get_server_info``."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from gateway.tokenization import Tokenizer
from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import SimConfig, TimingConfig
from loadtest.enginesim.text import load_tokenizer

MODEL = "sim-model"
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three prime numbers."},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tk = load_tokenizer(None, None)
    assert tk is not None
    return tk


async def call(s: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, Any]:
    async with s.request(method, url, **kw) as r:
        return r.status, await r.json()


async def test_vllm_routes_the_peers_use(tokenizer: Tokenizer) -> None:
    cfg = SimConfig(workers=1, model=MODEL, timing=TimingConfig(speedup=200.0))
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        url = w.http_url

        st, sources = await call(s, "GET", url + "/kv_event_sources")
        assert st == 200 and list(sources) == ["0"]
        assert sources["0"] == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": w.events_endpoint,
            "replay_endpoint": w.replay_endpoint,
            "buffer_steps": cfg.events.buffer_steps,
            "hwm": cfg.events.hwm,
            "max_queue_size": 100000,
            "topic": "",
            "encoding": "msgpack",
            "schema_version": 1,
        }

        st, info = await call(s, "GET", url + "/get_server_info")
        assert st == 200 and info["block_size"] == 16 and info["served_model_name"] == MODEL

        # render: the ids the chat becomes, without generating; they are the ids the engine
        # prefills (usage) and what /tokenize says
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 7, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0}  # fmt: skip
        st, gen = await call(s, "POST", url + "/v1/chat/completions/render", json=body)
        assert st == 200
        assert set(gen) == {"request_id", "token_ids", "features", "sampling_params", "model",
                            "stream", "stream_options", "cache_salt", "priority",
                            "kv_transfer_params"}  # fmt: skip
        assert gen["request_id"].startswith("chatcmpl-") and gen["model"] == MODEL
        assert gen["stream"] is True and gen["stream_options"] == {"include_usage": True}
        assert gen["sampling_params"]["max_tokens"] == 7
        assert gen["sampling_params"]["temperature"] == 0.0
        assert gen["features"] is None and gen["priority"] == 0
        assert gen["token_ids"] == tokenizer.encode_chat(CHAT)
        assert w.core.stats.finished == 0  # nothing was generated

        st, tok = await call(s, "POST", url + "/tokenize", json={"model": MODEL, "messages": CHAT})
        assert st == 200 and tok["tokens"] == gen["token_ids"]
        assert tok["count"] == len(tok["tokens"]) and tok["token_strs"] is None
        assert tok["max_model_len"] == cfg.scheduler.max_model_len

        st, out = await call(s, "POST", url + "/v1/chat/completions",
                             json={**body, "stream": False, "stream_options": None})  # fmt: skip
        assert st == 200 and out["usage"]["prompt_tokens"] == len(gen["token_ids"])

        # completions: text with or without special tokens, token ids as they are
        st, tok = await call(s, "POST", url + "/tokenize",
                             json={"prompt": "hello world", "return_token_strs": True})  # fmt: skip
        assert tok["tokens"] == tokenizer.encode("hello world", add_special_tokens=True)
        assert "".join(tok["token_strs"]) == tokenizer.decode(tok["tokens"])
        st, bare = await call(s, "POST", url + "/tokenize",
                              json={"prompt": "hello world", "add_special_tokens": False})  # fmt: skip
        assert bare["tokens"] == tokenizer.encode("hello world", add_special_tokens=False)
        st, gens = await call(s, "POST", url + "/v1/completions/render",
                              json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})  # fmt: skip
        assert st == 200 and [g["token_ids"] for g in gens] == [[5, 6, 7]]
        assert gens[0]["request_id"].startswith("cmpl-")

        # errors are the engines' 4xx
        st, err = await call(s, "POST", url + "/v1/chat/completions/render",
                             json={"model": "other", "messages": CHAT})  # fmt: skip
        assert st == 404 and err["error"]["code"] == 404
        st, err = await call(s, "POST", url + "/tokenize", json={"prompt": 3})
        assert st == 400
        st, err = await call(s, "POST", url + "/tokenize",
                             json={"prompt": "x", "return_token_strs": "yes"})  # fmt: skip
        assert st == 400 and err["error"]["param"] == "return_token_strs"


async def test_no_event_sources_when_events_are_off(tokenizer: Tokenizer) -> None:
    cfg = SimConfig(workers=1, model=MODEL)
    cfg.events.enabled = False
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster, aiohttp.ClientSession() as s:
        st, sources = await call(s, "GET", cluster.workers[0].http_url + "/kv_event_sources")
        assert st == 200 and sources == {}


async def test_sglang_flavor_has_no_vllm_render_routes(tokenizer: Tokenizer) -> None:
    cfg = SimConfig(workers=1, model=MODEL, flavor="sglang")
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster, aiohttp.ClientSession() as s:
        url = cluster.workers[0].http_url
        async with s.post(url + "/v1/chat/completions/render", json={"messages": CHAT}) as r:
            assert r.status == 404
        async with s.get(url + "/kv_event_sources") as r:
            assert r.status == 404
