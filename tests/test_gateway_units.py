"""Gateway parts without I/O: request validation, circuit breaker, admission, allow-list, SSE."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.circuit import Circuit, CircuitState
from gateway.errors import ApiError
from gateway.limits import Admission, TokenBucket
from gateway.proxy import _SseFilter, _with_usage, parse_usage
from gateway.registry import check_upstream_url
from gateway.requests import parse_body, too_long


def body(**kw: object) -> bytes:
    return json.dumps(kw).encode()


# -- request validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "kind", "code"),
    [
        (b"\xff\xfe{}", "chat", "invalid_utf8"),
        (b"{not json", "chat", "invalid_json"),
        (b"", "chat", "invalid_json"),
        (b"[1, 2]", "chat", "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "chat", "invalid_json"),
        (body(model="m"), "chat", "missing_field"),
        (body(model="m", messages=[]), "chat", "invalid_type"),
        (body(model="m", messages="hi"), "chat", "invalid_type"),
        (body(model=5, messages=[{"role": "user", "content": "x"}]), "chat", "invalid_type"),
        (body(model="m", messages=[{}], stream="yes"), "chat", "invalid_type"),
        (body(model="m", messages=[{}], max_tokens=-1), "chat", "invalid_value"),
        (body(model="m", messages=[{}], max_tokens=True), "chat", "invalid_type"),
        (body(model="m", messages=[{}], temperature="hot"), "chat", "invalid_type"),
        (body(model="m", messages=[{}], n=0), "chat", "invalid_value"),
        (
            body(model="m", messages=[{}], stream_options={"include_usage": 1}),
            "chat",
            "invalid_type",
        ),
        (body(model="m"), "completion", "missing_field"),
        (body(model="m", prompt=[]), "completion", "invalid_type"),
        (body(model="m", prompt=[1, -2]), "completion", "invalid_type"),
        (body(model="m", prompt=[1, True]), "completion", "invalid_type"),
        (body(model="m", prompt=[[1], []]), "completion", "invalid_type"),
        (body(model="m", prompt=["a", 1]), "completion", "invalid_type"),
        (body(model="m", prompt={"a": 1}), "completion", "invalid_type"),
        (body(sampling_params={}), "generate", "missing_field"),
        (body(text="x", sampling_params={"max_new_tokens": -1}), "generate", "invalid_type"),
    ],
)
def test_bad_bodies_are_400_with_a_code(raw: bytes, kind: str, code: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_body(raw, kind)  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.code == code
    parsed = json.loads(err.value.body())
    assert set(parsed["error"]) == {"message", "type", "param", "code"}


def test_good_bodies_parse_and_unknown_fields_survive() -> None:
    raw = body(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        max_tokens=7,
        vendor_x={"a": 1},
    )
    r = parse_body(raw, "chat")
    assert r.stream and r.max_tokens == 7 and r.raw == raw and not r.include_usage
    again = json.loads(r.with_changes(stream_options={"include_usage": True}))
    assert again["vendor_x"] == {"a": 1} and again["stream_options"] == {"include_usage": True}
    assert list(again)[:2] == ["model", "messages"]  # order kept
    c = parse_body(body(model="m", prompt=[[5, 6], [7]]), "completion")
    assert c.prompt_ids == [5, 6] and c.prompt_text is None
    g = parse_body(body(text=["a", "b"], sampling_params={"max_new_tokens": 3}), "generate")
    assert g.prompt_text == "a" and g.max_tokens == 3 and g.model is None


def test_context_limit_like_vllm() -> None:
    assert too_long(10, 5, 100) is None
    assert too_long(100, None, 100) is not None
    err = too_long(90, 20, 100)
    assert err is not None and err.code == "context_length_exceeded" and err.status == 400


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=300)
    | st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=20,
    ).map(lambda v: json.dumps(v).encode())
)
def test_fuzzed_bodies_never_raise_anything_but_4xx(raw: bytes) -> None:
    for kind in ("chat", "completion", "generate"):
        try:
            parse_body(raw, kind)  # type: ignore[arg-type]
        except ApiError as exc:
            assert 400 <= exc.status < 500


# -- circuit breaker -----------------------------------------------------------------------------


def test_circuit_opens_half_opens_and_closes() -> None:
    c = Circuit(failure_threshold=3, open_seconds=2.0)
    for t in range(2):
        c.on_failure(float(t))
    assert c.allows(2.0)
    c.on_failure(2.0)
    assert c.state is CircuitState.OPEN and not c.allows(3.0)
    assert c.allows(4.0) and c.state is CircuitState.HALF_OPEN
    c.on_send()
    assert not c.allows(4.1)  # one probe at a time
    c.on_failure(4.2)
    assert c.state is CircuitState.OPEN and not c.allows(5.0)
    assert c.allows(6.3)
    c.on_send()
    c.on_success()
    assert c.state is CircuitState.CLOSED and c.allows(6.4)


def test_refused_connection_opens_at_once() -> None:
    c = Circuit(failure_threshold=5)
    c.on_failure(1.0, fatal=True)
    assert c.state is CircuitState.OPEN and c.opens == 1


# -- admission ---------------------------------------------------------------------------------


async def until(cond: Callable[[], bool]) -> None:
    """Yield to the event loop until ``cond()`` holds: the tasks under test run on this
    loop, so a bounded number of turns is enough; no wall-clock waiting."""
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)  # one loop turn, not a timed wait
    raise AssertionError("condition never held")


async def test_admission_priority_full_and_timeout() -> None:
    adm = Admission(max_concurrency=1, queue_size=2, queue_timeout=5.0)
    await adm.acquire()
    order: list[str] = []

    async def wait(name: str, prio: int) -> None:
        await adm.acquire(prio)
        order.append(name)

    low = asyncio.create_task(wait("low", 0))
    high = asyncio.create_task(wait("high", 5))
    await until(lambda: adm.queued == 2)
    with pytest.raises(ApiError) as full:
        await adm.acquire()
    assert full.value.status == 429
    adm.release()
    await high
    assert order == ["high"] and not low.done()
    adm.release()
    await low
    assert order == ["high", "low"] and adm.in_flight == 1
    short = Admission(max_concurrency=1, queue_size=4, queue_timeout=0.05)
    await short.acquire()
    with pytest.raises(ApiError) as late:
        await short.acquire()
    assert late.value.status == 408
    short.release()
    assert short.in_flight == 0


async def test_admission_cancelled_waiter_gives_its_slot_back() -> None:
    adm = Admission(max_concurrency=1, queue_size=4, queue_timeout=5.0)
    await adm.acquire()
    t = asyncio.create_task(adm.acquire())
    await until(lambda: adm.queued == 1)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    adm.release()
    assert adm.in_flight == 0


def test_token_bucket() -> None:
    b = TokenBucket(rate=10, burst=20)
    assert b.take(20, now=0.0) == 0.0
    assert b.take(5, now=0.0) == pytest.approx(0.5)
    assert b.take(5, now=0.5) == 0.0
    b.charge(100, now=0.5)
    assert b.take(1, now=0.6) > 9
    assert TokenBucket(0, 0).take(1e9, 0.0) == 0.0


# -- upstream allow-list ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "allowed", "ok"),
    [
        ("http://10.1.2.3:8000", ["10.0.0.0/8"], True),
        ("http://10.1.2.3:8000", ["192.168.0.0/16"], False),
        ("http://vllm-0.pool.svc:8000", ["*.pool.svc"], True),
        ("http://evil.example.com", ["*.pool.svc"], False),
        ("http://anything:1", [], True),
        ("file:///etc/passwd", [], False),
        ("gopher://x", [], False),
        ("http://user:pw@host:1", [], False),
        ("http://host:1/?redirect=x", [], False),
        ("http://", [], False),
    ],
)
def test_upstream_urls_checked(url: str, allowed: list[str], ok: bool) -> None:
    assert (check_upstream_url(url, allowed) is None) == ok


# -- SSE pass-through ---------------------------------------------------------------------------


def test_sse_filter_strips_injected_usage_and_keeps_it() -> None:
    events = [
        b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n',
        b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":8},"completion_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    for cut in range(1, len(stream)):  # any chunking gives the same output
        f = _SseFilter(strip_usage=True)
        out = f.feed(stream[:cut]) + f.feed(stream[cut:]) + f.flush()
        assert out == events[0] + events[1] + events[3]
        assert f.done
        u = parse_usage(f.usage)
        assert u is not None and (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (
            10,
            8,
            2,
        )
    keep = _SseFilter(strip_usage=False)
    assert keep.feed(stream) == stream


def test_usage_from_sglang_meta_info() -> None:
    f = _SseFilter(strip_usage=False)
    f.feed(
        b'data: {"text":"a","meta_info":{"prompt_tokens":5,"cached_tokens":3,"completion_tokens":1}}\n\ndata: [DONE]\n\n'
    )
    u = parse_usage(f.usage)
    assert u is not None and u.cached_tokens == 3
    assert (
        parse_usage(
            [
                {"meta_info": {"prompt_tokens": 2, "cached_tokens": 1}},
                {"meta_info": {"prompt_tokens": 3}},
            ]
        ).prompt_tokens
        == 5
    )  # type: ignore[union-attr]
    assert parse_usage({"usage": {"prompt_tokens": True}}).prompt_tokens == 0  # type: ignore[union-attr]


def test_usage_request_spliced_without_reencoding() -> None:
    raw = rb'  {"model": "m", "messages": [{"role": "user", "content": "\u00e9"}], "stream": true}'
    creq = parse_body(raw, "chat")
    out = json.loads(_with_usage(raw, creq))
    assert out == {**creq.body, "stream_options": {"include_usage": True}}
    raw2 = body(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        stream_options={"continuous_usage_stats": False},
    )
    out2 = json.loads(_with_usage(raw2, parse_body(raw2, "chat")))
    assert out2["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def test_pool_engine_block_size_follows_the_registrations() -> None:
    """An agent learns its engine's block size after registering (vLLM says it in
    /metrics): the pool's predicted reuse follows the updated registration."""
    from types import SimpleNamespace

    from gateway.config import CircuitSettings
    from gateway.contract.wire import WorkerInfo
    from gateway.registry import Registry
    from gateway.routing.policy import make_policy
    from gateway.routing.router import Router

    router = Router(make_policy("round_robin"), 16)
    pool = SimpleNamespace(
        settings=SimpleNamespace(model="m", aliases=[]),
        router=router,
        decode_router=router,
        router_for=lambda role: router,
    )
    reg = Registry([pool], CircuitSettings(), [])  # type: ignore[list-item]

    def info(wid: str, ebs: int) -> WorkerInfo:
        return WorkerInfo(
            wid, f"http://127.0.0.1:{9000 + int(wid[1:])}", "m", engine_block_size=ebs
        )

    reg.sync({"w0": info("w0", 16)})
    assert router.engine_block_size == 16
    reg.sync({"w0": info("w0", 32), "w1": info("w1", 32)})  # learned from the engine
    assert router.engine_block_size == 32
    reg.sync({})
    assert router.engine_block_size == 1  # no worker left: any canonical boundary


