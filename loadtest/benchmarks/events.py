"""Event pipeline benchmark: engine ZMQ → agent → Redis → consumer index (target P2).

A synthetic vLLM 0.33 engine in this process publishes KV events (tagged maps, one
BlockRemoved per hash once its cache is full) on a real ZMQ PUB socket with a replay
ROUTER; a real ``kvroute agent`` child process canonicalises and publishes them to a
private redis-server; the gateway's ``Consumer`` in this process applies them to a
``ShadowIndex``. Two phases:

* throughput — every batch sent at once; ``e2e_blocks_per_s`` is canonical block events
  (stores + removes) applied to the index per second, from the first send to the last
  entry applied (the maximum sustained rate: ZMQ and Redis queue what the next stage has
  not taken yet);
* lag — batches paced at ``--rate`` blocks/s; for every stream entry applied, the time
  from the engine's batch timestamp to the index update (``lag_p50_ms``, ``lag_p99_ms``).

``redis_bytes_per_block`` is the stream's memory in Redis (MEMORY USAGE) divided by the
canonical block events it holds; ``entry_bytes_per_block`` the encoded payload alone.

At the end the index must hold exactly what the engine holds: the engine computes the
canonical key of every block it holds (``BlockKeyer`` over the block's tokens, chained from
its parent's key, with the agent's seed and block size), and ``index_equals_engine`` is the
equality of ``key_digest`` of that set and of the index's key set for the worker (the digest
the gateway's ``/debug/index`` and the agent's ``/mirror`` publish), not of their sizes.
``ok``: that equality and P2's end-to-end targets (>= 100,000 blocks/s; lag p99 <= 50 ms).

``--workers N`` runs the fleet variant instead (``loadtest/benchmarks/_fleet.py``): N simulated
agents on a ``--cluster K``-shard Redis Cluster, with one redis-server as the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from gateway.consumer import Consumer, ConsumerConfig
from gateway.contract.redis_bus import RedisBus
from gateway.contract.wire import Entry, Removed, Stored, key_digest
from gateway.routing.keys import BlockKeyer
from loadtest.benchmarks import _fleet
from loadtest.harness import ChildProcess, RedisServer, free_ports
from loadtest.report import percentile

NAME = "events"
HELP = "engine ZMQ -> agent -> Redis -> consumer index: throughput, lag, bytes per block"

WORKER = "bench-w0"
HASH_SEED = "kvroute-bench"
P2_E2E_BLOCKS_PER_S = 100_000
P2_LAG_P99_MS = 50.0
END_SEQ = b"\xff" * 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=400_000, help="stored blocks, phase 1")
    parser.add_argument("--rate", type=float, default=20_000, help="blocks/s offered, phase 2")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of phase 2")
    parser.add_argument("--blocks-per-event", type=int, default=16, help="blocks per BlockStored")
    parser.add_argument("--events-per-batch", type=int, default=4, help="BlockStored per batch")
    parser.add_argument("--capacity", type=int, default=100_000, help="engine cache, blocks")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    _fleet.add_arguments(parser)


# -- a synthetic engine -----------------------------------------------------------------------


@dataclass
class SyntheticEngine:
    """A vLLM-like cache: requests store runs of blocks (continuing a recent one or from
    the root); when full, the least recently stored run is evicted tail first (vLLM frees
    a request's blocks in reverse order), one BlockRemoved per hash. ``canonical`` maps
    every held block's hash to its canonical key (what the index must hold)."""

    block_size: int
    capacity: int
    rng: random.Random
    keyer: BlockKeyer
    held: set[int] = field(default_factory=set)
    canonical: dict[int, int] = field(default_factory=dict)
    runs: deque[list[int]] = field(default_factory=deque)  # oldest first
    stored: int = 0
    removed: int = 0

    def batch(self, events_per_batch: int, blocks_per_event: int) -> list[Any]:
        """One engine step: evictions for the new blocks first, then the stores (vLLM
        allocates before it caches full blocks)."""
        events: list[Any] = self._evict(events_per_batch * blocks_per_event)
        events.extend(self._store(blocks_per_event) for _ in range(events_per_batch))
        return events

    def _store(self, n: int) -> dict[str, Any]:
        rng = self.rng
        parent = None
        recent = [r[-1] for r in list(self.runs)[-64:] if r]
        if recent and rng.random() < 0.7:
            parent = rng.choice(recent)
        hashes = [rng.getrandbits(64) for _ in range(n)]
        tokens = [rng.randrange(1, 100_000) for _ in range(n * self.block_size)]
        self.held.update(hashes)
        parent_key = None if parent is None else self.canonical[parent]
        self.canonical.update(zip(hashes, self.keyer.keys(tokens, parent_key), strict=True))
        self.runs.append(hashes)
        self.stored += n
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }

    def _evict(self, n: int) -> list[dict[str, Any]]:
        out = []
        while len(self.held) + n > self.capacity and self.runs:
            run = self.runs[0]
            h = run.pop()
            if not run:
                self.runs.popleft()
            self.held.discard(h)
            del self.canonical[h]
            out.append(
                {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
            )
            self.removed += 1
        return out


class Publisher:
    """ZMQ PUB (3 frames) + replay ROUTER answering from an unbounded buffer."""

    def __init__(self, ctx: zmq.asyncio.Context, pub_port: int, replay_port: int) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the agent's pace is measured
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self._raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.pub.underlying)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer: dict[int, bytes] = {}
        self.seq = 0
        self._task = asyncio.create_task(self._serve())

    async def send(self, payload: bytes) -> int:
        """Queue one batch (a plain send: with no high-water mark it never blocks)."""
        seq = self.seq
        self.seq += 1
        self.buffer[seq] = payload
        self._raw.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        if seq % 64 == 0:
            await asyncio.sleep(0)  # let the consumer run between bursts
        return seq

    async def _serve(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            for seq in range(start, self.seq):
                await self.router.send_multipart(
                    [ident, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]]
                )
            await self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


