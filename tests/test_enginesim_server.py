"""The simulator as a live server on loopback: OpenAI + engine endpoints, cached tokens in
``usage``, KV events on ZMQ decoded with the engines' field lists, metrics, bad input."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from test_enginesim_events import ChainChecker, decode_batch

from gateway.tokenization import Tokenizer
from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import (
    CacheConfig,
    EventsConfig,
    SchedulerConfig,
    SimConfig,
    TimingConfig,
)
from loadtest.enginesim.text import TextCodec, load_tokenizer
from loadtest.enginesim.worker import SimWorker

FAST = TimingConfig(speedup=1000.0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tk = load_tokenizer(None, None)
    assert tk is not None
    return tk


def sim_config(**kw: Any) -> SimConfig:
    kw.setdefault("timing", FAST)
    return SimConfig(**kw)


async def until(cond: Callable[[], bool], limit: float = 5.0) -> None:
    """Poll a condition the test can observe, for at most ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


async def post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def sse(s: aiohttp.ClientSession, url: str, body: Any) -> list[Any]:
    """The data items of an SSE response, ``"[DONE]"`` included."""
    out: list[Any] = []
    async with s.post(url, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


class Tap:
    """A live subscriber to one worker's KV events that checks every hash as it goes."""

    def __init__(self, ctx: zmq.asyncio.Context, worker: SimWorker) -> None:
        cfg = worker.config
        self.worker = worker
        self.engine, self.encoding = cfg.flavor, cfg.events.encoding
        self.checker = ChainChecker(cfg.flavor, cfg.cache.block_size)
        self.events: list[dict[str, Any]] = []
        self.next = 0
        self.ctx = ctx
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(worker.events_endpoint or "")

    async def sync(self, s: aiohttp.ClientSession) -> None:
        """Send one-block requests until the subscription is live; replay what it missed."""
        bs = self.worker.config.cache.block_size
        for i in range(500):
            await post(s, self.worker.http_url + "/v1/completions",
                       {"prompt": [50_000 + i] * (bs + 1), "max_tokens": 1})  # fmt: skip
            if await self.sub.poll(20):
                break
        else:
            raise AssertionError("no KV events arrived")
        _, seq, payload = await self.sub.recv_multipart()
        first = int.from_bytes(seq, "big")
        for frames in await replay(self.ctx, self.worker, 0, first):
            self._take(int.from_bytes(frames[-2], "big"), frames[-1])
        self._take(first, payload)

    async def drain(self) -> list[dict[str, Any]]:
        """Every batch published so far, live, with no gap."""
        assert self.worker.publisher is not None
        while self.next < self.worker.publisher.next_seq:
            _, seq, payload = await asyncio.wait_for(self.sub.recv_multipart(), 5)
            self._take(int.from_bytes(seq, "big"), payload)
        return self.events

    def _take(self, seq: int, payload: bytes) -> None:
        assert seq == self.next, f"gap: expected {self.next}, got {seq}"
        self.next += 1
        _, events, rank = decode_batch(payload, self.engine, self.encoding)
        assert rank == 0
        for ev in events:
            self.checker.apply(ev)
        self.events.extend(events)

    def close(self) -> None:
        self.sub.close()


async def replay(
    ctx: zmq.asyncio.Context, worker: SimWorker, start: int, end: int
) -> list[list[bytes]]:
    """Batches ``start..end-1`` from the worker's replay socket."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(worker.replay_endpoint or "")
    out = []
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            if frames[-2] == b"\xff" * 8:
                return [f for f in out if int.from_bytes(f[-2], "big") < end]
            out.append(frames)
    finally:
        dealer.close()


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


# -- cache hits and events -------------------------------------------------------------------


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_repeated_prefix_hits_and_events_decode(
    flavor: str, encoding: str, zctx: zmq.asyncio.Context
) -> None:
    cfg = sim_config(
        flavor=flavor,
        tokenizer="none",
        cache=CacheConfig(kv_blocks=48, block_size=4),
        events=EventsConfig(encoding=encoding),  # type: ignore[arg-type]
    )
    async with SimCluster(cfg, tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        tap = Tap(zctx, w)
        try:
            await tap.sync(s)
            url = w.http_url + "/v1/completions"
            prefix = list(range(1000, 1040))  # 10 blocks
            st, a = await post(s, url, {"prompt": [*prefix, 1, 2, 3, 4, 5, 6], "max_tokens": 2})
            assert st == 200 and a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            st, b = await post(s, url, {"prompt": [*prefix, 7, 8, 9, 10, 11], "max_tokens": 2})
            assert st == 200 and b["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
            assert b["usage"]["prompt_tokens"] == 45 and b["usage"]["completion_tokens"] == 2
            for i in range(4):  # unrelated 15-block prompts push the prefix out of 48 blocks
                other = list(range(5000 + 100 * i, 5060 + 100 * i))
                st, _ = await post(s, url, {"prompt": other, "max_tokens": 1})
                assert st == 200
            events = await tap.drain()
        finally:
            tap.close()
    stored = [e for e in events if e["type"] == "BlockStored"]
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert removed, "eviction produced no BlockRemoved"
    tokens = [t for e in stored for t in e["token_ids"]]
    joined = ",".join(map(str, tokens))
    assert ",".join(map(str, prefix)) in joined  # the prefix was stored, token for token
    assert all(e["block_size"] == 4 for e in stored)


async def test_a_reset_during_a_step_waits_for_its_delivery() -> None:
    """A cache reset that arrives while a step's results are still on their way (the driver
    sleeps for the step's duration; the step finished the last request, so nothing runs)
    runs after the step is delivered, as vLLM runs one between steps. Before, it ran at once
    and its clear reached the event encoder before the step's stores, whose parent block the
    clear had dropped: the driver died on the lookup and the worker never stepped again, so
    the next request hung (seen in `loadtest compare`, where every system's run is followed
    by a reset: the peers measured after it met dead engines)."""
    slow = TimingConfig(speedup=0.05)  # a mocker step of ~0.3-0.4 s: a window to reset in
    cfg = sim_config(tokenizer="none", cache=CacheConfig(kv_blocks=64, block_size=4), timing=slow)
    async with SimCluster(cfg, tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        url = w.http_url + "/v1/completions"
        prefix = list(range(1000, 1016))
        st, _ = await post(s, url, {"prompt": prefix, "max_tokens": 1})
        assert st == 200
        # the next prompt extends the cached prefix: its step stores blocks under a parent
        second = asyncio.create_task(
            post(s, url, {"prompt": [*prefix, 1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 1})
        )
        await until(lambda: w.core.stats.finished == 2)  # computed, not yet delivered
        assert not second.done()
        st, res = await post(s, w.http_url + "/reset_prefix_cache", {})
        assert (st, res) == (200, {"success": True})
        assert second.done() and (await second)[0] == 200  # delivered before the reset
        assert w.core.cache.cached_blocks == 0
        driver = w.ranks[0].driver
        assert driver is not None and not driver.done()
        st, third = await asyncio.wait_for(post(s, url, {"prompt": prefix, "max_tokens": 1}), 10)
        assert st == 200 and third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_engine_time_lost_to_a_late_host_is_counted() -> None:
    """A simulated engine steps in real time on this host's event loop; when the loop is
    late (other workers' streams, a router process eating the CPU) the engine sits between
    steps with work waiting, where a GPU would not: ``step_lag_s`` counts that time, so a
    comparison can tell whether two routers' runs had the same engines. A loop blocked while
    the engine is idle costs it nothing."""
    real_time = TimingConfig(speedup=1.0)  # mocker decode steps of ~25 ms: 60 take ~1.5 s
    cfg = sim_config(
        tokenizer="none", cache=CacheConfig(kv_blocks=256, block_size=4), timing=real_time
    )
    async with SimCluster(cfg, tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        url = w.http_url + "/v1/completions"
        loop = asyncio.get_running_loop()
        loop.call_soon(time.sleep, 0.3)  # idle: nothing to lose
        await asyncio.sleep(0)
        assert w.state()["step_lag_s"] == 0.0
        run = asyncio.create_task(post(s, url, {"prompt": list(range(16)), "max_tokens": 60}))
        await until(lambda: w.core.num_running == 1)
        loop.call_soon(time.sleep, 0.3)  # the host is late mid-run
        st, _ = await run
        assert st == 200
        lag = w.state()["step_lag_s"]
        assert 0.25 <= lag < 2.0  # the 0.3 s block, less the step it fell in, plus overheads
        assert lag == round(w.ranks[0].lag, 4)


async def test_usage_in_streams_and_shapes(zctx: zmq.asyncio.Context) -> None:
    cfg = sim_config(tokenizer="none")
    async with SimCluster(cfg, tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        url = cluster.workers[0].http_url
        body = {"prompt": list(range(1, 40)), "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        items = await sse(s, url + "/v1/completions", body)
        assert items[-1] == "[DONE]"
        text = "".join(c["choices"][0]["text"] for c in items[:-2])
        assert text == " the" * 5
        assert [c["choices"][0]["finish_reason"] for c in items[:-2]][-1] == "length"
        usage = items[-2]["usage"]
        assert items[-2]["choices"] == [] and usage["completion_tokens"] == 5
        again = await sse(s, url + "/v1/completions", body)
        assert again[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        st, models = await post(s, url + "/v1/models", {})
        assert st == 405  # GET only
        async with s.get(url + "/v1/models") as r:
            models = await r.json()
        assert models["data"][0]["id"] == "kvroute-sim"
        async with s.get(url + "/health") as r:
            assert r.status == 200


async def test_chat_is_tokenized_with_the_template(tokenizer: Tokenizer) -> None:
    cfg = sim_config()
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster, aiohttp.ClientSession() as s:
        url = cluster.workers[0].http_url + "/v1/chat/completions"
        system = {"role": "system", "content": "You are a careful assistant. " * 20}
        turn1 = [system, {"role": "user", "content": "Name three rivers."}]
        st, r1 = await post(s, url, {"model": "kvroute-sim", "messages": turn1, "max_tokens": 8})
        assert st == 200
        assert r1["usage"]["prompt_tokens"] == len(tokenizer.encode_chat(turn1))
        answer = r1["choices"][0]["message"]["content"]
        assert answer == " the" * 8 and r1["choices"][0]["finish_reason"] == "length"
        turn2 = [*turn1, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "And three lakes?"}]  # fmt: skip
        items = await sse(s, url, {"messages": turn2, "max_tokens": 3, "stream": True,
                                   "stream_options": {"include_usage": True}})  # fmt: skip
        assert items[0]["choices"][0]["delta"]["role"] == "assistant"
        assert (
            "".join(c["choices"][0]["delta"].get("content", "") for c in items[:-2]) == " the" * 3
        )
        cached = items[-2]["usage"]["prompt_tokens_details"]["cached_tokens"]
        # the whole first turn, answer included, was cached (minus the partial block)
        first_len = len(tokenizer.encode_chat(turn1)) + 8 - 1
        assert cached == first_len // 16 * 16
        base = cluster.workers[0].http_url
        st, tok = await post(s, base + "/tokenize", {"messages": turn1})
        assert st == 200 and tok["tokens"] == tokenizer.encode_chat(turn1)
        st, text = await post(s, base + "/detokenize", {"tokens": tok["tokens"]})
        assert st == 200 and text["prompt"] == tokenizer.decode(tok["tokens"])
        st, _ = await post(s, base + "/detokenize", {"tokens": [2**40]})
        assert st == 400
        st, text = await post(s, cluster.workers[0].http_url + "/v1/completions",
                              {"prompt": "Hello world", "max_tokens": 1})  # fmt: skip
        assert st == 200 and text["usage"]["prompt_tokens"] == len(tokenizer.encode("Hello world"))


def test_output_text_of_a_multi_token_pattern(tokenizer: Tokenizer) -> None:
    codec = TextCodec(tokenizer, " the quick brown fox")
    pieces = [tokenizer.decode([i]) for i in codec.output_ids]
    assert len(pieces) > 1 and "".join(pieces) == " the quick brown fox"
    for a, b in ((0, 0), (0, 1), (1, 7), (3, 4), (2, 13)):
        assert codec.output_text(a, b) == "".join(pieces[i % len(pieces)] for i in range(a, b))


# -- bad input -------------------------------------------------------------------------------


async def test_bad_input_gets_openai_style_4xx(tokenizer: Tokenizer) -> None:
    cfg = sim_config(max_body_bytes=4096, scheduler=SchedulerConfig(max_model_len=100))
    async with SimCluster(cfg, tokenizer=tokenizer) as cluster, aiohttp.ClientSession() as s:
        base = cluster.workers[0].http_url
        comp, chat = base + "/v1/completions", base + "/v1/chat/completions"
        cases: list[tuple[str, Any, int]] = [
            (comp, b"{not json", 400),
            (comp, b"\xff\xfe{}", 400),
            (comp, b"[1, 2]", 400),
            (comp, {"prompt": [1, 2], "max_tokens": "many"}, 400),
            (comp, {"prompt": [1, 2], "max_tokens": 0}, 400),
            (comp, {"prompt": [1, 2], "max_tokens": True}, 400),
            (comp, {"prompt": [1, 2], "model": "gpt-9"}, 404),
            (comp, {"prompt": [1, "x"]}, 400),
            (comp, {"prompt": [-1]}, 400),
            (comp, {"prompt": [10**9]}, 400),  # out of vocabulary
            (comp, {"prompt": []}, 400),
            (comp, {"prompt": None}, 400),
            (comp, {"prompt": [1] * 90, "max_tokens": 20}, 400),  # over the context length
            (comp, {"prompt": [1], "n": 2}, 400),
            (comp, {"prompt": [1], "temperature": "hot"}, 400),
            (comp, {"prompt": [1], "stream_options": {"include_usage": True}}, 400),
            (comp, {"prompt": [1], "min_tokens": 5, "max_tokens": 2}, 400),
            (comp, {"prompt": [[1], [2]]}, 400),
            (comp, b"{" + b'"prompt": "' + b"x" * 5000 + b'"}', 413),
            (chat, {"messages": "hi"}, 400),
            (chat, {"messages": []}, 400),
            (chat, {"messages": [{"role": 5, "content": "x"}]}, 400),
            (chat, {"messages": [{"role": "user", "content": {"a": 1}}]}, 400),
            (chat, {"messages": [{"role": "user", "content": "x"}], "tools": "no"}, 400),
            (base + "/nowhere", {}, 404),
        ]
        for url, body, status in cases:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with s.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
                payload = await r.json(content_type=None)
                assert r.status == status, (body, payload)
                err = payload["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
        async with s.get(comp) as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == 405
        st, _ = await post(s, comp, {"prompt": [1, 2, 3], "max_tokens": 1})
        assert st == 200  # still serving


# -- metrics and engine endpoints ------------------------------------------------------------


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


async def test_vllm_metrics_and_endpoints(zctx: zmq.asyncio.Context) -> None:
    cfg = sim_config(tokenizer="none", timing=TimingConfig(speedup=20.0))
    async with SimCluster(cfg, tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        p = {"prompt": list(range(1, 101)), "max_tokens": 3}
        for _ in range(2):
            assert (await post(s, w.http_url + "/v1/completions", p))[0] == 200
        async with s.get(w.http_url + "/metrics") as r:
            text = await r.text()
        labels = '{engine="0",model_name="kvroute-sim"}'
        assert f"vllm:num_requests_running{labels} 0.0" in text
        assert metric(text, "vllm:prefix_cache_queries_total") == 200
        assert metric(text, "vllm:prefix_cache_hits_total") == 96
        assert metric(text, "vllm:prompt_tokens_total") == 200
        assert metric(text, "vllm:generation_tokens_total") == 6
        assert metric(text, "vllm:request_success_total") == 2
        assert metric(text, "vllm:time_to_first_token_seconds_count") == 2
        assert metric(text, "vllm:e2e_request_latency_seconds_count") == 2
        for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:inter_token_latency_seconds_count"):  # fmt: skip
            metric(text, name)
        for path, key in (("/load", "server_load"), ("/version", "version"),
                          ("/sim/state", "stats")):  # fmt: skip
            async with s.get(w.http_url + path) as r:
                assert r.status == 200 and key in await r.json()
        async with s.get(w.http_url + "/sim/state") as r:
            assert (await r.json())["event_format"] == "0.33"
        async with s.get(w.http_url + "/ping") as r:
            assert r.status == 200
        async with s.get(w.http_url + "/kv_event_sources") as r:
            src = (await r.json())["0"]  # vLLM 0.32+: keyed by rank
        assert (src["endpoint"], src["replay_endpoint"], src["topic"]) == (
            w.events_endpoint, w.replay_endpoint, ""
        )  # fmt: skip
        assert src["encoding"] == "msgpack" and src["schema_version"] == 1
        assert src["enable_kv_cache_events"] is True
        # a long request keeps the engine busy: the reset is refused
        body = {"prompt": [9] * 20, "max_tokens": 2000, "stream": True}
        async with s.post(w.http_url + "/v1/completions", json=body) as stream:
            await stream.content.readline()  # the first token: the request is running
            st, res = await post(s, w.http_url + "/reset_prefix_cache", {})
            assert st == 200 and res == {"success": False}
        await until(lambda: not w.busy)  # the aborted stream leaves the engine
        st, res = await post(s, w.http_url + "/reset_prefix_cache", {})
        assert res == {"success": True}
        assert w.core.cache.cached_blocks == 0


async def test_sglang_endpoints_and_metrics(zctx: zmq.asyncio.Context) -> None:
    cfg = sim_config(flavor="sglang", tokenizer="none", cache=CacheConfig(block_size=1),
                     timing=TimingConfig(speedup=20.0))  # fmt: skip
    async with SimCluster(cfg, tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        async with s.get(w.http_url + "/server_info") as r:
            info = await r.json()
        kv = info["kv_events"]
        assert kv["publisher"] == "zmq" and kv["block_size"] == 1 and kv["dp_size"] == 1
        assert f"tcp://{kv['endpoint_host']}:{kv['endpoint_port_base']}" == w.events_endpoint
        assert kv["replay_endpoint_port_base"] == int((w.replay_endpoint or "").rsplit(":", 1)[1])
        async with s.get(w.http_url + "/model_info") as r:
            assert (await r.json())["is_generation"] is True
        async with s.get(w.http_url + "/health_generate") as r:
            assert r.status == 200
        gen = {"input_ids": list(range(1, 30)), "sampling_params": {"max_new_tokens": 4}}
        st, out = await post(s, w.http_url + "/generate", gen)
        assert st == 200 and out["meta_info"]["completion_tokens"] == 4
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        items = await sse(s, w.http_url + "/generate", {**gen, "stream": True})
        assert items[-1] == "[DONE]" and items[-2]["text"] == " the" * 4
        assert items[-2]["meta_info"]["cached_tokens"] == 28
        async with s.get(w.http_url + "/metrics") as r:
            text = await r.text()
        assert metric(text, "sglang:cache_hit_rate") > 0
        async with s.get(w.http_url + "/get_load") as r:
            assert (await r.json())[0]["num_reqs"] == 0
        async with s.get(w.http_url + "/v1/loads") as r:
            assert (await r.json())["loads"][0]["cache_hit_rate"] > 0
        for name in (
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
            "sglang:max_total_num_tokens",
            "sglang:kv_used_tokens",
            "sglang:prompt_tokens_total",
            "sglang:time_to_first_token_seconds_count",
        ):
            metric(text, name)  # fmt: skip
        assert 'engine_type="unified"' in text
        body = {"input_ids": [3] * 10, "sampling_params": {"max_new_tokens": 2000}, "stream": True}
        async with s.post(w.http_url + "/generate", json=body) as stream:
            await stream.content.readline()
            async with s.post(w.http_url + "/flush_cache") as r:
                assert r.status == 400
        await until(lambda: not w.busy)
        async with s.get(w.http_url + "/flush_cache") as r:
            assert r.status == 200
        assert w.core.cache.cached_blocks == 0
