"""LoRA adapters in the engine simulator: per-adapter caches, slots, events, HTTP API."""

from __future__ import annotations

import random

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.keys import BlockKeyer
from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import (
    CacheConfig,
    EventsConfig,
    LoraConfig,
    SchedulerConfig,
    SimConfig,
    TimingConfig,
)
from loadtest.enginesim.events import EventEncoder, WireFormat
from loadtest.enginesim.lora import LoraSlots
from loadtest.enginesim.scheduler import EngineCore
from loadtest.enginesim.timing import timing_model
from worker_agent.canonical import RankCanonicaliser
from worker_agent.engines.decode import BlockStored, decode_batch

KEYER = BlockKeyer("sim-lora", 16)


def make_core(max_loras: int = 1, load_ms: float = 20.0, *, skip: bool = False) -> EngineCore:
    return EngineCore(
        CacheConfig(kv_blocks=1024, block_size=16),
        SchedulerConfig(),
        timing_model("mocker"),
        skip_lora_waits=skip,
        lora=LoraConfig(["a", "b"], max_loras=max_loras, load_ms=load_ms),
    )


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 100_000) for _ in range(n)]


def serve(core: EngineCore, tokens: list[int], lora: str | None, now: float) -> tuple[int, float]:
    """(cached tokens, TTFT) of one request served alone."""
    req = core.add_request(tokens, 2, now, lora=lora)
    core.advance(float("inf"))
    assert req.first_token_time is not None
    return req.cached_tokens, req.first_token_time - now


def test_an_adapter_reuses_only_its_own_blocks() -> None:
    core = make_core(max_loras=2)
    p = prompt(160)
    assert serve(core, p, "a", 0.0)[0] == 0
    assert serve(core, p, "a", 10.0)[0] == 144  # all but the last block
    assert serve(core, p, None, 20.0)[0] == 0  # the base never hits the adapter's blocks
    assert serve(core, p, "b", 30.0)[0] == 0  # nor does another adapter
    assert serve(core, p, None, 40.0)[0] == 144
    assert core.lookup(p, "a") == core.lookup(p, "b") == core.lookup(p) == 144
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        core.add_request(p, 2, 50.0, lora="nope")


def test_slots_load_least_recently_used_out_and_loads_cost_time() -> None:
    core = make_core(max_loras=1, load_ms=100.0)
    base_ttft = serve(core, prompt(64, 1), None, 0.0)[1]
    _, ttft_a = serve(core, prompt(64, 2), "a", 10.0)
    assert ttft_a == pytest.approx(base_ttft + 0.1)  # the load, then the same prefill
    assert serve(core, prompt(64, 3), "a", 20.0)[1] == pytest.approx(base_ttft)  # loaded
    serve(core, prompt(64, 4), "b", 30.0)  # one slot: b replaces a
    assert serve(core, prompt(64, 5), "a", 40.0)[1] == pytest.approx(base_ttft + 0.1)
    assert core.stats.lora_loads == 3


def test_a_slot_in_use_is_never_taken() -> None:
    slots = LoraSlots(1, 0.5)
    assert slots.acquire("a") == 0.5 and not slots.can_acquire("b")
    slots.release("a")
    assert slots.can_acquire("b") and slots.acquire("b") == 0.5
    assert list(slots.loaded) == ["b"]
    core = make_core(max_loras=1)
    ra = core.add_request(prompt(64, 1), 50, 0.0, lora="a")
    rb = core.add_request(prompt(64, 2), 2, 0.0, lora="b")
    core.advance(float("inf"))
    assert ra.finish_time is not None and rb.scheduled_time is not None
    assert rb.scheduled_time >= ra.finish_time  # b waited for a's slot