def stamp(payload: bytes) -> bytes:
    """Set the batch timestamp (``[ts, ...]``: bytes 2..10 are the float64) to now."""
    return payload[:2] + struct.pack(">d", time.time()) + payload[10:]


# -- measuring ---------------------------------------------------------------------------------


@dataclass
class Tap:
    """Consumer hook: applied entries, their lag and the engine seqs they cover."""

    lags: list[float] = field(default_factory=list)
    blocks: int = 0
    last_seq: int = -1
    recording: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    target_seq: int = -1

    def __call__(self, worker: str, entry: Entry, now: float) -> None:
        for ev in entry.events:
            if isinstance(ev, Stored | Removed):
                self.blocks += len(ev.keys)
        for _, _, hi in entry.eseq:
            self.last_seq = max(self.last_seq, hi)
        if self.recording and entry.ts > 0:
            self.lags.append(now - entry.ts)
        if self.target_seq >= 0 and self.last_seq >= self.target_seq:
            self.done.set()

    async def until(self, seq: int, within: float) -> None:
        """Wait until the entries covering engine batch ``seq`` have been applied."""
        self.target_seq = seq
        self.done.clear()
        if self.last_seq >= seq:
            self.done.set()
        await asyncio.wait_for(self.done.wait(), within)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-bench-events-"))
    redis_srv = RedisServer(workdir=workdir / "redis")
    redis_srv.workdir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
    redis_srv.start()
    ctx = zmq.asyncio.Context()
    pub_port, replay_port = free_ports(2)
    pub = Publisher(ctx, pub_port, replay_port)
    agent = ChildProcess.kvroute(
        ["agent", "--engine", "vllm", "--engine-url", "http://127.0.0.1:9",
         "--worker-id", WORKER, "--model", "bench", "--redis", redis_srv.url,
         "--events", f"tcp://127.0.0.1:{pub_port}", "--replay", f"tcp://127.0.0.1:{replay_port}",
         "--block-size", str(args.block_size), "--hash-seed", HASH_SEED,
         "--log-level", "WARNING",
         "--set", "publish.max_buffer_events=5000000"],
        "agent", workdir,
    )  # fmt: skip
    bus = RedisBus(redis_srv.url)
    tap = Tap()
    consumer = Consumer(bus, config=ConsumerConfig(block_ms=20, poll_interval=0.1), on_entry=tap)
    keyer = BlockKeyer(HASH_SEED, args.block_size)
    engine = SyntheticEngine(args.block_size, args.capacity, random.Random(args.seed), keyer)
    enc = msgspec.msgpack.Encoder()
    # the whole workload is encoded up front: nothing but sends happen while measuring
    per_batch = args.events_per_batch * args.blocks_per_event
    warmup = [enc.encode([0.0, engine.batch(1, 1), 0]) for _ in range(200)]
    payloads = [
        enc.encode([0.0, engine.batch(args.events_per_batch, args.blocks_per_event), 0])
        for _ in range(max(1, args.blocks // per_batch))
    ]
    interval = per_batch / args.rate
    paced = [
        enc.encode([0.0, engine.batch(args.events_per_batch, args.blocks_per_event), 0])
        for _ in range(max(1, int(args.duration / interval)))
    ]
    try:
        agent.start()
        await consumer.start()
        await _wait(lambda: WORKER in consumer.workers() and WORKER in consumer.applier.cursors, 30)
        # warm-up: a first batch proves the whole path (and the SUB has joined)
        sent = 0
        while tap.last_seq < sent - 1 or sent == 0:  # every warm-up batch sent is applied
            if sent < len(warmup):
                await pub.send(stamp(warmup[sent]))
                sent += 1
            await asyncio.sleep(0.02)
        for p in warmup[sent:]:
            await pub.send(stamp(p))
        # -- phase 1: throughput ------------------------------------------------------------
        blocks_before = tap.blocks
        cpu0 = _cpu(agent, redis_srv)
        t0 = time.perf_counter()
        for p in payloads:
            seq = await pub.send(stamp(p))
        await tap.until(seq, 600)
        elapsed = time.perf_counter() - t0
        cpu = {k: round(v - cpu0[k], 2) for k, v in _cpu(agent, redis_srv).items()}
        e2e_blocks = tap.blocks - blocks_before
        stream_bytes, stream_blocks, payload_bytes = await _stream_size(bus, redis_srv.url)
        # -- phase 2: lag at a fixed offered rate ---------------------------------------------
        tap.target_seq = -1  # (phase 1's target is reached already)
        tap.recording = True
        start = time.perf_counter()
        for i, p in enumerate(paced):
            delay = start + i * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            seq = await pub.send(stamp(p))
        await tap.until(seq, 120)
        held = consumer.index.worker_keys(WORKER)
        index_digest = key_digest(held)
        engine_keys = set(engine.canonical.values())
        engine_digest = key_digest(engine_keys)
        missing, extra = len(engine_keys - held), len(held - engine_keys)
    finally:
        await consumer.stop()
        await bus.close()
        agent.stop()
        pub.close()
        ctx.destroy(linger=0)
        redis_srv.close()
    shutil.rmtree(workdir, ignore_errors=True)  # kept (agent.log) when the run failed
    rate = e2e_blocks / elapsed
    lag50, lag99 = percentile(tap.lags, 0.5) * 1000, percentile(tap.lags, 0.99) * 1000
    exact = index_digest == engine_digest
    checks = {
        "e2e_blocks_per_s": rate >= P2_E2E_BLOCKS_PER_S,
        "lag_p99_ms": lag99 <= P2_LAG_P99_MS,
        "index_equals_engine": exact,
    }
    table = [
        {"metric": "e2e_blocks_per_s", "value": round(rate),
         "target": f">= {P2_E2E_BLOCKS_PER_S}", "ok": checks["e2e_blocks_per_s"]},
        {"metric": "lag_p50_ms", "value": round(lag50, 2), "target": "-", "ok": "-"},
        {"metric": "lag_p99_ms", "value": round(lag99, 2), "target": f"<= {P2_LAG_P99_MS:g}",
         "ok": checks["lag_p99_ms"]},
        {"metric": "redis_bytes_per_block", "value": round(stream_bytes / max(1, stream_blocks), 1),
         "target": "-", "ok": "-"},
        {"metric": "index key digest = engine's", "value": index_digest[:12],
         "target": engine_digest[:12], "ok": exact},
    ]  # fmt: skip
    return {
        "benchmark": NAME,
        "e2e_blocks_per_s": round(rate),
        "e2e_seconds": round(elapsed, 3),
        "e2e_block_events": e2e_blocks,
        "e2e_cpu_seconds": cpu,
        "lag_rate_blocks_per_s": args.rate,
        "lag_entries": len(tap.lags),
        "lag_p50_ms": round(lag50, 2),
        "lag_p99_ms": round(lag99, 2),
        "lag_max_ms": round(max(tap.lags, default=0) * 1000, 2),
        "redis_bytes_per_block": round(stream_bytes / max(1, stream_blocks), 1),
        "entry_bytes_per_block": round(payload_bytes / max(1, stream_blocks), 1),
        "index_blocks": len(held),
        "engine_blocks": len(engine.canonical),
        "index_missing_blocks": missing,
        "index_extra_blocks": extra,
        "index_digest": index_digest,
        "engine_digest": engine_digest,
        "index_equals_engine": exact,
        "targets": checks,
        "ok": all(checks.values()),
        "table": table,
    }


async def _stream_size(bus: RedisBus, url: str) -> tuple[int, int, int]:
    """(stream bytes in Redis, canonical block events in it, encoded payload bytes)."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url)
    try:
        key = bus.layout.stream(WORKER)
        memory = int(await r.memory_usage(key, samples=0) or 0)
        blocks = payload = 0
        last = "-"
        while True:
            items: Any = await r.xrange(key, min=last, count=5000)
            if last != "-":
                items = items[1:]
            if not items:
                break
            for _sid, fields in items:
                data = fields[b"e"]
                payload += len(data)
                for ev in msgspec.msgpack.decode(data, type=Entry).events:
                    if isinstance(ev, Stored | Removed):
                        blocks += len(ev.keys)
            last = items[-1][0].decode()
        return memory, blocks, payload
    finally:
        await r.aclose()


def _cpu(agent: ChildProcess, redis_srv: RedisServer) -> dict[str, float]:
    """CPU seconds used so far by the agent, redis-server and this process (consumer and
    engine): where the pipeline's time goes."""
    own = os.times()
    return {
        "agent": _proc_cpu(agent.proc.pid if agent.proc else 0),
        "redis": _proc_cpu(redis_srv.proc.pid if redis_srv.proc else 0),
        "engine_and_consumer": own.user + own.system,
    }


def _proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait(cond: Any, within: float) -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("the agent did not register in time")
        await asyncio.sleep(0.05)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.workers:
        return _fleet.run(args)
    try:
        return asyncio.run(_run(args))
    except TimeoutError as exc:
        print(f"events benchmark: {exc}", file=sys.stderr)
        return {"benchmark": NAME, "ok": False, "error": str(exc)}
