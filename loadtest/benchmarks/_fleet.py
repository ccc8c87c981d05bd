"""``kvroute bench events --workers N [--cluster K]``: the event bus at fleet size (target P2).

N simulated agents, spread over ``--agent-procs`` processes as asyncio tasks (the cheap
part: one ``RedisBus`` per process, no engine, no ZMQ, no canonicalisation, which the
single-worker run of ``kvroute bench events`` measures), speak the protocol of a real
agent: a ``[Cleared]`` entry, an empty snapshot and a registration at start, heartbeats
every second, load reports every 0.25 s, and stream entries of ``--blocks-per-entry`` new
random block keys (with removals of the oldest once a worker holds ``--capacity``). Each
keeps the key set it published (its mirror). The gateway's ``Consumer`` in this process
reads every stream into a ``ShadowIndex``.

The same fleet runs twice in one invocation: on a ``K``-shard Redis Cluster started by the
bench (primaries only), and on one redis-server (the baseline). Per run:

* idle: every worker registered and quiet for ``--idle`` seconds; the consumer's CPU then is
  the price of reading N streams with nothing in them (per-slot polling on a cluster);
* throughput: every agent publishes its share of ``--blocks`` as fast as it can;
  ``blocks_per_s`` is block events applied to the index per second, first send to last apply;
* lag: ``--rate`` blocks/s offered in total for ``--duration`` s; the time from an entry's
  ``ts`` (stamped as the simulated agent sends it: the bus and the consumer, not the agent
  processes' own backlog, which ``lag_sent_blocks_per_s`` shows) to its apply, p50/p99;
* Redis CPU per node (``INFO cpu``, over throughput + lag), bytes per block (``MEMORY USAGE``
  of every stream over the block events it holds), the consumer's CPU (this process);
* at the end the index must equal every agent's mirror (``key_digest`` per worker);
* catch-up: a second consumer (a new gateway replica) reads every stream from its start;
  Redis CPU and its own CPU per block are what each further replica costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import queue
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from gateway.consumer import Consumer, ConsumerConfig
from gateway.contract.bus import BusError, EventBus
from gateway.contract.redis_bus import RedisBus
from gateway.contract.wire import (
    Cleared,
    EngineReport,
    Entry,
    Removed,
    Snapshot,
    Stored,
    WorkerInfo,
    key_digest,
)
from loadtest.harness import RedisServer
from loadtest.redis_topologies import LocalCluster
from loadtest.report import percentile

P2_E2E_BLOCKS_PER_S = 100_000
P2_LAG_P99_MS = 50.0
#: seconds a simulated registration lives unless renewed (heartbeats every second; longer
#: than a real agent's 3 s, so a loaded machine's stalls do not expire hundreds of workers)
REGISTRATION_TTL = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the fleet run (added to ``kvroute bench events``)."""
    parser.add_argument(
        "--workers", type=int, default=0, help="simulated agents (0: the single-worker run)"
    )
    parser.add_argument("--cluster", type=int, default=3, help="Redis Cluster shards (fleet)")
    parser.add_argument("--agent-procs", type=int, default=2, help="processes running agents")
    parser.add_argument("--blocks-per-entry", type=int, default=64, help="blocks per entry")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds of the idle phase")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the single-redis-server run"
    )


# -- simulated agents (child processes) --------------------------------------------------------


@dataclass
class _Plan:
    url: str
    cluster: bool
    workers: list[str]
    blocks_each: int  # throughput phase
    rate_each: float  # lag phase, blocks/s
    duration: float
    per_entry: int
    capacity: int
    seed: int