def test_sse_filter_passes_plain_events_through_as_the_event_by_event_path_does() -> None:
    """Chunks of whole events that hold nothing the filter acts on leave as they came; any
    chunking of a stream mixing them with usage, SGLang meta_info, named events and [DONE]
    gives the output and the usage that cutting at every byte gives."""
    plain = [b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(6)]
    f = _SseFilter(strip_usage=True)
    for chunk in (plain[0], plain[1] + plain[2], b"data: x\n\n\n\n"):
        assert f.feed(chunk) is chunk  # the fast path: not even copied
    assert not f.buf and not f.done
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1}}\n\n'
    meta = b'data: {"text":"a","meta_info":{"prompt_tokens":5,"cached_tokens":3}}\n\n'
    named = b'event: message_start\ndata: {"type":"message_start"}\n\n'
    stream = b"".join([plain[3], meta, plain[4], named, usage, plain[5], b"data: [DONE]\n\n"])
    reference = _SseFilter(strip_usage=True)
    expected = b"".join(reference.feed(stream[i : i + 1]) for i in range(len(stream)))
    expected += reference.flush()
    assert usage not in expected and meta in expected and named in expected
    for size in (1, 7, 64, 100, len(stream)):
        g = _SseFilter(strip_usage=True)
        cuts = range(0, len(stream), size)
        out = b"".join(g.feed(stream[i : i + size]) for i in cuts) + g.flush()
        assert out == expected and g.done and g.usage == reference.usage
    # a chunk ending inside an event takes the event-by-event path, then the fast one again
    h = _SseFilter(strip_usage=False)
    assert h.feed(plain[0][:10]) == b""
    assert h.feed(plain[0][10:]) == plain[0]
    assert h.feed(plain[1]) is plain[1]


