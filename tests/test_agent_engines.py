"""Engine adapters: discovery documents, /metrics → EngineReport, and a live agent that
discovers two data-parallel ranks over HTTP and reports load."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from agent_helpers import (
    AGENT_SEED,
    FakeEngine,
    agent_config,
    drive,
    running_agent,
    running_consumer,
    settle,
    wait_until,
)
from aiohttp import web

from gateway.contract.wire import EngineReport
from gateway.routing.keys import BlockKeyer
from loadtest.harness import RedisServer
from worker_agent.engines import adapter_for
from worker_agent.engines.base import DiscoveryError, parse_metrics, resolve_host

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.99
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",engine="0"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0
"""

SGLANG_METRICS = """\
sglang:num_running_reqs{model_name="m",tp_rank="0"} 5
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 7
sglang:token_usage{model_name="m",tp_rank="0"} 0.75
sglang:prompt_tokens_total{model_name="m",tp_rank="0"} 100
sglang:cached_tokens_total{model_name="m",tp_rank="0"} 40
sglang:max_total_num_tokens{model_name="m",tp_rank="0"} 320000
"""


def test_vllm_metrics() -> None:
    a = adapter_for("vllm")
    samples = parse_metrics(VLLM_METRICS, a.metric_names)
    assert a.report(samples, 9.0) == EngineReport(
        running=4,
        waiting=2,
        kv_usage=0.375,
        prefix_cache_queries=1000,
        prefix_cache_hits=600,
        ts=9.0,
    )
    assert a.capacity_tokens(samples) == 2048 * 16
    assert a.block_size(samples) == 16  # vLLM 0.32's /kv_event_sources does not say
    assert a.block_size(parse_metrics("vllm:num_requests_running 1\n", a.metric_names)) is None


def test_sglang_metrics() -> None:
    a = adapter_for("sglang")
    samples = parse_metrics(SGLANG_METRICS, a.metric_names)
    rep = a.report(samples, 1.0)
    assert (rep.running, rep.waiting, rep.kv_usage) == (5, 7, 0.75)
    assert (rep.prefix_cache_queries, rep.prefix_cache_hits) == (100, 40)
    assert a.capacity_tokens(samples) == 320000


def test_vllm_discovery_documents() -> None:
    a = adapter_for("vllm")
    listed = [
        {"data_parallel_rank": 0, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
        {"data_parallel_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": None},
    ]
    found = a.discover(listed, "http://10.0.0.7:8000")
    assert [(s.rank, s.endpoint, s.replay) for s in found.sources] == [
        (0, "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558"),
        (1, "tcp://10.0.0.7:5558", None),
    ]
    one = {"enable_kv_cache_events": True, "endpoint": "tcp://*:6000", "topic": "kv", "dp_size": 2}
    found = a.discover(one, "http://h:1")
    assert [(s.endpoint, s.topic) for s in found.sources] == [
        ("tcp://h:6000", "kv"),
        ("tcp://h:6001", "kv"),
    ]
    # vLLM 0.32+: an object keyed by rank
    keyed = {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:7000"},
        "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:7001"},
    }
    found = a.discover(keyed, "http://h:1")
    assert [(s.rank, s.endpoint) for s in found.sources] == [
        (0, "tcp://h:7000"),
        (1, "tcp://h:7001"),
    ]
    with pytest.raises(DiscoveryError):
        a.discover({"enable_kv_cache_events": False, "endpoint": "tcp://*:1"}, "http://h:1")


def test_sglang_discovery_document() -> None:
    info = {
        "kv_events": {
            "publisher": "zmq",
            "endpoint_host": "*",
            "endpoint_port_base": 7000,
            "replay_endpoint_port_base": 7100,
            "topic": "",
            "block_size": 1,
            "dp_size": 2,
        }
    }
    found = adapter_for("sglang").discover(info, "http://[fd00::1]:30000")
    assert found.block_size == 1
    assert [(s.endpoint, s.replay) for s in found.sources] == [
        ("tcp://[fd00::1]:7000", "tcp://[fd00::1]:7100"),
        ("tcp://[fd00::1]:7001", "tcp://[fd00::1]:7101"),
    ]
    with pytest.raises(DiscoveryError):
        adapter_for("sglang").discover({"kv_events": {"publisher": "null"}}, "http://h:1")
    assert resolve_host("tcp://0.0.0.0:1", "http://a:2") == "tcp://a:1"
    assert resolve_host("ipc:///tmp/x", "http://a:2") == "ipc:///tmp/x"


