"""Test doubles for the agent tests: an engine KV-event publisher speaking real vLLM/SGLang
frames (ZMQ PUB + replay ROUTER), a small engine prefix cache that produces realistic
events, and polling helpers (no sleeps standing in for synchronisation).

Frames are built here from the field orders in reference/engines.md, independently of the
agent's decoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from gateway.routing.keys import BlockKeyer
from loadtest.harness import free_ports

END_SEQ = b"\xff" * 8


async def wait_until(
    cond: Callable[[], bool | Awaitable[bool]], within: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``cond`` until true; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        got = cond()
        if asyncio.iscoroutine(got) or isinstance(got, Awaitable):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.01)


# -- event encodings per engine version -------------------------------------------------------


@dataclass(frozen=True)
class Flavor:
    name: str
    engine: str  # "vllm" | "sglang"
    maps: bool  # tagged maps (True) or tagged arrays
    replay_topic: bool  # replay replies carry the topic frame
    coalesce: bool  # one BlockStored for a run of blocks (vLLM, SGLang ≥0.5.23)
    signed: bool  # hashes as signed int64 (SGLang)


FLAVORS = {
    f.name: f
    for f in [
        Flavor("vllm-0.23", "vllm", maps=False, replay_topic=False, coalesce=True, signed=False),
        Flavor("vllm-0.33", "vllm", maps=True, replay_topic=True, coalesce=True, signed=False),
        Flavor(
            "sglang-0.5.15", "sglang", maps=False, replay_topic=False, coalesce=False, signed=True
        ),
        Flavor("sglang-0.5.23", "sglang", maps=True, replay_topic=True, coalesce=True, signed=True),
    ]
}


def stored_event(
    flavor: Flavor,
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    block_size: int,
    medium: str | None = "GPU",
    **extra: Any,
) -> Any:
    """A BlockStored as the engine version encodes it."""
    if flavor.engine == "vllm":
        fields: dict[str, Any] = {
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "extra_keys": [None] * len(hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
            "kv_cache_spec_sliding_window": None,
        }
        if flavor.maps:  # 0.33: defaults omitted, new fields appended
            fields.update(locality=None, ownership=None, session_id=None)
            fields.update(extra)
            return {
                "type": "BlockStored",
                **{k: v for k, v in fields.items() if v is not None or k in _VLLM_ALWAYS},
            }
        fields.update(extra)
        return ["BlockStored", *fields.values()]
    # SGLang
    fields = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
    }
    if flavor.maps:  # 0.5.23: cache_salt, session_id, lora_name appended; defaults omitted
        fields.update(cache_salt=None, session_id=None, lora_name=None)
        fields.update(extra)
        always = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"}
        return {
            "type": "BlockStored",
            **{k: v for k, v in fields.items() if v is not None or k in always},
        }
    fields.update(extra)
    return ["BlockStored", *fields.values()]


_VLLM_ALWAYS = {
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
}


def removed_event(flavor: Flavor, hashes: list[Any], medium: str | None = "GPU") -> Any:
    if flavor.engine == "vllm":
        if flavor.maps:
            return {
                "type": "BlockRemoved",
                "block_hashes": hashes,
                "medium": medium,
                "group_idx": 0,
            }
        return ["BlockRemoved", hashes, medium, 0]
    if flavor.maps:
        ev = {"type": "BlockRemoved", "block_hashes": hashes}
        if medium is not None:
            ev["medium"] = medium
        return ev
    return ["BlockRemoved", hashes, medium]


def cleared_event(flavor: Flavor) -> Any:
    return {"type": "AllBlocksCleared"} if flavor.maps else ["AllBlocksCleared"]


def batch_payload(events: list[Any], rank: int | None = 0, ts: float | None = None) -> bytes:
    return msgspec.msgpack.encode([time.time() if ts is None else ts, events, rank])


# -- engine hashing (what the engines do, simplified but chained like them) -----------------


def engine_hash(flavor: Flavor, parent: Any, tokens: list[int], as_bytes: bool = False) -> Any:
    h = hashlib.sha256(repr((parent, tuple(tokens))).encode()).digest()
    if as_bytes:
        return h
    if flavor.signed:  # SGLang: first 8 bytes, signed
        return int.from_bytes(h[:8], "big", signed=True)
    return int.from_bytes(h[-8:], "big")  # vLLM: last 8 bytes, unsigned


# -- a fake engine: publisher + replay + a prefix cache -----------------------------------


@dataclass
class _Held:
    parent: Any
    tokens: list[int]
    children: set[Any] = field(default_factory=set)


class FakeEngine:
    """An engine's KV-event side on loopback, with a prefix cache producing the events."""

    def __init__(
        self,
        flavor: str = "vllm-0.33",
        block_size: int = 16,
        replay: bool = True,
        buffer_steps: int = 10_000,
        topic: str = "",
        rank: int = 0,
        ports: tuple[int, int] | None = None,
        bytes_hashes: bool = False,
        seed: int = 0,
    ) -> None:
        self.flavor = FLAVORS[flavor]
        self.block_size = block_size
        self.topic = topic
        self.rank = rank
        self.bytes_hashes = bytes_hashes
        self.pub_port, self.replay_port = ports or tuple(free_ports(2))  # type: ignore[assignment]
        self.replay_enabled = replay
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.rng = random.Random(seed)
        self.held: dict[Any, _Held] = {}
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 1_000_000)
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    @property
    def events_url(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_url(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self.ctx.destroy(linger=0)

    # -- raw publishing ---------------------------------------------------------------------

    async def publish(self, events: list[Any], send: bool = True) -> int:
        """Publish one batch; ``send=False`` buffers it for replay only (a lost message)."""
        return await self.publish_payload(batch_payload(events, self.rank), send)

    async def publish_payload(self, payload: bytes, send: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """Engine restart: sequence from 0, empty cache and replay buffer."""
        self.seq = 0
        self.buffer.clear()
        self.held.clear()

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            topic = [self.topic.encode()] if self.flavor.replay_topic else []
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart(
                        [ident, b"", *topic, seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([ident, b"", *topic, END_SEQ, b""])

    # -- the prefix cache -------------------------------------------------------------------

    def hash_of(self, parent: Any, tokens: list[int]) -> Any:
        return engine_hash(self.flavor, parent, tokens, self.bytes_hashes)

    def store_events(self, tokens: list[int]) -> list[Any]:
        """Cache the full blocks of ``tokens``; events for the blocks that are new."""
        bs = self.block_size
        parent = None
        new: list[tuple[Any, list[int]]] = []
        first_parent: Any = None
        for b in range(len(tokens) // bs):
            blk = tokens[b * bs : (b + 1) * bs]
            h = self.hash_of(parent, blk)
            if h not in self.held:
                if not new:
                    first_parent = parent
                self.held[h] = _Held(parent, blk)
                if parent is not None:
                    self.held[parent].children.add(h)
                new.append((h, blk))
            elif new:  # a held block after a new one cannot happen with prefix caching
                break
            parent = h
        if not new:
            return []
        f = self.flavor
        if f.coalesce:
            return [
                stored_event(
                    f, [h for h, _ in new], first_parent, [t for _, b in new for t in b], bs
                )
            ]
        out = []
        prev = first_parent
        for h, blk in new:
            out.append(stored_event(f, [h], prev, blk, bs))
            prev = h
        return out

    def evict_events(self, n: int) -> list[Any]:
        """Evict ``n`` leaf blocks (what LRU over unreferenced leaves does)."""
        removed: list[Any] = []
        for _ in range(n):
            leaves = [h for h, b in self.held.items() if not b.children]
            if not leaves:
                break
            h = self.rng.choice(sorted(leaves, key=repr))
            blk = self.held.pop(h)
            if blk.parent is not None and blk.parent in self.held:
                self.held[blk.parent].children.discard(h)
            removed.append(h)
        if not removed:
            return []
        if self.flavor.engine == "vllm":  # one event per hash
            return [removed_event(self.flavor, [h]) for h in removed]
        return [removed_event(self.flavor, removed)]

    def clear_events(self) -> list[Any]:
        self.held.clear()
        return [cleared_event(self.flavor)]

    def expected_keys(self, keyer: BlockKeyer) -> set[int]:
        """Canonical keys of everything cached (ancestors are always held here)."""
        out: set[int] = set()
        for h in self.held:
            toks: list[int] = []
            cur: Any = h
            while cur is not None:
                b = self.held[cur]
                toks[:0] = b.tokens
                cur = b.parent
            out.update(keyer.keys(toks))
        return out

    def random_tokens(self, prefixes: list[list[int]], max_blocks: int = 12) -> list[int]:
        """A request: maybe a known prefix plus new tokens (shared-prefix traffic)."""
        rng = self.rng
        base: list[int] = []
        if prefixes and rng.random() < 0.7:
            p = rng.choice(prefixes)
            base = p[: rng.randint(0, len(p))]
        extra = rng.randint(1, max_blocks * self.block_size)
        return base + [rng.randrange(1, 50_000) for _ in range(extra)]


# -- running the real agent and consumer in-process ------------------------------------------

AGENT_SEED = "test-seed"


def agent_config(engine: FakeEngine | None, worker: str = "w1", **overrides: Any) -> Any:
    from worker_agent.config import AgentConfig, EngineConfig
    from worker_agent.publisher import PublisherSettings

    eng = EngineConfig(
        kind=engine.flavor.engine if engine else "vllm",  # type: ignore[arg-type]
        url=overrides.pop("engine_url", "http://127.0.0.1:9"),
        events=engine.events_url if engine else None,
        replay=engine.replay_url if engine and engine.replay_enabled else None,
        replay_timeout=0.5,
        topic=engine.topic if engine else "",
        discovery_timeout=5,
    )
    publish = PublisherSettings(
        snapshot_interval=overrides.pop("snapshot_interval", 0.5),
        max_buffer_events=overrides.pop("max_buffer_events", 200_000),
        backoff_max=0.2,
    )
    return AgentConfig(
        worker_id=worker,
        model="m",
        hash_seed=AGENT_SEED,
        heartbeat_interval=0.2,
        registration_ttl=1.0,
        report_interval=0.1,
        engine=eng,
        publish=publish,
        **overrides,
    )


@contextlib.asynccontextmanager
async def running_agent(config: Any, redis_url: str, **bus_opts: Any) -> Any:
    """An ``Agent`` on a ``RedisBus``, run until the block exits (graceful stop).
    ``bus_opts`` go to ``RedisBus`` (``cluster=True``, ``sentinels=...``)."""
    from gateway.contract.redis_bus import RedisBus
    from worker_agent.agent import Agent

    bus = RedisBus(redis_url, socket_timeout=1.0, connect_timeout=0.5, **bus_opts)
    agent = Agent(config, bus)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await wait_until(lambda: agent.ready.is_set() or task.done(), 10, "agent ready")
        if task.done():
            task.result()
        yield agent
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 10)
        finally:
            await bus.close()


@contextlib.asynccontextmanager
async def running_consumer(redis_url: str, **bus_opts: Any) -> Any:
    from gateway.consumer import Consumer, ConsumerConfig
    from gateway.contract.redis_bus import RedisBus

    bus = RedisBus(redis_url, socket_timeout=1.0, connect_timeout=0.5, **bus_opts)
    config = ConsumerConfig(block_ms=50, poll_interval=0.05, snapshot_retry=0.1, expiry_grace=1.5)
    consumer = Consumer(bus, config=config)
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()
        await bus.close()


async def settle(consumer: Any, agents: list[Any], within: float = 10.0) -> None:
    """Until the consumer applied everything each agent published and its index equals
    every agent's mirror (every cache domain's: one per data-parallel rank)."""

    def caught_up(a: Any, wid: str, pub: Any, keys: frozenset[int]) -> bool:
        cur = consumer.applier.cursors.get(wid)
        return (
            pub.idle.is_set()
            and cur is not None
            and cur.epoch == a.epoch
            and cur.seq == pub.seq
            and consumer.index.worker_keys(wid) == keys
        )

    def all_caught_up() -> bool:
        for a in agents:
            domains = a.domains or []
            if not domains and not caught_up(a, a.config.worker_id, a.publisher, a.mirror_keys()):
                return False
            for d in domains:
                if not caught_up(a, d.worker_id, d.publisher, d.pipeline.mirror.keys()):
                    return False
        return True

    await wait_until(all_caught_up, within, "consumer == mirrors")


async def drive(engine: FakeEngine, steps: int, evict: float = 0.3, batch: int = 3) -> None:
    """Random requests and evictions on ``engine``, published as engine batches."""
    prefixes: list[list[int]] = []
    for _ in range(steps):
        events: list[Any] = []
        for _ in range(batch):
            if engine.held and engine.rng.random() < evict:
                events += engine.evict_events(engine.rng.randint(1, 4))
            else:
                toks = engine.random_tokens(prefixes)
                prefixes.append(toks)
                if len(prefixes) > 20:
                    prefixes.pop(0)
                events += engine.store_events(toks)
        await engine.publish(events)


async def join(engine: FakeEngine, agent: Any) -> None:
    """Publish empty batches until the agent's SUB socket gets one (the ZMQ slow joiner)."""
    seen = agent.metrics.value("frames_received_total")

    async def probe() -> bool:
        await engine.publish([])
        return bool(agent.metrics.value("frames_received_total") > seen)

    await wait_until(probe, 10, "subscriber joined")
