"""Data-parallel ranks as cache domains, end to end (Redis + sim workers with 2 ranks each +
agents + gateway, real processes on loopback), and the pieces on their own: the simulator's
pinning and balancing, the gateway's pinning, and the registry's refusal of a bad rank.

An engine with N data-parallel ranks holds N prefix caches. If the gateway merged them (as
it did before), a follow-up would be predicted to hit while the engine's own balancer sent
it to another rank: the predicted and reported cached tokens would differ."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from chat_helpers import MODEL, converged, run_chats

from gateway.config import CircuitSettings
from gateway.contract.wire import WorkerInfo
from gateway.pinning import VLLM_RANK_HEADER, pin_rank
from gateway.registry import Registry
from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import SimConfig
from loadtest.harness import post_json
from loadtest.stack import Stack, StackConfig, wait_for


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_each_rank_is_indexed_routed_and_pinned(tmp_path: Path, flavor: str) -> None:
    cfg = StackConfig(
        workers=2, dp_size=2, flavor=flavor, speedup=50, kv_blocks=4096, log_dir=tmp_path
    )
    with Stack(cfg) as stack:
        listed = sorted((w["worker_id"], w["engine_id"], w["dp_rank"]) for w in stack.workers())
        assert listed == [
            ("worker-0.dp0", "worker-0", 0), ("worker-0.dp1", "worker-0", 1),
            ("worker-1.dp0", "worker-1", 0), ("worker-1.dp1", "worker-1", 1),
        ]  # fmt: skip
        # conversations of their own: each new one goes to an idle domain at random, so
        # about half land on a rank 1, where an unpinned request would not go (the engine's
        # balancer picks the lowest idle rank): P(none does) = 2**-12
        n = 12
        rows = run_chats(stack, conversations=n, turns=2, shared_system=False)
        ranks = [[r["stats"]["finished"] for r in w["ranks"]] for w in stack.sim_state()]
    # every request was predicted exactly: the engine ran it on the rank whose cache the
    # gateway matched (the pin), so what it reported reusing is what was predicted
    assert [r[0] for r in rows] == [r[1] for r in rows], rows
    follow_ups = rows[n:]
    assert sum(r[1] for r in follow_ups) > 0.5 * sum(r[2] for r in follow_ups)
    # rank 1s served some, and each engine's rank 1 ran exactly the requests the gateway
    # routed to it (the pin was honoured; the engine's balancer would have picked rank 0)
    on_rank1 = [sum(r[3] == f"worker-{i}.dp1" for r in rows) for i in range(2)]
    assert sum(on_rank1) > 0, rows
    assert [w[1] for w in ranks] == on_rank1, (ranks, rows)


def test_a_rank_restart_clears_that_rank_only(tmp_path: Path) -> None:
    cfg = StackConfig(workers=1, dp_size=2, speedup=50, log_dir=tmp_path)
    with Stack(cfg) as stack:
        for rank in (0, 1):  # straight to the engine, pinned: each rank caches a prompt
            post_json(
                stack.worker_urls[0] + "/v1/completions",
                {"model": MODEL, "prompt": f"rank {rank} " * 100, "max_tokens": 2},
                headers={VLLM_RANK_HEADER: str(rank)},
            )
        assert wait_for(lambda: converged(stack), 15) is not None, stack.diverged()
        before = stack.index()
        assert before["worker-0.dp0"]["blocks"] > 0 and before["worker-0.dp1"]["blocks"] > 0
        for rank in ("worker-0.dp0", "worker-0.dp1"):  # each rank's stream, applied to its end
            assert before[rank]["stream"]["seq"] >= 1 and not before[rank]["stream"]["waiting"]
        stack.fault(0, "restart_rank", rank=1)

        def rank1_empty() -> bool:
            ix = stack.index()
            return ix["worker-0.dp1"]["blocks"] == 0 and not stack.diverged()

        assert wait_for(rank1_empty, 15) is not None, stack.index()
        kept = stack.index()["worker-0.dp0"]
        assert (kept["blocks"], kept["digest"]) == (
            before["worker-0.dp0"]["blocks"],
            before["worker-0.dp0"]["digest"],
        )
        # both ranks keep serving, and rank 1 fills again from its new event sequence
        rows = run_chats(stack, conversations=4, turns=2, shared_system=False)
        assert [r[0] for r in rows] == [r[1] for r in rows], rows


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_simulator_pins_and_balances_ranks(flavor: str) -> None:
    """vLLM reads the rank from a header, SGLang from a request field; an unknown rank is
    a 400; unpinned requests go to the least loaded rank, as the engine's balancer does."""
    cfg = SimConfig(workers=1, dp_size=3, flavor=flavor, tokenizer="none")  # type: ignore[arg-type]
    async with SimCluster(cfg) as cluster, aiohttp.ClientSession() as http:
        w = cluster.workers[0]
        ports = [r.publisher.port for r in w.ranks if r.publisher]
        assert len(set(ports)) == 3
        if flavor == "sglang":  # one advertised port base: the ranks' ports are adjacent
            assert ports == [ports[0], ports[0] + 1, ports[0] + 2]

        async def send(rank: int | None, raw: str | None = None) -> int:
            body: dict[str, object] = {"prompt": [1, 2, 3, 4] * 8, "max_tokens": 2}
            headers = {}
            if flavor == "vllm" and (rank is not None or raw is not None):
                headers[VLLM_RANK_HEADER] = raw if raw is not None else str(rank)
            elif rank is not None:
                body["routed_dp_rank"] = rank
            async with http.post(w.http_url + "/v1/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status

        assert [await send(2), await send(2)] == [200, 200]
        assert [r.core.stats.finished for r in w.ranks] == [0, 0, 2]
        assert await send(5) == 400
        if flavor == "vllm":
            assert await send(None, "two") == 400
        # unpinned: spread over the idle ranks, lowest index first on ties
        w.pause()
        gens = [w.submit([7] * 32, 1, stream=False) for _ in range(3)]
        assert [g.rank.index for g in gens] == [0, 1, 2]
        w.resume()
        for g in gens:
            while not g.finished:
                await g.wait()
        # per-rank series in /metrics, labelled as the engine labels them
        async with http.get(w.http_url + "/metrics") as resp:
            text = await resp.text()
        assert ('engine="2"' if flavor == "vllm" else 'dp_rank="2"') in text


async def test_a_rank_restart_restarts_its_event_sequence_only() -> None:
    cfg = SimConfig(workers=1, dp_size=2, tokenizer="none")
    async with SimCluster(cfg) as cluster:
        w = cluster.workers[0]
        for rank in (0, 1):
            gen = w.submit([3] * 64, 1, stream=False, rank=rank)
            while not gen.finished:
                await gen.wait()
        seqs = [r.publisher.next_seq for r in w.ranks if r.publisher]
        assert min(seqs) > 0
        await w.fault("restart_rank", rank=1)
        assert w.ranks[1].publisher is not None and w.ranks[1].publisher.next_seq == 0
        assert w.ranks[0].publisher is not None and w.ranks[0].publisher.next_seq == seqs[0]
        assert w.ranks[0].core.cache.cached_blocks > 0 == w.ranks[1].core.cache.cached_blocks
        with pytest.raises(ValueError, match="out of range"):
            await w.fault("restart_rank", rank=2)


def test_gateway_pins_each_engine_its_own_way() -> None:
    body = b'{"model":"m","messages":[]}'
    parsed = json.loads(body)
    assert pin_rank("vllm", None, body, parsed, {}) == (body, {})
    out, headers = pin_rank("vllm", 3, body, parsed, {"a": "b"})
    assert out == body and headers == {"a": "b", VLLM_RANK_HEADER: "3"}
    out, headers = pin_rank("sglang", 1, body, parsed, {})
    assert headers == {}
    assert json.loads(out) == {**parsed, "routed_dp_rank": 1, "data_parallel_rank": 1}
    # a client's own steering field is overridden: the gateway's choice wins
    steer = b'{"model":"m","routed_dp_rank":0,"prompt":"x"}'
    out, _ = pin_rank("sglang", 2, steer, json.loads(steer), {})
    assert json.loads(out) == {
        "model": "m", "prompt": "x", "routed_dp_rank": 2, "data_parallel_rank": 2,
    }  # fmt: skip


def test_registry_refuses_a_rank_out_of_range() -> None:
    from types import SimpleNamespace

    from gateway.routing.policy import make_policy
    from gateway.routing.router import Router

    router, decode = Router(make_policy("round_robin"), 16), Router(make_policy("round_robin"), 16)
    pool = SimpleNamespace(
        settings=SimpleNamespace(model=MODEL, aliases=[]),
        router=router,
        decode_router=decode,
        router_for=lambda role: decode if role == "decode" else router,
    )
    reg = Registry([pool], CircuitSettings(), [])  # type: ignore[list-item]
    good = WorkerInfo("w.dp1", "http://127.0.0.1:1", MODEL, dp_size=2, dp_rank=1, engine_id="w")
    bad = WorkerInfo("w.dp2", "http://127.0.0.1:1", MODEL, dp_size=2, dp_rank=2, engine_id="w")
    added, _ = reg.sync({"w.dp1": good, "w.dp2": bad})
    assert added == ["w.dp1"]
    assert reg.rejected == {"w.dp2": "dp_rank 2 is out of range [0, 2)"}