def test_pool_tokenize_thread_chars_sets_the_offload_and_zero_turns_it_off() -> None:
    import sys

    from gateway.config import ConfigError, GatewayConfig, PoolSettings
    from gateway.pool import Pool
    from gateway.routing.index import ShadowIndex
    from gateway.tokenization import bundled_test_tokenizer
    from gateway.tokenization.tokenizer import DEFAULT_THREAD_THRESHOLD_CHARS

    path = str(bundled_test_tokenizer())
    for chars, expected in ((None, DEFAULT_THREAD_THRESHOLD_CHARS), (0, sys.maxsize), (5, 5)):
        settings = PoolSettings("m", path, chat_template="deepseek-v3")
        if chars is not None:
            settings.tokenize_thread_chars = chars
        pool = Pool(settings, ShadowIndex(), "seed")
        assert pool.tokenizer.thread_threshold_chars == expected
        pool.tokenizer.close()
    bad = GatewayConfig(pools=[PoolSettings("m", path, tokenize_thread_chars=-1)])
    with pytest.raises(ConfigError, match="tokenize_thread_chars: must be >= 0"):
        bad.validate()
    bad = GatewayConfig(pools=[PoolSettings("m", path, tokenize_probe_chars=-1)])
    with pytest.raises(ConfigError, match="tokenize_probe_chars: must be >= 0"):
        bad.validate()