@dataclass
class _SimAgent:
    worker: str
    bus: EventBus
    rng: random.Random
    capacity: int
    gate: asyncio.Semaphore  # operations in flight per process (connections)
    epoch: int = field(default_factory=lambda: time.time_ns() // 1000)
    seq: int = 0
    held: list[int] = field(default_factory=list)
    blocks: int = 0  # block events published

    async def entry(self, events: list[Any]) -> str:
        """Append the next entry, retried with its seq until the bus takes it (as the real
        publisher does; a bus that refuses for 30 s ends the run)."""
        self.seq += 1
        delay, deadline = 0.05, time.monotonic() + 30
        while True:
            try:
                async with self.gate:
                    now = time.time()  # lag counts from the send: the bus and the consumer
                    entry = Entry(1, self.epoch, self.seq, now, now, [], events)
                    (sid,) = await self.bus.append(self.worker, [entry])
                return sid
            except BusError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)  # back off before retrying
                delay = min(1.0, delay * 2)

    async def start(self) -> None:
        sid = await self.entry([Cleared()])
        snapshot = Snapshot(1, self.epoch, self.seq, sid, time.time(), [])
        async with self.gate:
            await self.bus.write_snapshot(self.worker, snapshot)
        await self.heartbeat()

    async def heartbeat(self) -> None:
        info = WorkerInfo(
            worker_id=self.worker, url="http://127.0.0.1:9", model="bench", epoch=self.epoch
        )
        with contextlib.suppress(BusError):  # the next heartbeat renews it
            async with self.gate:
                await self.bus.register(info, REGISTRATION_TTL)

    async def publish(self, n: int) -> None:
        keys = [self.rng.getrandbits(63) for _ in range(n)]
        parent = self.held[-1] if self.held and self.rng.random() < 0.7 else None
        events: list[Any] = []
        over = len(self.held) + n - self.capacity
        if over > 0:
            gone, self.held = self.held[:over], self.held[over:]
            events.append(Removed(gone))
        events.append(Stored(parent, keys))
        self.held.extend(keys)
        self.blocks += n + max(0, over)
        await self.entry(events)


async def _agents_main(plan: _Plan, go: Any, results: Any) -> None:
    # one client for all the agents of this process: a connection per task in flight
    bus = RedisBus(plan.url, cluster=plan.cluster, max_connections=256)
    rng = random.Random(plan.seed)
    gate = asyncio.Semaphore(64)
    agents = [
        _SimAgent(w, bus, random.Random(rng.getrandbits(32)), plan.capacity, gate)
        for w in plan.workers
    ]
    stop = asyncio.Event()

    async def report(a: _SimAgent) -> None:
        with contextlib.suppress(BusError):  # the next report replaces it
            async with gate:
                await bus.publish_report(a.worker, EngineReport(running=1, ts=time.time()), 2.0)

    async def every(period: float, op: Any) -> None:
        """``op`` for every agent each ``period`` (as each real agent's own loops do)."""
        while not stop.is_set():
            started = time.monotonic()
            await asyncio.gather(*(op(a) for a in agents))
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    try:
        for a in agents:
            await a.start()
        results.put(("ready", len(agents)))
        bg = asyncio.gather(every(0.25, report), every(1.0, _SimAgent.heartbeat))
        await _until_set(go["burst"])

        async def burst(a: _SimAgent) -> None:
            left = plan.blocks_each
            while left > 0:
                n = min(plan.per_entry, left)
                await a.publish(n)
                left -= n

        await asyncio.gather(*(burst(a) for a in agents))
        results.put(("burst_done", sum(a.blocks for a in agents)))
        await _until_set(go["paced"])

        async def paced(a: _SimAgent, offset: float) -> None:
            interval = plan.per_entry / plan.rate_each
            start = time.monotonic() + offset * interval
            i = 0
            while True:
                at = start + i * interval
                if at - start > plan.duration:
                    return
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing the offered load
                await a.publish(plan.per_entry)
                i += 1

        await asyncio.gather(*(paced(a, i / len(agents)) for i, a in enumerate(agents)))
        results.put(
            ("mirrors", {a.worker: (len(a.held), key_digest(a.held), a.blocks) for a in agents})
        )
        await _until_set(go["stop"])
        stop.set()
        await bg
    finally:
        await bus.close()


