"""One simulated GPU worker: the engine core driven in real time, its HTTP API, its KV events.

The driver loop runs a core step, sleeps until the step's end on the event loop's clock,
then delivers what the step produced: tokens to waiting HTTP handlers, one batch of KV
events to the publisher. Faults (kill, restart, pause, slow down, drop event batches,
refuse connections) act on this object, from Python or from ``POST /sim/fault``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio
from aiohttp import web

from loadtest.enginesim.config import SimConfig
from loadtest.enginesim.events import EventEncoder, WireFormat
from loadtest.enginesim.metrics import EngineMetrics
from loadtest.enginesim.publisher import EventPublisher
from loadtest.enginesim.scheduler import EngineCore, SimRequest, StepResult
from loadtest.enginesim.server import build_app
from loadtest.enginesim.text import TextCodec
from loadtest.enginesim.timing import TimingModel, timing_model

__all__ = ["FAULT_ACTIONS", "FaultError", "Generation", "SimWorker"]

log = logging.getLogger(__name__)

FAULT_ACTIONS = (
    "kill", "restart", "pause", "resume", "slow", "drop_events", "refuse", "accept", "garbage",
)  # fmt: skip
#: what the ``garbage`` fault can put on the event socket (R5: counted and skipped)
GARBAGE_KINDS = ("bytes", "wrong_types", "unknown_fields", "unknown_parent", "huge", "frames")


class FaultError(ValueError):
    """Unknown fault action or bad parameters."""


@dataclass(eq=False)
class Generation:
    """A request's progress, as the HTTP handler sees it."""

    req: SimRequest
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


