"""Faults of simulated workers, from Python and from the admin endpoints: kill, restart,
pause/resume, slow down, dropped event batches, refused connections."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import zmq
import zmq.asyncio
from test_enginesim_server import Tap, post, replay, until

from loadtest.enginesim.cluster import SimCluster
from loadtest.enginesim.config import SimConfig, TimingConfig


def config(**kw: object) -> SimConfig:
    kw.setdefault("timing", TimingConfig(speedup=1000.0))
    return SimConfig(tokenizer="none", **kw)  # type: ignore[arg-type]


async def refused(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            await r.read()
            return False
    except aiohttp.ClientConnectionError:
        return True


async def test_kill_then_restart_via_python() -> None:
    async with SimCluster(config(workers=2), tokenizer=None) as cluster:
        w = cluster.workers[0]
        async with aiohttp.ClientSession() as s:
            prompt = {"prompt": list(range(1, 70)), "max_tokens": 2}
            assert (await post(s, w.http_url + "/v1/completions", prompt))[0] == 200
            assert w.publisher is not None and w.publisher.next_seq > 0
            url, events = w.http_url, w.events_endpoint
            body = {"prompt": [5] * 40, "max_tokens": 30_000, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as stream:
                await stream.content.readline()
                await cluster.fault(0, "kill")
                with pytest.raises(aiohttp.ClientPayloadError):
                    await stream.content.read()  # the stream is cut, not ended
            assert await refused(url)
            assert w.events_endpoint is None and not w.alive
            assert not await refused(cluster.workers[1].http_url)  # the other one is fine
            state = await cluster.fault(0, "restart")
            assert state["alive"] and w.http_url == url and w.events_endpoint == events
            assert state["next_seq"] == 0 and state["cached_blocks"] == 0
            st, again = await post(s, w.http_url + "/v1/completions", prompt)
            assert st == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_restart_resets_the_sequence_seen_by_a_subscriber() -> None:
    ctx = zmq.asyncio.Context()
    async with SimCluster(config(), tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        tap = Tap(ctx, w)
        try:
            await tap.sync(s)
            assert tap.next > 0
            # restart through the worker's own admin endpoint
            st, state = await post(s, w.http_url + "/sim/fault", {"action": "restart"})
            assert st == 200 and state["alive"] and state["next_seq"] == 0
            # The subscriber reconnects by itself; the sequence starts over at 0 and the
            # hashes chain from an empty cache.
            tap.next = 0
            tap.checker.digest.clear()
            await tap.sync(s)
            st, _ = await post(s, w.http_url + "/v1/completions", {"prompt": [1] * 40})
            assert st == 200
            events = await tap.drain()
            assert events[-1]["type"] == "BlockStored"
        finally:
            tap.close()
    ctx.term()


async def test_pause_stops_stepping_and_resume_continues() -> None:
    async with SimCluster(config(), tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        await cluster.fault(0, "pause")
        steps = w.core.stats.steps
        task = asyncio.create_task(
            post(s, w.http_url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3})
        )
        await until(lambda: w.core.num_waiting == 1)
        async with s.get(w.http_url + "/health") as r:
            assert r.status == 200  # a stuck engine still answers health checks
        assert w.core.stats.steps == steps and not task.done()
        await cluster.fault(0, "resume")
        st, out = await asyncio.wait_for(task, 5)
        assert st == 200 and out["usage"]["completion_tokens"] == 3


async def test_slow_down_stretches_steps() -> None:
    async with SimCluster(config(), tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        url = w.http_url + "/v1/completions"

        async def busy_time(first: int) -> float:
            before = w.core.stats.busy_time
            st, _ = await post(s, url, {"prompt": list(range(first, first + 500)), "max_tokens": 4})
            assert st == 200
            return w.core.stats.busy_time - before

        normal = await busy_time(1)
        await post(s, w.http_url + "/sim/fault", {"action": "slow", "factor": 10})
        slow = await busy_time(1001)
        assert slow == pytest.approx(10 * normal, rel=1e-6)
        st, err = await post(s, w.http_url + "/sim/fault", {"action": "slow", "factor": -1})
        assert st == 400 and err["error"]["param"] == "action"


async def test_dropped_batches_make_a_gap_that_replay_fills() -> None:
    ctx = zmq.asyncio.Context()
    async with SimCluster(config(), tokenizer=None) as cluster, aiohttp.ClientSession() as s:
        w = cluster.workers[0]
        tap = Tap(ctx, w)
        try:
            await tap.sync(s)
            missing = tap.next
            await post(s, w.http_url + "/sim/fault", {"action": "drop_events", "count": 2})
            url = w.http_url + "/v1/completions"
            for i in range(3):
                st, _ = await post(s, url, {"prompt": [100 + i] * 20, "max_tokens": 1})
                assert st == 200
            _, seq, _ = await asyncio.wait_for(tap.sub.recv_multipart(), 5)
            assert int.from_bytes(seq, "big") == missing + 2  # two batches never arrived
            got = await replay(ctx, w, missing, missing + 2)
            assert [int.from_bytes(f[-2], "big") for f in got] == [missing, missing + 1]
            assert w.state()["replays_served"] >= 2  # the tap's sync and this one
        finally:
            tap.close()
    ctx.term()


async def test_refuse_and_accept_connections_via_cluster_admin() -> None:
    async with SimCluster(config(workers=2, admin_port=0), tokenizer=None) as cluster:
        admin = cluster.admin_url
        assert admin is not None
        w = cluster.workers[1]
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [7] * 10, "max_tokens": 3000, "stream": True}
            async with s.post(w.http_url + "/v1/completions", json=body) as stream:
                await stream.content.readline()
                st, state = await post(s, admin + "/sim/fault", {"worker": 1, "action": "refuse"})
                assert st == 200 and state["accepting"] is False
                assert await refused(w.http_url)
                await stream.content.readline()  # the open stream goes on
            st, _ = await post(s, admin + "/sim/fault", {"worker": 1, "action": "accept"})
            assert st == 200 and not await refused(w.http_url)
            st, _ = await post(s, admin + "/sim/fault", {"worker": 1, "action": "kill"})
            assert st == 200 and await refused(w.http_url)
            st, state = await post(s, admin + "/sim/fault", {"worker": 1, "action": "restart"})
            assert st == 200 and state["alive"] and not await refused(w.http_url)
            async with s.get(admin + "/sim/workers") as r:
                assert [x["alive"] for x in await r.json()] == [True, True]
            for bad in ({"worker": 9, "action": "kill"}, {"worker": 0, "action": "explode"},
                        {"worker": 0}):  # fmt: skip
                st, err = await post(s, admin + "/sim/fault", bad)
                assert st == 400 and "error" in err