def _agents_process(plan: _Plan, go: Any, results: Any) -> None:
    try:
        asyncio.run(_agents_main(plan, go, results))
    except Exception as exc:  # reported to the parent, which stops the run
        results.put(("error", repr(exc)))
        raise


async def _until_set(event: Any) -> None:
    """Wait for a multiprocessing event without a thread (polled, no deadline: the parent
    kills this process when it gives up)."""
    while not event.is_set():  # noqa: ASYNC110 - a multiprocessing event, not an asyncio one
        await asyncio.sleep(0.01)


# -- the run -----------------------------------------------------------------------------------


@dataclass
class _Tap:
    lags: list[float] = field(default_factory=list)
    blocks: int = 0
    recording: bool = False

    def __call__(self, worker: str, entry: Entry, now: float) -> None:
        for ev in entry.events:
            if isinstance(ev, Stored | Removed):
                self.blocks += len(ev.keys)
        if self.recording:
            self.lags.append(now - entry.ts)


def _node_cpu(ports: list[int]) -> dict[int, float]:
    out = {}
    for port in ports:
        with redis.Redis(host="127.0.0.1", port=port) as r:
            info = r.info("cpu")
        out[port] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return out


def _own_cpu() -> float:
    """This process's CPU seconds (user + system, every thread), to the nanosecond:
    ``os.times`` counts in clock ticks (10 ms), which a short burst can fall within."""
    return time.process_time()


async def _until(cond: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.01)


async def _check_equal(
    consumer: Consumer, mirrors: dict[str, tuple[int, str, int]], who: str = "the consumer"
) -> None:
    """Every worker's index keys have its mirror's digest (polled a while: the last entries
    may still be in flight), or the run fails naming one that differs."""

    def off() -> list[str]:
        return [w for w, m in mirrors.items() if key_digest(consumer.index.worker_keys(w)) != m[1]]

    deadline = time.monotonic() + 30
    while bad := off():
        if time.monotonic() > deadline:
            w = bad[0]
            raise TimeoutError(
                f"{who}: the index differs from {len(bad)} of {len(mirrors)} mirrors (e.g. {w}: "
                f"{len(consumer.index.worker_keys(w))} keys, mirror {mirrors[w][0]}, "
                f"cursor {consumer.applier.cursors.get(w)}); consumer {consumer.stats}"
            )
        await asyncio.sleep(0.5)  # digests of every worker are costly: poll slowly


async def _catch_up(
    url: str, cluster: bool, ports: list[int], mirrors: dict[str, tuple[int, str, int]], blocks: int
) -> dict[str, float]:
    """A new gateway replica reads every stream from its start (the snapshots are the empty
    ones of the agents' start): Redis CPU and this replica's CPU per block read and applied,
    i.e. what each further replica adds."""
    bus = RedisBus(url, cluster=cluster)
    tap = _Tap()
    replica = Consumer(bus, config=ConsumerConfig(), on_entry=tap)
    redis0, cpu0, t0 = _node_cpu(ports), _own_cpu(), time.perf_counter()
    try:
        await replica.start()
        await _until(lambda: tap.blocks >= blocks, 300, "a second replica to catch up")
        seconds, cpu, redis1 = time.perf_counter() - t0, _own_cpu() - cpu0, _node_cpu(ports)
        await _check_equal(replica, mirrors, "the second replica")
    finally:
        await replica.stop()
        await bus.close()
    redis_cpu = sum(redis1[p] - redis0[p] for p in ports)
    return {
        "catchup_seconds": round(seconds, 2),
        "catchup_blocks_per_s": round(blocks / seconds),
        "catchup_redis_cpu_us_per_block": round(redis_cpu / blocks * 1e6, 2),
        "catchup_consumer_cpu_us_per_block": round(cpu / blocks * 1e6, 2),
    }


