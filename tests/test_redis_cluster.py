"""The event bus past one Redis: Redis Cluster and Sentinel, with a primary killed mid-run.

Real ``redis-server`` processes in cluster mode (3 primaries + 3 replicas) or under three
sentinels, real agents (ZMQ from fake engines) and a real gateway consumer, all on loopback.
After a failover the consumer's index must equal every agent's mirror again (key sets and
their digests): nothing lost, nothing left over. And the whole stack as processes (sim
workers, ``kvroute agent --redis-cluster``, ``kvroute gateway`` with ``redis.cluster``) on a
3-primary cluster, serving multi-turn chats. Every wait polls a condition.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import threading
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from agent_helpers import (
    AGENT_SEED,
    FakeEngine,
    agent_config,
    drive,
    join,
    running_agent,
    running_consumer,
    settle,
    wait_until,
)
from chat_helpers import MODEL, converged, run_chats, text
from redis.asyncio.cluster import ClusterNode, NodesManager
from redis.cluster import key_slot

from gateway.config import GatewayConfig
from gateway.contract.bus import BusError
from gateway.contract.redis_bus import RedisBus, parse_sentinels
from gateway.contract.settings import ConfigError, load_config
from gateway.contract.wire import (
    STREAM_GROUPS,
    Entry,
    RedisLayout,
    Stored,
    WorkerInfo,
    cluster_slot,
    key_digest,
)
from gateway.main import add_arguments as gateway_arguments
from gateway.main import config_from_args, make_bus
from gateway.routing.keys import BlockKeyer
from loadtest.harness import HarnessError, free_port
from loadtest.redis_topologies import LocalCluster, LocalSentinel
from loadtest.stack import Stack, StackConfig, wait_for
from worker_agent.cli import add_arguments as agent_arguments
from worker_agent.cli import build_config as agent_build_config

KEYER = BlockKeyer(AGENT_SEED, 16)
WORKERS = [f"cw{i}" for i in range(6)]


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(workdir=tmp_path / "cluster") as cluster:
        yield cluster


@pytest.fixture
def redis_sentinel(tmp_path: Path) -> Iterator[LocalSentinel]:
    with LocalSentinel(workdir=tmp_path / "sentinel") as sentinel:
        yield sentinel


# -- layout and configuration ------------------------------------------------------------------


def test_a_workers_keys_share_one_slot() -> None:
    layout = RedisLayout()
    for w in ["w1", "pod-7.rank-3", "a}b", "x{y"]:
        keys = [layout.stream(w), layout.snapshot(w), layout.worker(w), layout.load(w)]
        assert len({key_slot(k.encode()) for k in keys}) == 1, w
        assert layout.stream_worker(layout.stream(w)) == w
    # the group tags split the slots evenly: any cluster of equal contiguous shards gets an
    # equal share of groups (3 shards: 20 each)
    tags = [RedisLayout.tag(f"w{i}") for i in range(2000)]
    assert len(set(tags)) == STREAM_GROUPS
    bounds = [i * 16384 // STREAM_GROUPS for i in range(STREAM_GROUPS + 1)]
    ranges = sorted(bisect_right(bounds, cluster_slot(t[1:-1])) - 1 for t in set(tags))
    assert ranges == list(range(STREAM_GROUPS))
    thirds = Counter(cluster_slot(t[1:-1]) * 3 // 16384 for t in set(tags))
    assert thirds == {0: 20, 1: 20, 2: 20}


def test_sentinel_addresses_parse_and_bad_ones_are_refused() -> None:
    assert parse_sentinels(["a:1", " b:26380", "c"]) == [("a", 1), ("b", 26380), ("c", 26379)]
    for bad in ["a:x", ":1"]:
        with pytest.raises(ValueError, match="host:port"):
            parse_sentinels([bad])
    with pytest.raises(ValueError, match="exclude"):
        RedisBus("redis://127.0.0.1:1", cluster=True, sentinels=["a:1"])
    with pytest.raises(ValueError, match="sentinel_master"):
        RedisBus("", sentinels=["a:1"])


async def test_sentinel_url_gives_credentials_and_database() -> None:
    bus = RedisBus("redis://u:pw@ignored:1/3", sentinels=["a:1"], sentinel_master="m")
    try:
        kwargs = bus._r.connection_pool.connection_kwargs
        assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("u", "pw", 3)
        assert "host" not in kwargs  # the sentinels name the primary
    finally:
        await bus.close()


def _gateway_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    gateway_arguments(p)
    return p.parse_args(["--set", "pools.0.model=m", "--set", "pools.0.tokenizer=t", *argv])


def test_gateway_flags_env_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from_args(_gateway_args("--redis", "redis://h:1", "--redis-cluster"))
    assert cfg.redis.cluster
    bus = make_bus(cfg)
    assert isinstance(bus, RedisBus) and bus.cluster
    cfg = config_from_args(
        _gateway_args("--redis-sentinels", "s1:1,s2:2", "--redis-sentinel-master", "mm")
    )
    assert cfg.redis.sentinels == ["s1:1", "s2:2"] and cfg.redis.enabled
    assert isinstance(make_bus(cfg), RedisBus)
    env = {"KVROUTE_REDIS__URL": "redis://h:1", "KVROUTE_REDIS__CLUSTER": "true"}
    cfg = load_config(
        GatewayConfig, env=env, overrides={"pools.0.model": "m", "pools.0.tokenizer": "t"}
    )
    assert cfg.redis.cluster
    both = ["--redis", "redis://h:1", "--redis-cluster", "--redis-sentinels", "s:1"]
    for argv, msg in [
        (["--redis-sentinels", "s:1"], "sentinel_master"),
        (["--redis-cluster"], "needs redis.url"),
        ([*both, "--redis-sentinel-master", "mm"], "exclude"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            config_from_args(_gateway_args(*argv))


def test_agent_flags() -> None:
    p = argparse.ArgumentParser()
    agent_arguments(p)
    base = ["--worker-id", "w", "--model", "m"]
    cfg = agent_build_config(p.parse_args([*base, "--redis-cluster"]), env={})
    assert cfg.redis.cluster and not cfg.redis.sentinels
    args = p.parse_args([*base, "--redis-sentinels", "a:1,b:2", "--redis-sentinel-master", "x"])
    cfg = agent_build_config(args, env={})
    assert cfg.redis.sentinels == ["a:1", "b:2"] and cfg.redis.sentinel_master == "x"
    with pytest.raises(ConfigError, match="sentinel_master"):
        agent_build_config(p.parse_args([*base, "--redis-sentinels", "a:1"]), env={})
    with pytest.raises(ConfigError, match="exclude"):
        args = p.parse_args([*base, "--redis-cluster", "--redis-sentinels", "a:1"])
        agent_build_config(args, env={})


async def test_unreachable_cluster_raises_bus_error() -> None:
    bus = RedisBus(f"redis://127.0.0.1:{free_port()}", cluster=True, connect_timeout=0.2)
    try:

        async def read_fails() -> bool:  # a read left in flight reports at a later call
            try:
                await bus.read({"w": "0"}, block_ms=10)
            except BusError:
                return True
            return False

        await wait_until(read_fails, 10, "BusError from read")
        with pytest.raises(BusError):
            await bus.workers()
        with pytest.raises(BusError):
            await bus.append("w", [Entry(1, 1, 1, 0.0, 0.0, [], [])])
    finally:
        await bus.close()


# -- on a real cluster ---------------------------------------------------------------------------


async def test_cluster_bus_reads_every_shard(redis_cluster: LocalCluster) -> None:
    """Registry, reports and streams of workers on all three shards, through one client."""
    layout = RedisLayout()
    shards = {redis_cluster.primary_for(layout.stream(w)) for w in WORKERS}
    assert len(shards) == 3
    bus = RedisBus(redis_cluster.url, cluster=True)
    try:
        for i, w in enumerate(WORKERS):
            await bus.register(WorkerInfo(worker_id=w, url="http://127.0.0.1:1", model="m"), 5)
            await bus.append(w, [Entry(1, 1, 1, 0.0, 0.0, [], [Stored(None, [i])])])
        assert sorted(await bus.workers()) == WORKERS
        positions = dict.fromkeys(WORKERS, "0")
        seen: dict[str, Any] = {}

        async def read_all() -> bool:  # each call returns the groups read by then
            for r in await bus.read(positions, block_ms=100):
                seen[r.worker] = r.entries[0][1].events  # type: ignore[union-attr]
                positions[r.worker] = r.entries[-1][0]
            return len(seen) == len(WORKERS)

        await wait_until(read_all, 10, "every worker's stream read")
        assert seen == {w: [Stored(None, [i])] for i, w in enumerate(WORKERS)}
        for _ in range(3):  # the reads left in flight hold nothing new
            assert await bus.read(positions, block_ms=50) == []
        await bus.deregister(WORKERS[0])
        assert sorted(await bus.workers()) == WORKERS[1:]
    finally:
        await bus.close()


async def test_cluster_read_drops_what_was_read_from_a_stale_position(
    redis_cluster: LocalCluster,
) -> None:
    """A read left in flight from an old position (the consumer re-bootstrapped meanwhile)
    is not returned: the stream is read again from the new position."""
    writer = RedisBus(redis_cluster.url, cluster=True)
    bus = RedisBus(redis_cluster.url, cluster=True)
    try:
        ids = [(await writer.append("w", [Entry(1, 1, i, 0.0, 0.0, [], [])]))[0] for i in (1, 2)]
        first = asyncio.create_task(bus.read({"w": ids[1]}, block_ms=5000))
        await wait_until(lambda: bool(bus._inflight), 5, "a blocking read in flight")
        first.cancel()  # the caller gives up; the XREAD itself stays in flight
        await writer.append("w", [Entry(1, 1, 3, 0.0, 0.0, [], [])])
        got: list[Any] = []

        async def reread() -> bool:
            got[:] = await bus.read({"w": "0"}, block_ms=100)
            return bool(got)

        await wait_until(reread, 10, "the stream read from its start")
        assert [e.seq for _, e in got[0].entries] == [1, 2, 3]  # type: ignore[union-attr]
    finally:
        await bus.close()
        await writer.close()


async def _wedge_client(monkeypatch: pytest.MonkeyPatch, bus: RedisBus, worker: str) -> Any:
    """Wedge ``bus``'s own client (only it) on a gone node for ``worker``'s stream; returns
    that client, initialised."""
    client = bus._r
    slot = client.keyslot(bus.layout.stream(worker))
    _wedge(monkeypatch, slot, lambda m: m is client.nodes_manager)
    await client.initialize()
    return client


def _wedge(monkeypatch: pytest.MonkeyPatch, slot: int, clients: Callable[[Any], bool]) -> None:
    """Make the slot maps of the cluster clients that ``clients`` picks (by their nodes
    manager) name a node that is gone for ``slot``, whatever their refresh reads."""
    gone = ClusterNode("127.0.0.1", free_port())  # nothing listens there
    real = NodesManager.initialize

    async def refresh(self: NodesManager, *args: Any, **kwargs: Any) -> None:
        await real(self, *args, **kwargs)
        if clients(self):
            self.slots_cache[slot] = [gone]

    monkeypatch.setattr(NodesManager, "initialize", refresh)


async def _read_or_fail(bus: RedisBus, positions: dict[str, str]) -> list[Any] | None:
    try:
        return await bus.read(positions, block_ms=100)
    except BusError:
        return None


async def test_cluster_reads_stuck_on_a_gone_node_get_a_new_client(
    redis_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the client's slot map keeps naming a node that is gone and its own refresh does
    not mend it (a CI run once read a dead primary for 40 s after the takeover), the bus
    replaces its client after ``rebuild_after`` seconds and reads the stream from the same
    position: the failed reads lost nothing."""
    writer = RedisBus(redis_cluster.url, cluster=True)
    bus = RedisBus(redis_cluster.url, cluster=True, rebuild_after=0.5)
    try:
        await writer.append("w", [Entry(1, 1, i, 0.0, 0.0, [], []) for i in (1, 2)])
        client = await _wedge_client(monkeypatch, bus, "w")
        failures = 0
        got: list[Any] = []

        async def read() -> bool:
            nonlocal failures
            r = await _read_or_fail(bus, {"w": "0"})
            failures += r is None
            got[:] = r or []
            return bool(got)

        await wait_until(read, 10, "the stream read through a new client")
        assert failures >= 1 and bus.client_rebuilds == 1
        assert bus._reader is not client and bus._r is bus._reader
        assert [e.seq for _, e in got[0].entries] == [1, 2]  # type: ignore[union-attr]
    finally:
        await bus.close()
        await writer.close()