def consecutive_ports(n: int) -> int:
    """A base port with ``n`` free ports after it."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no consecutive free ports")


@pytest.fixture
async def sglang_http() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """An SGLang-like HTTP surface: /server_info and /metrics (contents set by the test)."""
    state: dict[str, Any] = {"info": {}, "metrics": SGLANG_METRICS}

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(state["info"])

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=state["metrics"])

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", state
    await runner.cleanup()


async def test_discovered_dp_ranks_and_load_reports(
    redis_server: RedisServer, sglang_http: tuple[str, dict[str, Any]]
) -> None:
    url, state = sglang_http
    base = consecutive_ports(4)  # PUB ports base, base+1; replay base+2, base+3
    engines = [
        FakeEngine("sglang-0.5.23", block_size=1, rank=r, ports=(base + r, base + 2 + r), seed=r)
        for r in range(2)
    ]
    state["info"] = {
        "kv_events": {
            "publisher": "zmq",
            "endpoint_host": "*",
            "endpoint_port_base": base,
            "replay_endpoint_port_base": base + 2,
            "block_size": 1,
            "dp_size": 2,
        }
    }
    cfg = agent_config(None, engine_url=url)
    cfg.engine.kind = "sglang"
    keyer = BlockKeyer(AGENT_SEED, 16)
    try:
        async with (
            running_consumer(redis_server.url) as consumer,
            running_agent(cfg, redis_server.url) as agent,
        ):
            assert [s.source.endpoint for s in agent.subscribers] == [
                f"tcp://127.0.0.1:{base}",
                f"tcp://127.0.0.1:{base + 1}",
            ]
            shared = [1, 2, 3] * 20  # both ranks cache this prefix
            for e in engines:
                await e.publish(e.store_events(shared))
                await drive(e, 5)
            # each rank is a cache domain of its own: w1.dp0 and w1.dp1
            assert [d.worker_id for d in agent.domains] == ["w1.dp0", "w1.dp1"]
            exp = [e.expected_keys(keyer) for e in engines]
            await wait_until(
                lambda: [agent.mirror_keys(r) for r in (0, 1)] == exp, 10, "each rank's keys"
            )
            # one rank's clear leaves the other holding everything it held
            await engines[0].publish(engines[0].clear_events())
            await wait_until(lambda: agent.mirror_keys(0) == frozenset(), 10, "rank 0 cleared")
            assert agent.mirror_keys(1) == exp[1] and set(keyer.keys(shared)) <= exp[1]
            await settle(consumer, [agent])
            assert consumer.index.worker_keys("w1.dp0") == frozenset()
            assert consumer.index.worker_keys("w1.dp1") == exp[1]
            workers = consumer.workers()
            assert "w1" not in workers
            for r in (0, 1):
                info = workers[f"w1.dp{r}"]
                assert (info.engine, info.dp_size, info.dp_rank, info.engine_id) == (
                    "sglang", 2, r, "w1",
                )  # fmt: skip
                assert info.engine_block_size == 1
            # SGLANG_METRICS carry no dp_rank label: the worker's load is shared by its ranks
            await wait_until(
                lambda: consumer.workers()["w1.dp1"].kv_capacity_blocks == 10000, 5, "capacity"
            )
            await wait_until(lambda: consumer.report("w1.dp1") is not None, 5, "load report")
            rep = consumer.report("w1.dp1")
            assert rep is not None and (rep.running, rep.waiting) == (3, 4)  # ceil(5/2), ceil(7/2)
            # labelled per rank: each rank reports its own series
            state["metrics"] = "".join(
                SGLANG_METRICS.replace('tp_rank="0"', f'tp_rank="0",dp_rank="{r}"').replace(
                    " 5\n", f" {9 + r}\n", 1
                )
                for r in (0, 1)
            )
            await wait_until(
                lambda: [consumer.report(f"w1.dp{r}").running for r in (0, 1)] == [9, 10],  # type: ignore[union-attr]
                5,
                "per-rank reports",
            )
    finally:
        for e in engines:
            await e.close()
