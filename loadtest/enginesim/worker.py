"""One simulated GPU worker: the engine core driven in real time, its HTTP API, its KV events.

The driver loop runs a core step, sleeps until the step's end on the event loop's clock,
then delivers what the step produced: tokens to waiting HTTP handlers, one batch of KV
events to the publisher. Faults (kill, restart, pause, slow down, drop event batches,
refuse connections) act on this object, from Python or from ``POST /sim/fault``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio
from aiohttp import web

from loadtest.enginesim.api import UnknownRank
from loadtest.enginesim.config import SimConfig
from loadtest.enginesim.disagg import Transfers
from loadtest.enginesim.events import EventEncoder, WireFormat
from loadtest.enginesim.metrics import EngineMetrics
from loadtest.enginesim.publisher import EventPublisher
from loadtest.enginesim.scheduler import EngineCore, SimRequest, StepResult
from loadtest.enginesim.server import build_app
from loadtest.enginesim.text import TextCodec
from loadtest.enginesim.timing import TimingModel, timing_model

__all__ = ["FAULT_ACTIONS", "FaultError", "Generation", "SimRank", "SimWorker", "UnknownRank"]

log = logging.getLogger(__name__)

FAULT_ACTIONS = (
    "kill", "restart", "restart_rank", "pause", "resume", "slow", "drop_events", "refuse",
    "accept", "garbage", "drop_transfers",
)  # fmt: skip
#: what the ``garbage`` fault can put on the event socket (R5: counted and skipped)
#: attempts at finding consecutive free ports for an SGLang worker's rank publishers
_CONTIGUOUS_TRIES = 20
GARBAGE_KINDS = ("bytes", "wrong_types", "unknown_fields", "unknown_parent", "huge", "frames")


class FaultError(ValueError):
    """Unknown fault action or bad parameters."""


@dataclass(eq=False)
class Generation:
    """A request's progress, as the HTTP handler sees it."""

    req: SimRequest
    rank: SimRank
    produced: int = 0  # tokens generated so far
    finished: bool = False
    error: str | None = None  # set when the engine died under the request
    _event: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    async def wait(self) -> None:
        """Until something new happened (tokens, the end, or an error)."""
        await self._event.wait()
        self._event.clear()

    def _notify(self) -> None:
        self._event.set()


@dataclass(eq=False)
class SimRank:
    """One data-parallel rank: its own engine core (scheduler + prefix cache), its own event
    publisher (port + rank, sequence from 0, as vLLM's and SGLang's per-rank publishers) and
    its own driver loop. Ranks of a worker share its HTTP server."""

    index: int
    core: EngineCore
    events_port: int = 0
    replay_port: int = 0
    publisher: EventPublisher | None = None
    encoder: EventEncoder | None = None
    driver: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: held by the driver from a step to its delivery: a cache reset waits for it, as vLLM
    #: runs one between engine steps (see ``SimWorker.reset_prefix_cache``)
    stepping: asyncio.Lock = field(default_factory=asyncio.Lock)
    active: dict[int, Generation] = field(default_factory=dict)
    streaming: dict[int, Generation] = field(default_factory=dict)
    #: engine seconds lost to the host: from a step's end to the next step's start while
    #: the engine had work (a GPU would have started it at once; here the event loop was
    #: late, busy with other workers' streams or starved of CPU by other processes)
    lag: float = 0.0

    @property
    def load(self) -> int:
        """vLLM's data-parallel balancer score: waiting weighs four times running."""
        return 4 * self.core.num_waiting + self.core.num_running