async def test_cluster_appends_stuck_on_a_gone_node_get_a_new_client(
    redis_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for an agent's appends: refused (``BusError``, the agent keeps the entries
    and retries) until the client is replaced, then they land, and a sound reader sees
    them in order."""
    writer = RedisBus(redis_cluster.url, cluster=True, rebuild_after=0.5)
    reader = RedisBus(redis_cluster.url, cluster=True)
    try:
        client = await _wedge_client(monkeypatch, writer, "w")
        failures = 0

        async def append() -> bool:
            nonlocal failures
            try:
                await writer.append("w", [Entry(1, 1, 1, 0.0, 0.0, [], [])])
            except BusError:
                failures += 1
                return False
            return True

        await wait_until(append, 10, "an append through a new client")
        assert failures >= 1 and writer.client_rebuilds == 1 and writer._r is not client
        await writer.append("w", [Entry(1, 1, 2, 0.0, 0.0, [], [])])
        got: list[Any] = []

        async def read() -> bool:
            got[:] = await reader.read({"w": "0"}, block_ms=100)
            return bool(got)

        await wait_until(read, 10, "the appended entries read")
        assert [e.seq for _, e in got[0].entries] == [1, 2]  # type: ignore[union-attr]
        assert writer._rebuild_wait == writer.rebuild_after  # the slot answered again
    finally:
        await writer.close()
        await reader.close()


async def test_cluster_client_replacements_back_off_while_reads_keep_failing(
    redis_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a long outage of one group (every client's map stays wrong), the wait before
    the next replacement doubles; once the group reads again it is back to ``rebuild_after``."""
    writer = RedisBus(redis_cluster.url, cluster=True)
    bus = RedisBus(redis_cluster.url, cluster=True, rebuild_after=0.2)
    try:
        await writer.append("w", [Entry(1, 1, 1, 0.0, 0.0, [], [])])
        slot = bus._reader.keyslot(bus.layout.stream("w"))
        with monkeypatch.context() as patch:
            _wedge(patch, slot, lambda m: True)  # every client, the replacements too
            start = time.monotonic()

            async def two_replacements() -> bool:
                assert not await _read_or_fail(bus, {"w": "0"})  # failed, or nothing yet
                return bus.client_rebuilds == 2

            await wait_until(two_replacements, 10, "two replacements")
            assert time.monotonic() - start >= 0.2 + 0.4  # the second waited twice as long
            assert bus._rebuild_wait == pytest.approx(0.8)
        got: list[Any] = []

        async def read() -> bool:  # the wedge is gone: the next replacement reads
            got[:] = await _read_or_fail(bus, {"w": "0"}) or []
            return bool(got)

        await wait_until(read, 10, "the stream read once the map is right")
        assert bus._rebuild_wait == pytest.approx(0.2)
        assert [e.seq for _, e in got[0].entries] == [1]  # type: ignore[union-attr]
    finally:
        await bus.close()
        await writer.close()


