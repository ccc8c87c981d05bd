"""The worker agent: wires engine subscribers → pipeline → publisher, and keeps the worker
registered and its load reported.

Start order makes the new epoch visible before the worker is (re)registered: the first
entry of an epoch is a clear, and the registration waits (briefly) for it to be written.
Every loop is supervised: an unexpected error is logged and the loop restarts, so the
agent keeps running whatever the engine or the bus does. Graceful stop (SIGTERM in the CLI)
flushes what is buffered and deregisters the worker.

An engine with several data-parallel ranks holds one prefix cache per rank. Each rank is
then published as a cache domain of its own (``Domain``): worker id ``<worker>.dp<r>``, its
own stream, epoch sequence, snapshot, registration (``WorkerInfo.dp_rank``) and load report,
so the gateway indexes, loads and routes each rank separately and pins requests to it; a
rank's restart clears that rank only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import zmq.asyncio
from aiohttp import web

from gateway.contract.bus import BusError, EventBus, wait_event
from gateway.contract.fingerprint import seed_fingerprint
from gateway.contract.wire import Cleared, EngineReport, WorkerInfo, key_digest
from gateway.routing.keys import BlockKeyer
from worker_agent.adapters import ServedAdapters
from worker_agent.antientropy import DigestingBus, digest_loop
from worker_agent.config import AgentConfig
from worker_agent.engines import adapter_for
from worker_agent.engines.base import (
    Discovery,
    DiscoveryError,
    EngineAdapter,
    EventSource,
    Samples,
    endpoint_for_rank,
    parse_metrics,
    rank_samples,
)
from worker_agent.metrics import AgentMetrics
from worker_agent.pipeline import EventPipeline
from worker_agent.publisher import Publisher
from worker_agent.subscriber import RankSubscriber

__all__ = ["Agent", "Domain", "rank_worker_id"]

log = logging.getLogger(__name__)


@dataclass
class _Capacity:
    tokens: int | None = None


def _parents_of(built: list[EventPipeline]) -> Callable[[], dict[int, int | None]]:
    """A publisher's snapshot source: the mirror of the pipeline it feeds, once built."""
    return lambda: built[0].mirror.parent if built else {}


def rank_worker_id(worker_id: str, rank: int) -> str:
    """The worker id under which data-parallel rank ``rank`` of ``worker_id`` is published."""
    return f"{worker_id}.dp{rank}"


@dataclass
class Domain:
    """One prefix cache this agent publishes: the whole engine, or one data-parallel rank
    (``rank`` set) of an engine with several."""

    worker_id: str
    rank: int | None
    publisher: Publisher
    pipeline: EventPipeline
    capacity: _Capacity
    digests: DigestingBus  # the publisher's bus: stamps the mirror's digest (anti-entropy)