class SimWorker:
    """A simulated engine on its own ports (see ``SimConfig`` for the port layout), with
    ``config.dp_size`` data-parallel ranks (``SimRank``)."""

    def __init__(
        self,
        index: int,
        config: SimConfig,
        codec: TextCodec,
        zmq_ctx: zmq.asyncio.Context,
        *,
        http_port: int = 0,
        events_port: int = 0,
        replay_port: int = 0,
    ) -> None:
        self.index = index
        self.config = config
        self.codec = codec
        self._zmq = zmq_ctx
        self.http_port = http_port
        self._base_timing = timing_model(
            config.timing.preset, config.timing.speedup, config.timing.attention
        )
        self.alive = False
        self.paused = False
        self.slowdown = 1.0
        self.started_at = 0.0
        dp = config.dp_size
        self.ranks = [
            SimRank(
                r,
                self._new_core(self._base_timing),
                events_port + r if events_port else 0,
                replay_port + r if replay_port else 0,
            )
            for r in range(dp)
        ]
        self.metrics = EngineMetrics(config.flavor, config.model, self.cores, dp)
        self.transfers = Transfers()  # prefill role: KV ready for decode engines to pull
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._cleanups: set[asyncio.Task[None]] = set()

    # -- addresses -------------------------------------------------------------------------

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.http_port}"

    @property
    def core(self) -> EngineCore:
        """Rank 0's engine core (the only one unless ``dp_size`` > 1)."""
        return self.ranks[0].core

    @property
    def publisher(self) -> EventPublisher | None:
        """Rank 0's event publisher."""
        return self.ranks[0].publisher

    def cores(self) -> list[EngineCore]:
        return [r.core for r in self.ranks]

    @property
    def events_endpoint(self) -> str | None:
        return None if self.publisher is None else self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.publisher is None else self.publisher.replay_endpoint

    @property
    def busy(self) -> bool:
        return any(r.core.has_work() for r in self.ranks)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> SimWorker:
        """Serve with a fresh engine: empty cache, event sequence from 0."""
        cfg = self.config
        for rank in self.ranks:
            rank.core = self._new_core(self._timing())
        self.metrics = EngineMetrics(cfg.flavor, cfg.model, self.cores, cfg.dp_size)
        try:
            await self._open_io()
        except BaseException:
            await self._close_io(spare=None)  # a port in use: release what did open
            raise
        self.paused = False
        self.alive = True
        self.started_at = time.time()
        for rank in self.ranks:
            self._start_driver(rank)
        return self

    def _start_driver(self, rank: SimRank) -> None:
        rank.driver = asyncio.create_task(
            self._drive(rank), name=f"sim-worker-{self.index}-dp{rank.index}"
        )
        rank.driver.add_done_callback(_driver_died)

    async def stop(self) -> None:
        """Shut down cleanly (end of a test or of the process)."""
        await self._die(spare=None)
        for task in list(self._cleanups):
            await task

    # -- faults ----------------------------------------------------------------------------

    async def kill(self, spare: Any = None) -> None:
        """Die: connections refused, open ones reset, no more events; until ``restart``."""
        await self._die(spare)

    async def restart(self, spare: Any = None) -> None:
        """Die if alive, then come back with an empty cache and event sequence 0."""
        await self._die(spare)
        await self.start()

    async def restart_rank(self, index: int) -> None:
        """Restart one data-parallel rank's engine core: its cache empties and its event
        sequence starts again from 0 (a new publisher); the other ranks carry on."""
        if not self.alive:
            raise FaultError("the worker is not running")
        if not 0 <= index < len(self.ranks):
            raise FaultError(f"rank {index} is out of range [0, {len(self.ranks)})")
        rank = self.ranks[index]
        if rank.driver is not None:
            rank.driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rank.driver
        self._fail_all(rank, "the engine core died")
        if rank.publisher is not None:
            await rank.publisher.close()
            rank.publisher = None
        rank.core = self._new_core(self._timing())
        await self._open_events(rank)
        self._start_driver(rank)

    def pause(self) -> None:
        """Stop stepping (requests hang; HTTP still answers)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        for rank in self.ranks:
            rank.wake.set()

    def slow_down(self, factor: float) -> None:
        """Make every step ``factor`` times longer (1 restores the configured speed)."""
        if not factor > 0:
            raise FaultError(f"slow factor must be > 0, got {factor}")
        self.slowdown = factor
        for rank in self.ranks:
            rank.core.timing = self._timing()

    async def publish_garbage(self, kind: str) -> None:
        """Put a malformed batch on the event socket, as a broken or hostile engine would.

        ``bytes``: not msgpack; ``wrong_types``: fields of the wrong type; ``unknown_fields``:
        extra keys on an otherwise valid removal of an unknown block; ``unknown_parent``: a
        store whose parent was never stored; ``huge``: more events than any decoder should
        accept; ``frames``: a message with the wrong number of frames. All but ``frames``
        take a sequence number, as a real engine's batch would.
        """
        import msgspec

        pub = self.publisher
        if pub is None:
            raise FaultError("this worker publishes no events")
        enc = msgspec.msgpack.encode
        bs = self.config.cache.block_size
        payloads = {
            "bytes": b"\xc1\xff not msgpack \x00" * 8,
            "wrong_types": enc(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": "nope",
                            "parent_block_hash": {},
                            "token_ids": "x",
                            "block_size": "16",
                        }
                    ],
                    0,
                ]
            ),
            "unknown_fields": enc(
                [
                    1.0,
                    [
                        {
                            "type": "BlockRemoved",
                            "block_hashes": [12345],
                            "medium": "GPU",
                            "future_field": [1, 2],
                            "x": {"y": 1},
                        }
                    ],
                    0,
                ]
            ),
            "unknown_parent": enc(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [987654321],
                            "parent_block_hash": 111222333,
                            "token_ids": list(range(bs)),
                            "block_size": bs,
                            "lora_id": None,
                            "medium": "GPU",
                            "lora_name": None,
                        }
                    ],
                    0,
                ]
            ),
            "huge": enc([1.0, [{"type": "AllBlocksCleared"}] * 200_000, 0]),
        }
        if kind == "frames":
            await pub.publish_raw([b"only-two", b"frames"])
        elif kind in payloads:
            await pub.publish(payloads[kind])
        else:
            raise FaultError(f"unknown garbage kind {kind!r}; known: {', '.join(GARBAGE_KINDS)}")

    def drop_event_batches(self, n: int, rank: int = 0) -> None:
        """Do not send rank ``rank``'s next ``n`` event batches live (replay still has them)."""
        if n < 0:
            raise FaultError(f"count must be >= 0, got {n}")
        if not 0 <= rank < len(self.ranks):
            raise FaultError(f"rank {rank} is out of range [0, {len(self.ranks)})")
        pub = self.ranks[rank].publisher
        if pub is not None:
            pub.drop_next(n)

    async def refuse_connections(self) -> None:
        """Close the listening socket: new connections are refused, open ones go on."""
        if self._site is not None:
            await self._site.stop()
            self._site = None

    async def accept_connections(self) -> None:
        if self.alive and self._site is None:
            await self._listen()

    async def fault(self, action: str, spare: Any = None, **params: Any) -> dict[str, Any]:
        """Apply a fault by name (the admin endpoint's entry point)."""
        if action == "kill":
            await self.kill(spare)
        elif action == "restart":
            await self.restart(spare)
        elif action == "drop_transfers":
            if self.config.pd.role != "prefill":
                raise FaultError("drop_transfers needs a prefill worker (pd.role: prefill)")
            self.transfers.drop_next = _number(params, "count", int)
        elif action == "restart_rank":
            await self.restart_rank(_number(params, "rank", int))
        elif action == "pause":
            self.pause()
        elif action == "resume":
            self.resume()
        elif action == "slow":
            self.slow_down(_number(params, "factor", float))
        elif action == "drop_events":
            rank = _number(params, "rank", int) if "rank" in params else 0
            self.drop_event_batches(_number(params, "count", int), rank)
        elif action == "refuse":
            await self.refuse_connections()
        elif action == "garbage":
            await self.publish_garbage(str(params.get("kind", "bytes")))
        elif action == "accept":
            await self.accept_connections()
        else:
            raise FaultError(f"unknown fault action {action!r}; known: {', '.join(FAULT_ACTIONS)}")
        return self.state()

    def state(self) -> dict[str, Any]:
        """What the admin endpoints report about this worker."""
        core, pub, enc = self.core, self.publisher, self.ranks[0].encoder
        return {
            "worker": self.index,
            "alive": self.alive,
            "paused": self.paused,
            "slowdown": self.slowdown,
            "step_lag_s": round(sum(r.lag for r in self.ranks), 4),
            "accepting": self._site is not None,
            "http_url": self.http_url,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "next_seq": None if pub is None else pub.next_seq,
            "replays_served": None if pub is None else pub.replays_served,
            "event_format": None if enc is None else enc.fmt.version,
            "running": core.num_running,
            "waiting": core.num_waiting,
            "kv_usage": core.kv_usage,
            "cached_blocks": core.cache.cached_blocks,
            "free_blocks": core.allocator.num_free,
            "stats": dataclasses.asdict(core.stats),
            "dp_size": len(self.ranks),
            "pd": {
                "role": self.config.pd.role,
                "transfers_dropped": self.transfers.dropped,
            },
            "ranks": [
                {
                    "rank": r.index,
                    "events_endpoint": None if r.publisher is None else r.publisher.endpoint,
                    "next_seq": None if r.publisher is None else r.publisher.next_seq,
                    "running": r.core.num_running,
                    "waiting": r.core.num_waiting,
                    "cached_blocks": r.core.cache.cached_blocks,
                    "stats": dataclasses.asdict(r.core.stats),
                }
                for r in self.ranks
            ],
        }

    # -- generation ------------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int] | bytes,
        max_tokens: int,
        *,
        stream: bool,
        rank: int | None = None,
        remote: bool = False,
        lora: str | None = None,
    ) -> Generation:
        """Queue a request on rank ``rank``, or on the least loaded rank as the engine's own
        balancer would, for LoRA adapter ``lora`` if given (raises ValueError/
        RequestTooLarge on malformed input, UnknownRank)."""
        if not self.alive:
            raise RuntimeError("worker is not running")
        target = self._rank_for(rank)
        loop = asyncio.get_running_loop()
        req = target.core.add_request(prompt, max_tokens, loop.time(), remote=remote, lora=lora)
        gen = Generation(req, target)
        req.tag = gen
        target.active[req.rid] = gen
        if stream:
            target.streaming[req.rid] = gen
        target.wake.set()
        return gen

    def _rank_for(self, rank: int | None) -> SimRank:
        ranks = self.ranks
        if rank is None:
            return min(ranks, key=lambda r: (r.load, r.index))
        if not 0 <= rank < len(ranks):
            raise UnknownRank(f"data_parallel_rank {rank} is out of range [0, {len(ranks)})")
        return ranks[rank]

    def abort(self, gen: Generation) -> None:
        """The client went away before the end."""
        rank = gen.rank
        if rank.active.pop(gen.req.rid, None) is gen:
            rank.streaming.pop(gen.req.rid, None)
            rank.core.abort(gen.req, asyncio.get_running_loop().time())

    async def reset_prefix_cache(self) -> bool:
        """Every rank's prefix cache (vLLM's and SGLang's resets are engine-wide), each
        between two of its steps, its ``AllBlocksCleared`` published at once.

        A rank's driver computes a step, sleeps for the step's duration, then publishes the
        step's events. A reset in that sleep (the step had finished the last request, so
        nothing ran) published its clear first, and the step's stores and removals after
        it, naming blocks the clear had dropped: the encoder's lookup failed, which killed
        the driver, and the worker never stepped again (every later request to it hung)."""
        ok = True
        for rank in self.ranks:
            async with rank.stepping:
                ok = rank.core.reset_prefix_cache() and ok
                events = rank.core.take_events()
                if events and rank.encoder is not None and rank.publisher is not None:
                    await rank.publisher.publish(rank.encoder.encode(events, time.time()))
        return ok

    # -- internals -------------------------------------------------------------------------

    def _new_core(self, timing: TimingModel) -> EngineCore:
        cfg = self.config
        return EngineCore(
            cfg.cache,
            cfg.scheduler,
            timing,
            evict_whole_nodes=cfg.evict_whole_nodes,
            commit_on_schedule=cfg.flavor == "vllm",
            skip_lora_waits=cfg.flavor == "vllm",
            record_events=cfg.events.enabled,
            output_tokens=self.codec.output_ids,
            lora=cfg.lora,
        )

    def _timing(self) -> TimingModel:
        base = self._base_timing
        return base.scaled(base.speedup / self.slowdown)

    async def _listen(self) -> None:
        assert self._runner is not None
        site = web.TCPSite(self._runner, self.config.host, self.http_port, reuse_address=True)
        await site.start()
        self._site = site
        self.http_port = int(self._runner.addresses[0][1])

    async def _drive(self, rank: SimRank) -> None:
        loop = asyncio.get_running_loop()
        core = rank.core
        busy_since: float | None = None  # the last step's end, while work remained
        while True:
            if self.paused or not core.has_work():
                busy_since = None
                rank.wake.clear()
                await rank.wake.wait()
                continue
            async with rank.stepping:
                now = loop.time()
                if busy_since is not None:
                    rank.lag += max(0.0, now - busy_since)
                res = core.step(now)
                if res.steps:
                    await asyncio.sleep(max(0.0, res.end - loop.time()))
                    await self._deliver(rank, res)
                    busy_since = res.end
            if not res.steps:
                busy_since = None
                rank.wake.clear()
                await rank.wake.wait()

    async def _deliver(self, rank: SimRank, res: StepResult) -> None:
        metrics = self.metrics
        for req in res.first_token:
            metrics.first_token(req, rank.index)
        for req in res.finished:
            metrics.finished(req, rank.index)
            gen = rank.active.pop(req.rid, None)
            rank.streaming.pop(req.rid, None)
            if gen is not None:
                gen.produced = req.num_output
                gen.finished = True
                gen._notify()
        core = rank.core
        for gen in rank.streaming.values():
            n = core.output_len(gen.req)
            if n != gen.produced:
                gen.produced = n
                gen._notify()
        if res.events and rank.encoder is not None and rank.publisher is not None:
            await rank.publisher.publish(rank.encoder.encode(res.events, time.time()))

    async def _open_io(self) -> None:
        """Bind the event sockets (when events are on) and the HTTP listener."""
        if self.config.events.enabled:
            await self._open_rank_events()
        self._runner = web.AppRunner(
            build_app(self), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        await self._listen()

    async def _open_rank_events(self) -> None:
        """Every rank's publisher. SGLang advertises one port base (rank r at base + r), so
        its ranks need consecutive ports: with ephemeral ports, rank 0's port is the base and
        a taken neighbour means trying again from a new base."""
        ranks = self.ranks
        contiguous = self.config.flavor == "sglang" and len(ranks) > 1 and not ranks[0].events_port
        for _ in range(_CONTIGUOUS_TRIES if contiguous else 1):
            try:
                for rank in ranks:
                    await self._open_events(rank)
                    if contiguous and rank.index == 0:
                        assert rank.publisher is not None
                        base, rbase = rank.publisher.port, rank.publisher.replay_port or 0
                        for other in ranks[1:]:
                            other.events_port = base + other.index
                            other.replay_port = rbase + other.index if rbase else 0
                return
            except (OSError, zmq.ZMQError):
                if not contiguous:
                    raise
                for rank in ranks:
                    if rank.publisher is not None:
                        await rank.publisher.close()
                        rank.publisher = None
                    rank.events_port = rank.replay_port = 0
        raise OSError("no consecutive free ports for the ranks' event publishers")

    async def _open_events(self, rank: SimRank) -> None:
        cfg = self.config
        ev = cfg.events
        fmt = dataclasses.replace(WireFormat.for_sim(cfg), dp_rank=rank.index)
        rank.encoder = EventEncoder(fmt)
        rank.publisher = EventPublisher(
            self._zmq,
            cfg.host,
            rank.events_port,
            rank.replay_port,
            topic=ev.topic,
            buffer_steps=ev.buffer_steps,
            hwm=ev.hwm,
            replay_topic_frame=ev.replay_topic_frame,
            replay_queue_bound=ev.replay_queue_bound,
        )
        await rank.publisher.start()
        rank.events_port = rank.publisher.port
        rank.replay_port = rank.publisher.replay_port or 0

    async def _close_io(self, spare: Any) -> None:
        """Stop listening, reset connections (all but ``spare``), close the event sockets."""
        await self.refuse_connections()
        runner, self._runner = self._runner, None
        if runner is not None:
            _abort_connections(runner, spare)
            task = asyncio.create_task(runner.cleanup())
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
        for rank in self.ranks:
            if rank.publisher is not None:
                await rank.publisher.close()
                rank.publisher = None

    async def _die(self, spare: Any) -> None:
        if not self.alive:
            return
        self.alive = False
        for rank in self.ranks:
            if rank.driver is not None:
                rank.driver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await rank.driver
                rank.driver = None
            self._fail_all(rank, "the engine died")
        self.transfers.lose_all()
        await self._close_io(spare)

    @staticmethod
    def _fail_all(rank: SimRank, why: str) -> None:
        for gen in rank.active.values():
            gen.error = why
            gen._notify()
        rank.active.clear()
        rank.streaming.clear()


def _driver_died(task: asyncio.Task[None]) -> None:
    """A driver ends only when cancelled; an exception is a bug that stops the engine for
    good (its requests hang), so it is logged at once, not when ``stop`` awaits it."""
    if not task.cancelled() and task.exception() is not None:
        log.error("%s stopped: the engine no longer steps", task.get_name(),
                  exc_info=task.exception())  # fmt: skip


def _abort_connections(runner: web.AppRunner, spare: Any) -> None:
    """Reset every open connection but ``spare`` (the admin request that asked for this)."""
    server = runner.server
    if server is None:
        return
    for handler in server.connections:
        transport = handler.transport
        if transport is not None and transport is not spare:
            transport.abort()


def _number(params: dict[str, Any], name: str, kind: type[int] | type[float]) -> Any:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultError(f"{name} must be a number")
    if kind is int and not isinstance(value, int):
        raise FaultError(f"{name} must be an integer")
    return kind(value)