@pytest.mark.alone
async def test_idle_cluster_groups_are_not_re_read_every_call(redis_cluster: LocalCluster) -> None:
    """A group's read stays in flight with a server-side block of ``_GROUP_BLOCK_MS``, so
    100 ms calls over idle streams do not re-issue every group's XREAD each time (it was
    600 XREADs a second over 60 groups); an entry still wakes its group's read at once."""
    writer = RedisBus(redis_cluster.url, cluster=True)
    bus = RedisBus(redis_cluster.url, cluster=True)
    sent: list[int] = []
    real = bus._xread_slot

    async def counted(slot: int, *args: Any) -> Any:
        sent.append(slot)
        return await real(slot, *args)

    bus._xread_slot = counted  # type: ignore[method-assign]
    try:
        positions = {w: "0" for w in WORKERS}  # empty streams, one group each (3 shards)
        groups = {key_slot(bus.layout.stream(w).encode()) for w in WORKERS}
        loop = asyncio.get_running_loop()
        start = loop.time()
        calls = 0
        while loop.time() - start < 1.5:
            assert await bus.read(positions, block_ms=100) == []
            calls += 1
        assert calls >= 10  # each call waited ~100 ms
        # each group read at most twice in 1.5 s (block 1 s), not once per call
        assert len(sent) <= 2 * len(groups), (len(sent), len(groups), calls)
        await writer.append(WORKERS[0], [Entry(1, 1, 1, 0.0, 0.0, [], [])])
        woke = loop.time()
        got = await bus.read(positions, block_ms=2000)
        assert [r.worker for r in got] == [WORKERS[0]] and loop.time() - woke < 0.5
    finally:
        await bus.close()
        await writer.close()