class SimWorker:
    """A simulated engine on its own ports (see ``SimConfig`` for the port layout)."""

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
        self._events_port = events_port
        self._replay_port = replay_port
        self._base_timing = timing_model(config.timing.preset, config.timing.speedup)
        self.alive = False
        self.paused = False
        self.slowdown = 1.0
        self.started_at = 0.0
        self.core = self._new_core(self._base_timing)
        self.metrics = EngineMetrics(config.flavor, config.model, lambda: self.core)
        self.publisher: EventPublisher | None = None
        self._encoder: EventEncoder | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._driver: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._active: dict[int, Generation] = {}
        self._streaming: dict[int, Generation] = {}
        self._cleanups: set[asyncio.Task[None]] = set()

    # -- addresses -------------------------------------------------------------------------

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.http_port}"

    @property
    def events_endpoint(self) -> str | None:
        return None if self.publisher is None else self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.publisher is None else self.publisher.replay_endpoint

    @property
    def busy(self) -> bool:
        return self.core.has_work()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> SimWorker:
        """Serve with a fresh engine: empty cache, event sequence from 0."""
        cfg = self.config
        self.core = self._new_core(self._timing())
        self.metrics = EngineMetrics(cfg.flavor, cfg.model, lambda: self.core)
        try:
            await self._open_io()
        except BaseException:
            await self._close_io(spare=None)  # a port in use: release what did open
            raise
        self.paused = False
        self.alive = True
        self.started_at = time.time()
        self._driver = asyncio.create_task(self._drive(), name=f"sim-worker-{self.index}")
        return self

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

    def pause(self) -> None:
        """Stop stepping (requests hang; HTTP still answers)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def slow_down(self, factor: float) -> None:
        """Make every step ``factor`` times longer (1 restores the configured speed)."""
        if not factor > 0:
            raise FaultError(f"slow factor must be > 0, got {factor}")
        self.slowdown = factor
        self.core.timing = self._timing()

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

    def drop_event_batches(self, n: int) -> None:
        """Do not send the next ``n`` event batches live (replay still has them)."""
        if n < 0:
            raise FaultError(f"count must be >= 0, got {n}")
        if self.publisher is not None:
            self.publisher.drop_next(n)

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
        elif action == "pause":
            self.pause()
        elif action == "resume":
            self.resume()
        elif action == "slow":
            self.slow_down(_number(params, "factor", float))
        elif action == "drop_events":
            self.drop_event_batches(_number(params, "count", int))
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
        core, pub = self.core, self.publisher
        return {
            "worker": self.index,
            "alive": self.alive,
            "paused": self.paused,
            "slowdown": self.slowdown,
            "accepting": self._site is not None,
            "http_url": self.http_url,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "next_seq": None if pub is None else pub.next_seq,
            "replays_served": None if pub is None else pub.replays_served,
            "event_format": None if self._encoder is None else self._encoder.fmt.version,
            "running": core.num_running,
            "waiting": core.num_waiting,
            "kv_usage": core.kv_usage,
            "cached_blocks": core.cache.cached_blocks,
            "free_blocks": core.allocator.num_free,
            "stats": vars(core.stats),
        }

    # -- generation ------------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int] | bytes,
        max_tokens: int,
        *,
        stream: bool,
        lora: str | None = None,
    ) -> Generation:
        """Queue a request, for LoRA adapter ``lora`` if given (raises
        ValueError/RequestTooLarge on malformed input)."""
        if not self.alive:
            raise RuntimeError("worker is not running")
        loop = asyncio.get_running_loop()
        req = self.core.add_request(prompt, max_tokens, loop.time(), lora=lora)
        gen = Generation(req)
        req.tag = gen
        self._active[req.rid] = gen
        if stream:
            self._streaming[req.rid] = gen
        self._wake.set()
        return gen

    def abort(self, gen: Generation) -> None:
        """The client went away before the end."""
        if self._active.pop(gen.req.rid, None) is gen:
            self._streaming.pop(gen.req.rid, None)
            self.core.abort(gen.req, asyncio.get_running_loop().time())

    async def publish_pending_events(self) -> None:
        """Send cache events produced outside a step (a cache reset) right away."""
        events = self.core.take_events()
        if events and self._encoder is not None and self.publisher is not None:
            await self.publisher.publish(self._encoder.encode(events, time.time()))

    # -- internals -------------------------------------------------------------------------

    def _new_core(self, timing: TimingModel) -> EngineCore:
        cfg = self.config
        return EngineCore(
            cfg.cache,
            cfg.scheduler,
            timing,
            evict_whole_nodes=cfg.evict_whole_nodes,
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

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        while True:
            if self.paused or not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            res = core.step(loop.time())
            if not res.steps:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = res.end - loop.time()
            await asyncio.sleep(max(0.0, delay))
            await self._deliver(res)

    async def _deliver(self, res: StepResult) -> None:
        metrics = self.metrics
        for req in res.first_token:
            metrics.first_token(req)
        for req in res.finished:
            metrics.finished(req)
            gen = self._active.pop(req.rid, None)
            self._streaming.pop(req.rid, None)
            if gen is not None:
                gen.produced = req.num_output
                gen.finished = True
                gen._notify()
        core = self.core
        for gen in self._streaming.values():
            n = core.output_len(gen.req)
            if n != gen.produced:
                gen.produced = n
                gen._notify()
        if res.events and self._encoder is not None and self.publisher is not None:
            await self.publisher.publish(self._encoder.encode(res.events, time.time()))

    async def _open_io(self) -> None:
        """Bind the event sockets (when events are on) and the HTTP listener."""
        cfg = self.config
        if cfg.events.enabled:
            ev = cfg.events
            fmt = WireFormat.for_sim(cfg)
            self._encoder = EventEncoder(fmt)
            self.publisher = EventPublisher(
                self._zmq,
                cfg.host,
                self._events_port,
                self._replay_port,
                topic=ev.topic,
                buffer_steps=ev.buffer_steps,
                hwm=ev.hwm,
                replay_topic_frame=ev.replay_topic_frame,
                replay_queue_bound=ev.replay_queue_bound,
            )
            await self.publisher.start()
            self._events_port = self.publisher.port
            self._replay_port = self.publisher.replay_port or 0
        self._runner = web.AppRunner(
            build_app(self), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        await self._listen()

    async def _close_io(self, spare: Any) -> None:
        """Stop listening, reset connections (all but ``spare``), close the event sockets."""
        await self.refuse_connections()
        runner, self._runner = self._runner, None
        if runner is not None:
            _abort_connections(runner, spare)
            task = asyncio.create_task(runner.cleanup())
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None

    async def _die(self, spare: Any) -> None:
        if not self.alive:
            return
        self.alive = False
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        for gen in self._active.values():
            gen.error = "the engine died"
            gen._notify()
        self._active.clear()
        self._streaming.clear()
        await self._close_io(spare)


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
