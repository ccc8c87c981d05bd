"""A real peer in front of the simulator: ``sglang-router`` (bench extra) probes the sim
workers (``/health``, ``/server_info``, ``/model_info``) and routes requests to them,
launched as the comparisons launch every peer (``loadtest.peers``)."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

import loadtest.peers as peers
from gateway.tokenization import Tokenizer, bundled_test_tokenizer
from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import SimConfig, TimingConfig
from loadtest.enginesim.text import load_tokenizer
from loadtest.harness import HarnessError

ROUTER = Path(sys.executable).with_name("sglang-router")

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="sglang-router (bench extra) missing")

CFG = SimConfig(workers=2, flavor="sglang", timing=TimingConfig(speedup=200.0))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tk = load_tokenizer(None, None)
    assert tk is not None
    return tk


@asynccontextmanager
async def router_over(cluster: SimCluster, logs: Path) -> AsyncIterator[peers.Peer]:
    """sglang-router (round robin) over the cluster's workers, ready: it lists both. The
    simulated workers answer on this event loop, so the peer's blocking start runs on a
    thread."""
    pool = peers.Pool(
        [w.http_url for w in cluster.workers], CFG.model, str(bundled_test_tokenizer()), 16
    )
    peer = peers.launch(
        "sglang-router-round_robin-historical",
        pool,
        logs,
        extra_args=("--tokenizer-path", pool.tokenizer),
    )
    await asyncio.to_thread(peer.__enter__)
    try:
        yield peer
    finally:
        peer.stop()


async def test_sglang_router_routes_to_sim_workers(tokenizer: Tokenizer, logs: Path) -> None:
    async with SimCluster(CFG, tokenizer=tokenizer) as cluster, router_over(cluster, logs) as r:
        async with aiohttp.ClientSession() as s:
            for i in range(6):
                body = {"model": CFG.model, "prompt": f"Request {i}: tell me a story.",
                        "max_tokens": 4}  # fmt: skip
                async with s.post(r.url + "/v1/completions", json=body) as resp:
                    out = await resp.json()
                    assert resp.status == 200, out
                    assert out["choices"][0]["text"] == " the" * 4
            gen = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2}}
            async with s.post(r.url + "/generate", json=gen) as resp:
                assert (
                    resp.status == 200
                    and (await resp.json())["meta_info"]["completion_tokens"] == 2
                )
        served = [w.core.stats.finished for w in cluster.workers]
        assert sum(served) == 7 and min(served) >= 3  # round robin used both sim workers


async def test_a_peer_whose_port_was_taken_starts_again_on_new_ports(
    tokenizer: Tokenizer, logs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port picked free is bound by another process before the peer binds it (a test in
    the other pytest worker, CI 2026-12-07): the peer exits with "Address already in use",
    and ``Peer.wait_ready`` starts the same process object again on new ports, which the
    peer then serves on. Here the first API port handed out is held."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # bound, not listening: a connection to it is refused
    taken = held.getsockname()[1]
    picks = [[taken, peers.free_ports(1)[0]]]
    real = peers.free_ports
    monkeypatch.setattr(peers, "free_ports", lambda n: picks.pop() if picks else real(n))
    try:
        async with SimCluster(CFG, tokenizer=tokenizer) as cluster:
            async with router_over(cluster, logs) as r:
                assert r.relaunches == 1 and not picks
                assert r.port != taken and r.url == f"http://127.0.0.1:{r.port}"
                assert f"--port {r.port} " in " ".join(r.proc.args) + " "
                async with aiohttp.ClientSession() as s, s.get(r.url + "/workers") as resp:
                    assert resp.status == 200
            log = r.proc.log_path.read_text()
            assert peers.PORT_TAKEN in log  # the first start lost its port
    finally:
        held.close()


async def test_a_peer_that_keeps_losing_its_port_fails_after_its_attempts(
    tokenizer: Tokenizer, logs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every API port handed out is taken: after ``PORT_ATTEMPTS`` starts the peer fails with
    its log, as any other exit does, instead of trying forever."""
    held = [socket.socket() for _ in range(peers.PORT_ATTEMPTS)]
    for h in held:
        h.bind(("127.0.0.1", 0))
    picks = [[h.getsockname()[1], peers.free_ports(1)[0]] for h in held]
    monkeypatch.setattr(peers, "free_ports", lambda n: picks.pop())
    try:
        async with SimCluster(CFG, tokenizer=tokenizer) as cluster:
            with pytest.raises(HarnessError, match=peers.PORT_TAKEN) as failed:
                async with router_over(cluster, logs):
                    pass
            assert "exited" in str(failed.value) and not picks  # three starts, no fourth
    finally:
        for h in held:
            h.close()