@contextlib.asynccontextmanager
async def _fleet(url: str, **bus_opts: Any) -> AsyncIterator[tuple[Any, list[Any], list[Any]]]:
    """A consumer and one agent (with its fake engine) per worker of ``WORKERS``."""
    engines = [FakeEngine("vllm-0.33", seed=i) for i in range(len(WORKERS))]
    try:
        async with contextlib.AsyncExitStack() as stack:
            consumer = await stack.enter_async_context(running_consumer(url, **bus_opts))
            agents = []
            for engine, w in zip(engines, WORKERS, strict=True):
                config = agent_config(engine, worker=w, digest_interval=1.0)
                agents.append(
                    await stack.enter_async_context(running_agent(config, url, **bus_opts))
                )
            for engine, agent in zip(engines, agents, strict=True):
                await join(engine, agent)
            yield consumer, agents, engines
    finally:
        for engine in engines:
            await engine.close()


async def _drive_all(engines: list[Any], steps: int) -> None:
    for engine in engines:
        await drive(engine, steps)


async def _index_equals_mirrors(
    consumer: Any, agents: list[Any], engines: list[Any], cluster: LocalCluster | None = None
) -> None:
    for engine, agent in zip(engines, agents, strict=True):
        expected = engine.expected_keys(KEYER)
        await wait_until(lambda a=agent, e=expected: a.mirror_keys() == e, 20, "mirror == engine")
    try:
        await settle(consumer, agents, 40)
    except AssertionError as exc:
        if cluster is None:
            raise
        raise AssertionError(
            f"{exc}\n{_slot_views(consumer, cluster)}\n{_catch_up_views(consumer, agents)}"
            f"\n{_pending_awaits()}"
        ) from exc
    assert sorted(consumer.workers()) == WORKERS
    for agent in agents:
        w = agent.config.worker_id
        assert key_digest(consumer.index.worker_keys(w)) == key_digest(agent.mirror_keys())