class Agent:
    """One worker's agent. ``run(stop)`` until ``stop`` is set."""

    def __init__(
        self, config: AgentConfig, bus: EventBus, metrics: AgentMetrics | None = None
    ) -> None:
        config.validate()
        self.config = config
        self.bus = bus
        self.metrics = metrics or AgentMetrics()
        self.adapter: EngineAdapter = adapter_for(config.engine.kind)
        self.keyer = BlockKeyer(config.hash_seed, config.block_size)
        self.epoch = time.time_ns() // 1000  # microseconds: a later start has a larger epoch
        self._digests = DigestingBus(bus, self._parents)
        self.publisher = Publisher(
            self._digests, config.worker_id, self.epoch, self._parents, self.metrics, config.publish
        )
        self.pipeline: EventPipeline | None = None  # the first domain's
        self.domains: list[Domain] = []
        self.subscribers: list[RankSubscriber] = []
        self.ready = asyncio.Event()  # subscribed, initial replay done, first entry written
        self.engine_block_size: int | None = config.engine.block_size
        self.bootstrap_port: int | None = None  # discovered (SGLang /server_info)
        self._capacity = _Capacity()
        self.adapters = ServedAdapters(config.engine.url, config.model, config.adapters_interval)
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False  # loops end at their next iteration

    def mirror_keys(self, rank: int | None = None) -> frozenset[int]:
        """The canonical keys published for this worker, or for data-parallel rank ``rank``
        of it (what consumers must hold)."""
        for d in self.domains:
            if rank is None or d.rank == rank:
                return d.pipeline.mirror.keys()
        return frozenset()

    def _parents(self) -> dict[int, int | None]:
        return {} if self.pipeline is None else self.pipeline.mirror.parent

    def _build_domains(self, sources: list[EventSource]) -> None:
        """One domain for a one-rank engine (the agent's worker id), else one per rank."""
        cfg = self.config
        ranks = [s.rank for s in sources]
        for r in ranks if len(ranks) > 1 else [None]:
            built: list[EventPipeline] = []  # the snapshot source, once built
            if r is None:
                wid, pub, digests = cfg.worker_id, self.publisher, self._digests
            else:
                wid = rank_worker_id(cfg.worker_id, r)
                digests = DigestingBus(self.bus, _parents_of(built))
                pub = Publisher(
                    digests,
                    wid,
                    self.epoch,
                    _parents_of(built),
                    self.metrics,
                    cfg.publish,
                )
            pipeline = EventPipeline(
                self.keyer,
                pub.add,
                self.metrics,
                ranks=ranks if r is None else [r],
                gpu_media=self.adapter.gpu_media,
            )
            built.append(pipeline)
            self.domains.append(Domain(wid, r, pub, pipeline, _Capacity(), digests))
        self.pipeline = self.domains[0].pipeline
        self.publisher = self.domains[0].publisher

    def _domain_of(self, rank: int) -> Domain:
        return next((d for d in self.domains if d.rank in (None, rank)), self.domains[0])

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        ctx = zmq.asyncio.Context()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        tasks: list[asyncio.Task[None]] = []
        runner: web.AppRunner | None = None
        try:
            sources = await self._sources(stop)
            if sources is None:
                return
            self._build_domains(sources)
            for d in self.domains:
                first = sources[0].rank if d.rank is None else d.rank
                d.publisher.add([Cleared()], first, -1, time.time())
            self.subscribers = [
                RankSubscriber(
                    ctx,
                    s,
                    self._domain_of(s.rank).pipeline,
                    self.metrics,
                    cfg.engine.replay_timeout,
                )
                for s in sources
            ]
            for d in self.domains:
                tasks.append(self._spawn(f"publisher-{d.worker_id}", d.publisher.run))
            for sub in self.subscribers:
                tasks.append(self._spawn(f"subscriber-{sub.source.rank}", sub.run))
            tasks.append(self._spawn("heartbeat", self._heartbeat_loop))
            tasks.append(self._spawn("load", self._report_loop))
            tasks.append(self._spawn("adapters", self._adapters_loop))
            tasks.append(self._spawn("digests", self._digest_loop))
            if cfg.metrics_port is not None:
                runner = await self._serve_metrics()
            await self._wait_ready(stop)
            log.info(
                "agent ready: worker=%s epoch=%d ranks=%d", cfg.worker_id, self.epoch, len(sources)
            )
            await stop.wait()
            await self._shutdown(tasks)
        finally:
            self._stopping = True
            for pub in {self.publisher, *(d.publisher for d in self.domains)}:
                pub.close()
            for t in tasks:
                t.cancel()
            if tasks:  # bounded: a client library may swallow a cancellation
                await asyncio.wait(tasks, timeout=5)
            if runner is not None:
                await runner.cleanup()
            await self._session.close()
            ctx.destroy(linger=0)

    async def _wait_ready(self, stop: asyncio.Event) -> None:
        events = [s.connected for s in self.subscribers] + [
            d.publisher.started for d in self.domains
        ]
        waiter: asyncio.Future[Any] = asyncio.ensure_future(
            asyncio.gather(*(e.wait() for e in events))
        )
        stopper: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            waiter.cancel()
        if not stop.is_set():
            self.ready.set()

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        for t in tasks:
            if t.get_name().startswith("subscriber"):
                t.cancel()
        for d in self.domains:
            if not await d.publisher.flush(within=3.0):
                log.warning("shutting down with unpublished events (bus unavailable)")
            try:
                await self.bus.deregister(d.worker_id)
                log.info("deregistered worker %s", d.worker_id)
            except BusError as exc:
                log.warning("could not deregister (registration will lapse): %s", exc)

    def _spawn(self, name: str, loop: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        return asyncio.create_task(self._supervise(name, loop), name=name)

    async def _supervise(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        delay = 0.1
        while not self._stopping:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("agent loop %s failed; restarting in %.1fs", name, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # -- discovery --------------------------------------------------------------------------

    async def _sources(self, stop: asyncio.Event) -> list[EventSource] | None:
        eng = self.config.engine
        if eng.events:
            dp = eng.dp_size or 1
            return [
                EventSource(
                    r,
                    endpoint_for_rank(eng.events, r),
                    endpoint_for_rank(eng.replay, r) if eng.replay else None,
                    eng.topic,
                )
                for r in range(dp)
            ]
        deadline = time.monotonic() + eng.discovery_timeout
        while not stop.is_set():
            try:
                found = await self._discover()
                if self.engine_block_size is None:
                    self.engine_block_size = found.block_size
                self.bootstrap_port = found.bootstrap_port
                return found.sources
            except (DiscoveryError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                if time.monotonic() > deadline:
                    raise DiscoveryError(
                        f"engine at {eng.url} gave no event sources: {exc}"
                    ) from None
                log.info("waiting for the engine's event sources: %s", exc)
                await wait_event(stop, 1.0)
        return None

    async def _discover(self) -> Discovery:
        assert self._session is not None
        url = self.config.engine.url.rstrip("/") + self.adapter.discovery_path
        async with self._session.get(url) as resp:
            resp.raise_for_status()
            info = await resp.json(content_type=None)
        found = self.adapter.discover(info, self.config.engine.url)
        if self.config.engine.dp_size and len(found.sources) != self.config.engine.dp_size:
            log.warning(
                "engine reports %d ranks, configured dp_size=%d: using the engine's",
                len(found.sources),
                self.config.engine.dp_size,
            )
        return found

    # -- registration and load --------------------------------------------------------------

    def worker_info(self, domain: Domain | None = None) -> WorkerInfo:
        """The registration of ``domain`` (default: the first; the whole worker if it has
        one rank)."""
        cfg = self.config
        d = domain or (self.domains[0] if self.domains else None)
        cap = cfg.kv_capacity_blocks
        tokens = self._capacity.tokens if d is None or d.rank is None else d.capacity.tokens
        if cap is None and tokens:
            cap = tokens // cfg.block_size
        return WorkerInfo(
            worker_id=cfg.worker_id if d is None else d.worker_id,
            url=cfg.worker_url or cfg.engine.url,
            model=cfg.model,
            pool=cfg.pool or cfg.model,
            engine=cfg.engine.kind,
            engine_block_size=self.engine_block_size or cfg.block_size,
            block_size=cfg.block_size,
            kv_capacity_blocks=cap,
            dp_size=len(self.subscribers) or 1,
            dp_rank=None if d is None else d.rank,
            engine_id=cfg.worker_id if d is not None and d.rank is not None else "",
            role=cfg.role,
            bootstrap_port=cfg.bootstrap_port or self.bootstrap_port,
            labels=dict(cfg.labels),
            epoch=self.epoch,
            started_at=self.epoch / 1e6,
            adapters=self.adapters.names,
            seed_fingerprint=seed_fingerprint(cfg.hash_seed),
        )

    async def _digest_loop(self) -> None:
        first = self.subscribers[0].source.rank if self.subscribers else 0
        await digest_loop(
            [(d.publisher, d.digests, first if d.rank is None else d.rank) for d in self.domains],
            self.config.digest_interval,
            lambda: self._stopping,
        )

    async def _adapters_loop(self) -> None:
        assert self._session is not None
        await self.adapters.run(self._session, lambda: self._stopping)

    async def _heartbeat_loop(self) -> None:
        await wait_event(self.publisher.started, 2.0)
        while not self._stopping:
            try:
                for d in self.domains:
                    await self.bus.register(self.worker_info(d), self.config.registration_ttl)
            except BusError as exc:
                self.metrics.publish_errors.inc()
                self.metrics.heartbeats.labels("error").inc()
                self.publisher.bus_failed(exc)  # the one backoff and connected gauge
            else:
                self.metrics.heartbeats.labels("ok").inc()
                self.metrics.last_heartbeat.set(time.time())
                self.publisher.bus_ok()
            await asyncio.sleep(self.config.heartbeat_interval)

    async def _report_loop(self) -> None:
        failing = False
        ttl = max(2.0, 4 * self.config.report_interval)
        while not self._stopping:
            started = time.monotonic()
            try:
                samples = await self._scrape()
                self._capacity.tokens = (
                    self.adapter.capacity_tokens(samples) or self._capacity.tokens
                )
                if self.config.engine.block_size is None:  # a configured size wins
                    self.engine_block_size = (
                        self.adapter.block_size(samples) or self.engine_block_size
                    )
                if self.publisher.may_use_bus():  # else backing off: the report is stale soon
                    for wid, report in self._reports(samples, time.time()):
                        await self.bus.publish_report(wid, report, ttl)
                failing = False
            except BusError as exc:
                self.metrics.publish_errors.inc()
                self.publisher.bus_failed(exc)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self.metrics.scrape_errors.inc()
                if not failing:
                    log.warning("cannot scrape engine metrics: %s", exc)
                failing = True
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self.config.report_interval - elapsed))

    def _reports(self, samples: Samples, ts: float) -> list[tuple[str, EngineReport]]:
        """One load report per domain: a rank's own series where the engine labels them per
        rank, else the worker's load shared evenly among its ranks."""
        ranked = [d for d in self.domains if d.rank is not None]
        if not ranked:
            return [(self.config.worker_id, self.adapter.report(samples, ts))]
        ranks = [d.rank for d in ranked if d.rank is not None]
        per_rank = rank_samples(samples, self.adapter.rank_label, ranks)
        out = []
        if per_rank is None:
            whole = self.adapter.report(samples, ts)
            n = len(ranked)
            share = EngineReport(
                running=-(-whole.running // n),
                waiting=-(-whole.waiting // n),
                kv_usage=whole.kv_usage,
                waiting_prefill_tokens=None
                if whole.waiting_prefill_tokens is None
                else -(-whole.waiting_prefill_tokens // n),
                prefix_cache_queries=whole.prefix_cache_queries // n,
                prefix_cache_hits=whole.prefix_cache_hits // n,
                ts=ts,
            )
            cap = self._capacity.tokens
            for d in ranked:
                d.capacity.tokens = None if cap is None else cap // n
                out.append((d.worker_id, share))
            return out
        for d in ranked:
            assert d.rank is not None
            mine = per_rank[d.rank]
            d.capacity.tokens = self.adapter.capacity_tokens(mine) or d.capacity.tokens
            out.append((d.worker_id, self.adapter.report(mine, ts)))
        return out

    async def _scrape(self) -> dict[str, list[tuple[str, float]]]:
        assert self._session is not None
        url = self.config.engine.url.rstrip("/") + self.config.engine.metrics_path
        async with self._session.get(url) as resp:
            resp.raise_for_status()
            text = await resp.text()
        return parse_metrics(text, self.adapter.metric_names)

    async def _serve_metrics(self) -> web.AppRunner:
        async def handle(_: web.Request) -> web.Response:
            return web.Response(
                body=self.metrics.exposition(),
                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
            )

        async def mirror(_: web.Request) -> web.Response:
            keys = self.mirror_keys()
            domains = [
                {
                    "worker_id": d.worker_id,
                    "rank": d.rank,
                    "blocks": len(d.pipeline.mirror),
                    "digest": key_digest(d.pipeline.mirror.keys()),
                    # the last entry the bus acknowledged: a reader caught up has applied it
                    "epoch": d.publisher.epoch,
                    "seq": d.publisher.acked_seq,
                }
                for d in self.domains
            ]
            return web.json_response(
                {
                    "worker_id": self.config.worker_id,
                    "blocks": len(keys),
                    "digest": key_digest(keys),
                    "domains": domains,
                }
            )

        app = web.Application()
        app.router.add_get("/metrics", handle)
        app.router.add_get("/mirror", mirror)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.metrics_host, self.config.metrics_port)
        await site.start()
        return runner