async def _wait_results(results: Any, kind: str, n: int, within: float) -> list[Any]:
    """``n`` reports of ``kind`` from the agent processes (polled; an agent's error or the
    deadline ends the run)."""
    got: list[Any] = []
    deadline = time.monotonic() + within
    while len(got) < n:
        try:
            k, v = results.get_nowait()
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(f"agents did not report {kind} in time") from None
            await asyncio.sleep(0.01)
            continue
        if k == "error":
            raise TimeoutError(f"an agent process failed: {v}")
        if k == kind:
            got.append(v)
    return got


async def _run_one(
    args: argparse.Namespace, url: str, cluster: bool, ports: list[int]
) -> dict[str, Any]:
    n = args.workers
    names = [f"fleet-{i:05d}" for i in range(n)]
    procs = max(1, min(args.agent_procs, n))
    mp = multiprocessing.get_context("spawn")
    go = {k: mp.Event() for k in ("burst", "paced", "stop")}
    results = mp.Queue()
    plans = [
        _Plan(
            url=url, cluster=cluster, workers=names[i::procs],
            blocks_each=max(1, args.blocks // n), rate_each=args.rate / n,
            duration=args.duration, per_entry=args.blocks_per_entry,
            capacity=args.capacity // n if args.capacity >= n else args.capacity,
            seed=args.seed + i,
        )
        for i in range(procs)
    ]  # fmt: skip
    children = [
        mp.Process(target=_agents_process, args=(p, go, results), daemon=True) for p in plans
    ]
    bus = RedisBus(url, cluster=cluster)
    tap = _Tap()
    consumer = Consumer(bus, config=ConsumerConfig(), on_entry=tap)  # the gateway's
    try:
        for c in children:
            c.start()
        await _wait_results(results, "ready", procs, 60)
        await consumer.start()
        await _until(
            lambda: len(consumer.applier.cursors) == n and consumer.synced,
            60,
            "the consumer to bootstrap every worker",
        )
        # -- idle -------------------------------------------------------------------------
        cpu0, t0 = _own_cpu(), time.perf_counter()
        await asyncio.sleep(args.idle)  # measuring an idle window
        idle_cpu = (_own_cpu() - cpu0) / (time.perf_counter() - t0)
        # -- throughput -------------------------------------------------------------------
        redis0, cpu0 = _node_cpu(ports), _own_cpu()
        before = tap.blocks
        t0 = time.perf_counter()
        go["burst"].set()
        sent = sum(await _wait_results(results, "burst_done", procs, 600))
        await _until(lambda: tap.blocks - before >= sent, 600, "the burst to be applied")
        burst_s = time.perf_counter() - t0
        burst_cpu = _own_cpu() - cpu0
        # -- lag --------------------------------------------------------------------------
        tap.recording = True
        cpu1, t1 = _own_cpu(), time.perf_counter()
        go["paced"].set()
        mirrors: dict[str, tuple[int, str, int]] = {}
        for part in await _wait_results(results, "mirrors", procs, args.duration + 120):
            mirrors.update(part)
        send_s = time.perf_counter() - t1
        paced_blocks = sum(m[2] for m in mirrors.values()) - sent  # after the burst

        total_blocks = sum(m[2] for m in mirrors.values())
        await _until(lambda: tap.blocks - before >= total_blocks, 60, "the last entries")
        await _check_equal(consumer, mirrors)
        paced_s = time.perf_counter() - t1
        paced_cpu = _own_cpu() - cpu1
        redis1 = _node_cpu(ports)
        tap.recording = False
        memory = 0
        for w in names:
            memory += await bus.stream_bytes(w)
        # -- a second replica reads every stream from the start: the read side alone ---------
        await consumer.stop()
        catchup = await _catch_up(url, cluster, ports, mirrors, total_blocks)
        go["stop"].set()
    finally:
        for e in go.values():
            e.set()
        await consumer.stop()
        await bus.close()
        for c in children:
            c.join(10)
            if c.is_alive():
                c.kill()
                c.join(5)
    window = burst_s + paced_s
    redis_cpu = {str(p): round(redis1[p] - redis0[p], 2) for p in ports}
    applied_paced = len(tap.lags)
    return {
        "redis": f"cluster of {len(ports)} primaries" if cluster else "one redis-server",
        "workers": n,
        "blocks_per_s": round(sent / burst_s),
        "burst_blocks": sent,
        "burst_seconds": round(burst_s, 3),
        "lag_rate_blocks_per_s": args.rate,
        "lag_sent_blocks_per_s": round(paced_blocks / send_s),
        "lag_entries": applied_paced,
        "lag_p50_ms": round(percentile(tap.lags, 0.5) * 1000, 2),
        "lag_p99_ms": round(percentile(tap.lags, 0.99) * 1000, 2),
        "redis_cpu_seconds": redis_cpu,
        "redis_cpu_seconds_total": round(sum(redis_cpu.values()), 2),
        "redis_cpu_us_per_block": round(sum(redis_cpu.values()) / max(1, total_blocks) * 1e6, 2),
        "bytes_per_block": round(memory / max(1, total_blocks), 1),
        "stream_bytes": memory,
        "consumer_cpu_idle_cores": round(idle_cpu, 3),
        "consumer_cpu_burst_s": round(burst_cpu, 2),
        "consumer_cpu_us_per_block_burst": round(burst_cpu / max(1, sent) * 1e6, 2),
        "consumer_cpu_paced_cores": round(paced_cpu / paced_s, 3),
        "index_equals_mirrors": True,  # the run waits for it (and fails if it never comes)
        **catchup,
        "window_s": round(window, 2),
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-bench-fleet-"))
    runs = []
    try:
        with LocalCluster(primaries=args.cluster, replicas=0, workdir=workdir / "cluster") as cl:
            runs.append(await _run_one(args, cl.url, True, [n.port for n in cl.nodes]))
        if not args.no_baseline:
            single = RedisServer(workdir=workdir / "single")
            single.workdir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            with single:
                runs.append(await _run_one(args, single.url, False, [single.port]))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _result(args, runs)


def _result(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    cl = runs[0]
    checks = {
        "blocks_per_s": cl["blocks_per_s"] >= P2_E2E_BLOCKS_PER_S,
        "lag_p99_ms": cl["lag_p99_ms"] <= P2_LAG_P99_MS,
        "index_equals_mirrors": all(r["index_equals_mirrors"] for r in runs),
    }
    keys = [
        "blocks_per_s", "lag_sent_blocks_per_s", "lag_p50_ms", "lag_p99_ms", "redis_cpu_seconds_total",
        "redis_cpu_us_per_block", "bytes_per_block", "consumer_cpu_idle_cores",
        "consumer_cpu_us_per_block_burst", "consumer_cpu_paced_cores",
        "catchup_blocks_per_s", "catchup_redis_cpu_us_per_block",
        "catchup_consumer_cpu_us_per_block",
    ]  # fmt: skip
    table = []
    for k in keys:
        row: dict[str, Any] = {"metric": k, "cluster": cl[k]}
        if len(runs) > 1:
            base = runs[1][k]
            row["one_node"] = base
            row["ratio"] = round(cl[k] / base, 2) if base else "-"
        table.append(row)
    out: dict[str, Any] = {
        "benchmark": "events",
        "mode": "fleet",
        "workers": args.workers,
        "shards": args.cluster,
        "runs": runs,
        "targets": checks,
        "ok": all(checks.values()),
        "table": table,
    }
    if len(runs) > 1:
        out["ratios_cluster_over_one_node"] = {
            k: round(cl[k] / runs[1][k], 3) for k in keys if runs[1][k]
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return asyncio.run(_run(args))
    except TimeoutError as exc:
        return {"benchmark": "events", "mode": "fleet", "ok": False, "error": str(exc)}