def _pending_awaits() -> str:
    """Every pending task of the loop with the chain of awaits it is suspended in (its
    coroutine's frame, then what that awaits, down to the innermost): where a consumer that
    stopped reading waits."""
    lines = []
    for task in asyncio.all_tasks():
        if task.done() or task is asyncio.current_task():
            continue
        chain: list[str] = []
        coro: Any = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                chain.append(f"{frame.f_code.co_name} ({where})")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        where_it_waits = " > ".join(chain) if chain else repr(task)
        lines.append(f"task {task.get_name()}: {where_it_waits}")
    return "\n".join(sorted(lines))


def _catch_up_views(consumer: Any, agents: list[Any]) -> str:
    """Per worker, what ``settle`` waits for: the agent's publisher idle, its epoch and last
    seq against the consumer's cursor, and the index's keys against the mirror's."""
    lines = []
    for a in agents:
        w = a.config.worker_id
        cur = consumer.applier.cursors.get(w)
        index, mirror = consumer.index.worker_keys(w), a.mirror_keys()
        lines.append(
            f"{w}: idle {a.publisher.idle.is_set()}, agent epoch/seq {a.epoch}/{a.publisher.seq},"
            f" cursor {None if cur is None else (cur.epoch, cur.seq)}, index {len(index)} keys,"
            f" mirror {len(mirror)}, index - mirror {len(index - mirror)},"
            f" mirror - index {len(mirror - index)}"
        )
    return "\n".join(lines)