@pytest.mark.parametrize("skip", [True, False])
def test_a_request_waiting_for_a_slot_holds_back_the_queue_only_on_sglang(skip: bool) -> None:
    """vLLM skips a waiting request whose adapter would exceed max_loras and schedules the
    ones behind it; SGLang's batch stops at it (each engine's scheduler, see the module)."""
    core = make_core(max_loras=1, skip=skip)
    ra = core.add_request(prompt(64, 1), 50, 0.0, lora="a")  # holds the one slot a while
    rb1 = core.add_request(prompt(64, 2), 2, 0.0, lora="b")
    rb2 = core.add_request(prompt(64, 3), 2, 0.0, lora="b")
    ra2 = core.add_request(prompt(64, 4), 2, 0.0, lora="a")  # behind b, on a's slot
    rbase = core.add_request(prompt(64, 5), 2, 0.0)  # the base model needs no slot
    core.advance(float("inf"))
    done = (ra, rb1, rb2, ra2, rbase)
    assert all(r.finish_time is not None and r.scheduled_time is not None for r in done)
    assert ra.finish_time is not None and rb1.scheduled_time is not None
    assert rb1.scheduled_time >= ra.finish_time  # b waits for a's slot either way
    assert rb1.scheduled_time <= rb2.scheduled_time  # and the skipped keep their order
    assert ra2.scheduled_time is not None and rbase.scheduled_time is not None
    if skip:  # vLLM: the requests behind b run beside a
        assert ra2.scheduled_time < ra.finish_time and rbase.scheduled_time < ra.finish_time
    else:  # SGLang: nothing passes b
        assert ra2.scheduled_time >= rb1.scheduled_time
        assert rbase.scheduled_time >= rb1.scheduled_time


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_adapter_events_carry_the_name_and_canonicalise_on_its_chain(engine: str) -> None:
    """The simulator's own event bytes through the agent's decoder and canonicaliser."""
    page = 16 if engine == "vllm" else 1
    core = EngineCore(
        CacheConfig(kv_blocks=4096, block_size=page),
        SchedulerConfig(),
        timing_model("mocker"),
        lora=LoraConfig(["a"]),
    )
    enc = EventEncoder(WireFormat(engine, "map", page))  # type: ignore[arg-type]
    canon = RankCanonicaliser(KEYER)
    p = prompt(64)
    for lora, t in ((None, 0.0), ("a", 1.0)):
        core.add_request(p, 1, t, lora=lora)
        for res in core.advance(float("inf")):
            batch = decode_batch(enc.encode(res.events, t))
            for ev in batch.events:
                assert isinstance(ev, BlockStored) and ev.lora_name == lora
                canon.stored(ev)
    assert canon.held == set(KEYER.keys(p)) | set(KEYER.keys(p, KEYER.adapter_root("a")))
    assert len(canon.held) == 8 and not canon.dropped


def test_sglang_array_encoding_cannot_name_adapters() -> None:
    from gateway.contract.settings import ConfigError

    with pytest.raises(ConfigError, match="lora_name"):
        SimConfig(flavor="sglang", events=EventsConfig(encoding="array"), lora=LoraConfig(["a"]))


async def test_models_list_and_requests_by_adapter_name() -> None:
    cfg = SimConfig(
        tokenizer="none",
        timing=TimingConfig(speedup=50.0),
        lora=LoraConfig(["sql", "chat"], max_loras=1),
    )
    async with SimCluster(cfg, tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        url = cluster.workers[0].http_url
        async with s.get(url + "/v1/models") as r:
            cards = (await r.json())["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [
            ("kvroute-sim", None), ("sql", "kvroute-sim"), ("chat", "kvroute-sim"),
        ]  # fmt: skip
        body = {"prompt": list(range(1000, 1100)), "max_tokens": 2}
        cached = []
        for model in ("sql", "sql", "kvroute-sim", "chat"):
            async with s.post(url + "/v1/completions", json={**body, "model": model}) as r:
                assert r.status == 200
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, 96, 0, 0]
        async with s.post(url + "/v1/completions", json={**body, "model": "nope"}) as r:
            assert r.status == 404
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        assert 'vllm:lora_requests_info{max_lora="1"' in text


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.sampled_from([None, "a", "b"]),
            st.integers(0, 2),  # which shared prefix
            st.integers(0, 80),  # its length used
            st.lists(st.integers(1, 50), max_size=40),  # a private tail
        ),
        min_size=1,
        max_size=25,
    )
)
def test_cached_tokens_against_a_per_adapter_reference(
    requests: list[tuple[str | None, int, int, list[int]]],
) -> None:
    """No eviction, one request at a time: a request's cached tokens are its longest
    block-aligned common prefix with an earlier prompt *of the same adapter* (never the
    last token), whatever the other adapters and the base model cached."""
    core = EngineCore(
        CacheConfig(kv_blocks=4096, block_size=4),
        SchedulerConfig(),
        timing_model("mocker"),
        lora=LoraConfig(["a", "b"], max_loras=2),
    )
    prefixes = [prompt(80, 100 + i) for i in range(3)]
    seen: list[tuple[str | None, list[int]]] = []
    for i, (lora, which, n, tail) in enumerate(requests):
        p = prefixes[which][:n] + tail
        if not p:
            continue
        usable = (len(p) - 1) // 4
        want = 0
        for other_lora, q in seen:
            if other_lora == lora:
                common = next(
                    (k for k, (x, y) in enumerate(zip(p, q, strict=False)) if x != y),
                    min(len(p), len(q)),
                )
                want = max(want, min(common // 4, len(q) // 4, usable))
        req = core.add_request(p, 1, float(i), lora=lora)
        core.advance(float("inf"))
        assert req.cached_tokens == want * 4
        seen.append((lora, p))