def test_the_event_read_interval_reaches_the_consumer_and_is_bounded() -> None:
    from gateway.config import ConfigError, GatewayConfig, PoolSettings, RedisSettings
    from gateway.contract.bus import MemoryBus
    from gateway.server import Gateway
    from gateway.tokenization import bundled_test_tokenizer

    pools = [PoolSettings("m", str(bundled_test_tokenizer()), chat_template="deepseek-v3")]
    cfg = GatewayConfig(pools=pools, redis=RedisSettings("redis://127.0.0.1:9", read_interval=0.25))
    cfg.validate()
    gw = Gateway(cfg, bus=MemoryBus())
    assert gw.consumer is not None and gw.consumer.config.read_interval == 0.25
    for bad in (-0.1, 1.5):
        cfg.redis.read_interval = bad
        with pytest.raises(ConfigError, match=r"redis\.read_interval: must be between 0 and 1"):
            cfg.validate()


def test_pool_says_when_its_tokenizer_encodes_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tokenizer whose configuration rules out the piece cache and chunks is exact but
    slower: the pool warns once, with the reason; a cacheable one says nothing."""
    import tokenizers
    from tokenizers import pre_tokenizers

    from gateway.config import PoolSettings
    from gateway.pool import Pool
    from gateway.routing.index import ShadowIndex
    from gateway.tokenization import bundled_test_tokenizer

    base = tokenizers.Tokenizer.from_file(str(bundled_test_tokenizer()))
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    path = tmp_path / "metaspace.json"
    base.save(str(path))
    for tok_path, warned in ((str(bundled_test_tokenizer()), False), (str(path), True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gateway.pool"):
            pool = Pool(
                PoolSettings("m", tok_path, chat_template="deepseek-v3"), ShadowIndex(), "s"
            )
        pool.tokenizer.close()
        messages = [r.getMessage() for r in caplog.records]
        assert bool(messages) is warned
        if warned:
            assert messages == [
                "pool m: completions are encoded whole (pre-tokenizer Metaspace is not known to be local)"
            ]


def test_the_gateway_serves_with_its_own_young_collector_threshold() -> None:
    """``server.gc_young_threshold``: set once start-up's heap is frozen (0 leaves Python's
    threshold), the older generations' thresholds kept; a negative one is refused."""
    import gc

    from gateway.config import ConfigError, GatewayConfig, PoolSettings, RedisSettings
    from gateway.main import _freeze_startup_heap
    from gateway.tokenization import bundled_test_tokenizer

    assert GatewayConfig().server.gc_young_threshold == 10_000
    before = gc.get_threshold()
    try:
        _freeze_startup_heap(12_345)
        assert gc.get_threshold() == (12_345, *before[1:])
        _freeze_startup_heap(0)
        assert gc.get_threshold() == (12_345, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    pools = [PoolSettings("m", str(bundled_test_tokenizer()))]
    cfg = GatewayConfig(pools=pools, redis=RedisSettings("redis://127.0.0.1:9"))
    cfg.validate()
    cfg.server.gc_young_threshold = -1
    with pytest.raises(ConfigError, match=r"server\.gc_young_threshold: must be >= 0"):
        cfg.validate()