def _slot_views(consumer: Any, cluster: LocalCluster) -> str:
    """Per worker: the node the consumer's client reads its stream from, and each live
    node's own view of who serves it (a stale client, or nodes that disagree)."""
    manager = consumer.bus._reader.nodes_manager
    lines = [f"client rebuilds: {consumer.bus.client_rebuilds}"]
    for w in WORKERS:
        slot = key_slot(RedisLayout().stream(w).encode())
        nodes = manager.slots_cache.get(slot) or []
        lines.append(
            f"{w}: slot {slot}, client reads {nodes[0].name if nodes else None},"
            f" nodes say {cluster.slot_views(slot)}"
        )
    return "\n".join(lines)


async def _fail_over_while_publishing(engines: list[Any], fail: Callable[[], Any]) -> None:
    """Run ``fail`` (blocking: kill + wait for the takeover) while engines keep publishing."""
    done = asyncio.Event()

    async def publish() -> None:
        while not done.is_set():
            await _drive_all(engines, 1)
            await asyncio.sleep(0.05)  # pacing the load, not waiting for anything

    task = asyncio.create_task(publish())
    try:
        await asyncio.to_thread(fail)
    finally:
        done.set()
        await task


async def test_cluster_shard_failover_loses_nothing(redis_cluster: LocalCluster) -> None:
    url = redis_cluster.url
    async with _fleet(url, cluster=True) as (consumer, agents, engines):
        await _drive_all(engines, 5)
        await _index_equals_mirrors(consumer, agents, engines)
        stream = RedisLayout().stream(WORKERS[0])
        victim = redis_cluster.primary_for(stream)
        new: list[int] = []
        await _fail_over_while_publishing(
            engines, lambda: new.append(redis_cluster.fail_primary(victim))
        )
        assert redis_cluster.primary_for(stream) == new[0] != victim
        await _drive_all(engines, 5)
        await _index_equals_mirrors(consumer, agents, engines, redis_cluster)
        assert victim not in redis_cluster.shard_primaries()


async def test_sentinel_failover_loses_nothing(redis_sentinel: LocalSentinel) -> None:
    opts = {"sentinels": redis_sentinel.addresses, "sentinel_master": redis_sentinel.master}
    async with _fleet("", **opts) as (consumer, agents, engines):
        await _drive_all(engines, 5)
        await _index_equals_mirrors(consumer, agents, engines)
        old = redis_sentinel.master_port()
        await _fail_over_while_publishing(engines, redis_sentinel.fail_primary)
        assert redis_sentinel.master_port() != old
        await _drive_all(engines, 5)
        await _index_equals_mirrors(consumer, agents, engines)


# -- the binaries on a cluster -------------------------------------------------------------------


def test_stack_on_a_cluster_routes_to_cached_prefixes(tmp_path: Path) -> None:
    """Sim workers, their agents and a gateway, all in cluster mode, on 3 primaries: the
    workers' keys land on every shard, each follow-up turn goes to the worker that holds its
    conversation and hits its cache as predicted, and the index ends equal to the mirrors."""
    n = 4  # conversations, each with a system prompt of its own
    cfg = StackConfig(
        workers=4, speedup=50, redis_cluster=3, worker_prefix="node", log_dir=tmp_path
    )  # node-0..2 hash to three different shards
    with Stack(cfg) as stack:
        assert stack.cluster is not None and stack.redis is None
        layout = RedisLayout()
        shards: dict[str, int] = {}
        for i in range(cfg.workers):
            w = stack.worker_id(i)
            shards[w] = stack.cluster.primary_for(layout.worker(w))
            with redis.Redis(host="127.0.0.1", port=shards[w]) as node:  # no redirection
                assert node.exists(layout.worker(w)), (w, shards[w])  # the agent registered
        assert set(shards.values()) == set(stack.cluster.shard_primaries()), shards
        rows = run_chats(stack, conversations=n, turns=3, shared_system=False)
        assert wait_for(lambda: converged(stack), 15) is not None, stack.diverged()
        assert {w["worker_id"] for w in stack.workers()} == set(shards)
    assert len(rows) == 3 * n  # run_chats raises on any failed request
    assert [r[0] for r in rows] == [r[1] for r in rows], rows  # predicted == engine reused
    for k in range(n, len(rows)):  # each follow-up: the previous turn's worker, a cache hit
        assert rows[k][3] == rows[k - n][3], (k, rows)
        assert rows[k][1] > 0, (k, rows)


def test_stack_on_a_cluster_survives_a_shard_failover(tmp_path: Path) -> None:
    """The binaries through a failover: while chats keep arriving, the primary of one
    worker's shard is killed and its replica takes over. No client request fails (routing
    goes on from the last index), the gateway's index ends equal to every agent's mirror (the
    agents published through the takeover, the consumer re-read the shard), and the turns
    after it are routed by cache again, each prediction equal to what the engine reused."""
    cfg = StackConfig(
        workers=4,
        speedup=50,
        redis_cluster=3,
        redis_cluster_replicas=1,
        worker_prefix="node",
        log_dir=tmp_path,
    )
    with Stack(cfg) as stack:
        assert stack.cluster is not None
        before = run_chats(stack, conversations=4, turns=1, shared_system=False)
        victim = stack.cluster.primary_for(RedisLayout().stream(stack.worker_id(0)))
        served: list[str] = []
        failed: list[BaseException] = []
        done = threading.Event()

        def traffic() -> None:  # its own conversations, as fast as they are answered
            client = openai.OpenAI(
                base_url=stack.gateway_urls[0] + "/v1", api_key="none", max_retries=0
            )
            rng = random.Random(4)
            while not done.is_set():
                try:
                    msgs = [{"role": "user", "content": text(rng, 200)}]
                    r = client.chat.completions.with_raw_response.create(
                        model=MODEL,
                        messages=msgs,
                        max_tokens=4,  # type: ignore[arg-type]
                    )
                    served.append(r.headers["x-kvroute-worker"])
                except Exception as exc:  # every failure is the test's finding
                    failed.append(exc)

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            assert wait_for(lambda: len(served) >= 3, 30) is not None, failed[:3]
            new = stack.cluster.fail_primary(victim)
            n_at_takeover = len(served)
            assert wait_for(lambda: len(served) >= n_at_takeover + 5, 30) is not None
        finally:
            done.set()
            thread.join(60)
        assert not failed, failed[:3]
        assert (
            victim not in stack.cluster.shard_primaries() and new in stack.cluster.shard_primaries()
        )
        assert wait_for(lambda: converged(stack), 30) is not None, stack.diverged()
        after = run_chats(stack, conversations=4, turns=2, shared_system=False)
    for rows in (before, after):
        assert [r[0] for r in rows] == [r[1] for r in rows], rows  # predicted == engine reused
    assert sum(r[1] for r in after[4:]) > 0  # the second turns hit their own first turns


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"redis_cluster": 2}, "needs 3 primaries"),
        ({"redis_cluster": 3, "redis_tls": True}, "no password or TLS"),
        ({"redis_cluster": 3, "redis_password": "pw"}, "no password or TLS"),
    ],
)
def test_stack_refuses_a_cluster_it_cannot_start(
    tmp_path: Path, bad: dict[str, Any], msg: str
) -> None:
    stack = Stack(StackConfig(workers=1, log_dir=tmp_path, **bad))
    with pytest.raises(HarnessError, match=msg):
        stack.start()
    assert stack.cluster is None and stack.sim is None and not stack.agents
