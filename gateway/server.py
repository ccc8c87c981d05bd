"""The gateway's HTTP service (aiohttp): OpenAI and Anthropic APIs, health, metrics, admin.

Request path: read the body (413 over the limit) -> parse and validate (4xx) -> pick the
pool by model (404) -> authenticate and rate-limit -> tokenize exactly as the engine will
and compute block keys -> wait for a concurrency slot (429/408) -> route + proxy with
retries (``Proxy``). Every API (``gateway.apis``: chat, completions, /generate, Responses,
Messages) takes that one path. Every error is JSON in the client's API's shape (OpenAI's, or
Anthropic's on /v1/messages); bad input never yields a 5xx.

Background: the event-bus consumer keeps the shadow index and the registry current and
feeds engine load reports to the routers; a 100 ms tick expires speculation and updates
gauges; a 1 s probe of every worker's ``/health`` catches dead workers without traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import aiohttp
from aiohttp import web

from gateway.apis import APIS, Api
from gateway.cache_reset import ResetTarget, reset_caches
from gateway.circuit import CircuitState
from gateway.config import ApiKey, GatewayConfig
from gateway.consumer import Consumer, ConsumerConfig
from gateway.contract.bus import EventBus
from gateway.contract.fingerprint import seed_fingerprint
from gateway.contract.wire import key_digest
from gateway.errors import ApiError, ErrorShape, anthropic_error_body, error_body
from gateway.limits import Admission, TokenBucket
from gateway.metrics import GatewayMetrics
from gateway.placements import PlacementFeed, shared_routers
from gateway.pool import Pool
from gateway.proxy import REQUEST_ID, Proxy, new_request_id
from gateway.registry import Registry
from gateway.request_log import RequestLog
from gateway.requests import ClientRequest, Kind, parse_body
from gateway.routing.index import ShadowIndex
from gateway.session import SessionKeys
from gateway.tokencheck import check_engine_tokenizer
from gateway.tokenization import Tokenizer
from gateway.trust import TrustBook

__all__ = ["Gateway", "build_app", "build_metrics_app"]


#: How often each worker's /health is probed (each on its own, never waiting for others).
PROBE_INTERVAL_S = 0.5
#: A new worker's engine tokenizer check: attempts while its engine does not answer, apart.
TOKENIZER_CHECK_ATTEMPTS = 5
TOKENIZER_CHECK_RETRY_S = 3.0

log = logging.getLogger("kvroute.gateway")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
POOL = web.RequestKey("pool", str)  # the pool a request was routed in (metrics labels)
ERRORS = web.RequestKey("errors", str)  # the error shape of the API the client speaks


@dataclass
class _Client:
    """An authenticated API key and its rate limits."""

    key: ApiKey
    requests: TokenBucket
    tokens: TokenBucket


@dataclass
class Gateway:
    """Everything one gateway process (one replica) holds."""

    config: GatewayConfig
    bus: EventBus | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)
    rng: random.Random | None = None

    def __post_init__(self) -> None:
        cfg = self.config
        cfg.validate()
        self.index = ShadowIndex(speculative_ttl=cfg.index.speculative_ttl)
        self.pools = [
            Pool(
                p,
                self.index,
                cfg.index.hash_seed,
                rng=self.rng,
                tokenizer=self.tokenizers.get(p.model),
            )
            for p in cfg.pools
        ]
        self.registry = Registry(
            self.pools,
            cfg.circuit,
            cfg.security.allowed_upstreams,
            seed_fingerprint=seed_fingerprint(cfg.index.hash_seed),
            on_reject=lambda reason: self.metrics.worker_rejected.labels(reason).inc(),
        )
        self.registry.add_static()
        self.registry.trust = TrustBook(cfg.trust)
        self.registry.on_precision = self._on_precision
        self.proxy = Proxy(cfg.proxy, self.registry, self.metrics)
        if cfg.request_log.path:
            self.proxy.request_log = RequestLog(cfg.request_log, cfg.index.hash_seed, self.metrics)
        self.admission = Admission(
            cfg.limits.max_concurrency, cfg.limits.queue_size, cfg.limits.queue_timeout
        )
        self.consumer = (
            Consumer(
                self.bus,
                self.index,
                ConsumerConfig(
                    antientropy=cfg.trust.antientropy, read_interval=cfg.redis.read_interval
                ),
            )
            if self.bus is not None
            else None
        )
        rs = cfg.replicas
        self.placements = (
            PlacementFeed(
                self.bus,
                self.index,
                interval=rs.interval,
                start_gap=rs.start_gap,
                max_pending=rs.max_pending,
                routers=shared_routers(self.pools) if rs.share_load else None,
                remote_ttl=rs.remote_ttl,
            )
            if self.bus is not None and self.bus.carries_placements and rs.share_placements
            else None
        )
        self._clients = {
            k.key: _Client(
                k,
                TokenBucket(k.requests_per_s, max(1.0, 2 * k.requests_per_s)),
                TokenBucket(k.tokens_per_s, 2 * k.tokens_per_s),
            )
            for k in cfg.auth.api_keys
        }
        self.sessions = SessionKeys.of(
            [cfg.session_header, *cfg.session_headers], cfg.session_fields
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._checks: set[asyncio.Task[None]] = set()  # engine tokenizer checks under way
        self._probe_session: aiohttp.ClientSession | None = None
        self.clock = time.monotonic

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self.proxy.request_log is not None:
            self.proxy.request_log.open()  # an unwritable path fails start-up, clearly
        await self.proxy.start()
        self._probe_session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))
        if self.consumer is not None:
            self.consumer.subscribe(self._on_bus_change)
            await self.consumer.start()
        if self.placements is not None:
            await self.placements.start()
        self._tasks = [
            asyncio.create_task(self._tick_loop(), name="gateway-tick"),
            asyncio.create_task(self._probe_loop(), name="gateway-probe"),
        ]

    async def stop(self) -> None:
        for t in [*self._tasks, *self._checks]:
            t.cancel()
        for t in [*self._tasks, *self._checks]:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.placements is not None:
            await self.placements.stop()
        if self.consumer is not None:
            await self.consumer.stop()
        if self.bus is not None:
            await self.bus.close()
        await self.proxy.close()
        if self.proxy.request_log is not None:
            await asyncio.to_thread(self.proxy.request_log.close)
        if self._probe_session is not None:
            await self._probe_session.close()
        for p in self.pools:
            p.tokenizer.close()

    def ready(self) -> tuple[bool, str]:
        """Whether this process can answer: configuration loaded and index bootstrapped.

        Worker health is deliberately not part of it: with no healthy worker a ready gateway
        still answers (an OpenAI-shaped 503 with Retry-After), while an unready one would
        drop out of its Service (connection errors instead), stall rollouts and
        ``helm --wait``, and block node drains through its PodDisruptionBudget. Worker
        health is ``kvroute_pool_healthy_workers`` and its alert."""
        if self.consumer is not None and not self.consumer.synced:
            return False, "index not bootstrapped yet"
        now = self.clock()
        healthy = sum(1 for w in self.registry.workers if self.registry.healthy(w, now))
        return True, f"ready ({healthy} of {len(self.registry.workers)} workers healthy)"

    # -- background -------------------------------------------------------------------------

    def _on_precision(self, pool: str, worker: str, predicted: int, agreed: int) -> None:
        self.metrics.agreed_cached.labels(pool, worker).inc(agreed)
        self.metrics.checked_predicted.labels(pool, worker).inc(predicted)

    def _update_trust(self, now: float) -> None:
        stream = self.consumer.distrust() if self.consumer is not None else {}
        before = self.registry.trust.why
        after = self.registry.trust.update(stream, now)
        if after != before:
            log.info("untrusted workers (routed by load alone): %s", after or "none")

    def _on_bus_change(self, kind: str, worker: str) -> None:
        assert self.consumer is not None
        if kind in ("mismatch", "resync"):
            m = self.metrics
            c = m.antientropy_mismatches if kind == "mismatch" else m.antientropy_resyncs
            entry = self.registry.workers.get(worker)
            c.labels(entry.pool.name if entry is not None else "", worker).inc()
            self._update_trust(self.clock())  # at once: requests routed now must know
            return
        if kind in ("gap", "healed"):
            self._update_trust(self.clock())  # likewise: no tick of routing on a stale verdict
            return
        if kind == "report":
            rep = self.consumer.report(worker)
            entry = self.registry.workers.get(worker)
            if rep is not None and entry is not None:
                router = entry.pool.router_for(entry.role)
                router.loads.report(worker, rep, self.clock())
                router.adapters.report(worker, rep.adapters, rep.max_adapters)
            return
        added, removed = self.registry.sync(self.consumer.workers())
        for wid, e in self.registry.workers.items():  # the LoRA adapters each one serves
            if e.info is not None:
                e.pool.router.adapters.serve(wid, e.info.adapters)
        for w in removed:
            self._forget_worker_metrics(w)
        if added or removed:
            log.info("workers added %s removed %s", added, removed)
        if self.config.index.verify_engine_tokenizer:
            for w in added:
                task = asyncio.create_task(self._check_tokenizer(w), name=f"tokenizer-{w}")
                self._checks.add(task)
                task.add_done_callback(self._checks.discard)

    async def _check_tokenizer(self, wid: str) -> None:
        """Refuse ``wid`` for this agent run if its engine tokenizes otherwise than we do
        (gateway/tokencheck.py). An engine still starting is asked again a few times."""
        entry = self.registry.workers.get(wid)
        if entry is None or entry.info is None or self._probe_session is None:
            return
        epoch, pool = entry.info.epoch, entry.pool
        for attempt in range(TOKENIZER_CHECK_ATTEMPTS):
            result = await check_engine_tokenizer(
                self._probe_session, entry.url, pool.settings.model, pool.tokenizer
            )
            if result.ok is not None or not result.detail.startswith("/tokenize failed"):
                break
            if attempt + 1 < TOKENIZER_CHECK_ATTEMPTS:
                await asyncio.sleep(TOKENIZER_CHECK_RETRY_S)
        if result.ok is False:
            if self.registry.veto(wid, epoch, "tokenizer_mismatch", result.detail):
                self._forget_worker_metrics(wid)
        elif result.ok is None:
            log.info("worker %s: engine tokenizer not verified (%s)", wid, result.detail)

    async def _tick_loop(self) -> None:
        while True:
            now = self.clock()
            for p in self.pools:
                p.router.tick(now)
                p.decode_router.loads.refresh(now)  # one index: the first tick expired it
            self._update_gauges(now)
            await asyncio.sleep(0.1)

    async def _probe_loop(self) -> None:
        """Each worker's ``/health`` on a schedule of its own, every ``PROBE_INTERVAL_S``.

        A result is recorded as soon as it arrives, so a worker whose ``/health`` hangs (its
        probe times out after 1 s) never delays noticing another worker's death: an idle
        worker that dies refuses the next probe and is out of routing within the interval
        (R3: no new request reaches it 1 s after its death is observable)."""
        running: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for wid, e in list(self.registry.workers.items()):
                    task = running.get(wid)
                    if task is None or task.done():
                        running[wid] = asyncio.create_task(self._probe_worker(wid, e.url))
                for wid in [w for w in running if w not in self.registry.workers]:
                    running.pop(wid).cancel()
                await asyncio.sleep(PROBE_INTERVAL_S)
        finally:
            for task in running.values():
                task.cancel()

    async def _probe_worker(self, wid: str, url: str) -> None:
        ok = await self._probe(url)
        entry = self.registry.workers.get(wid)
        if entry is not None and entry.url == url:  # it may have left or moved meanwhile
            self.registry.set_probe(wid, ok)

    async def _probe(self, url: str) -> bool:
        assert self._probe_session is not None
        try:
            async with self._probe_session.get(url + "/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    def _update_gauges(self, now: float) -> None:
        m = self.metrics
        self._update_trust(now)
        trust = self.registry.trust
        counts = self.index.block_counts()
        for wid, e in self.registry.workers.items():
            pool = e.pool.name
            m.trusted.labels(pool, wid).set(0 if wid in trust.why else 1)
            precision = trust.precision(wid, now)
            m.precision.labels(pool, wid).set(-1.0 if precision is None else precision)
            m.circuit.labels(pool, wid).set(_circuit_value(e.circuit.state))
            m.healthy.labels(pool, wid).set(1 if self.registry.healthy(wid, now) else 0)
            m.index_blocks.labels(pool, wid).set(counts.get(wid, 0))
            info = e.info
            rank = "" if info is None or info.dp_rank is None else str(info.dp_rank)
            engine = (info.engine_id if info is not None else "") or wid
            m.worker_info.labels(pool, wid, engine, rank, e.role).set(1)
            rep = e.pool.router_for(e.role).loads.last_report(wid)
            m.kv_usage.labels(pool, wid).set(rep.kv_usage if rep else 0.0)
        for p in self.pools:
            members = [w for w, e in self.registry.workers.items() if e.pool is p]
            m.pool_workers.labels(p.name).set(len(members))
            m.pool_healthy.labels(p.name).set(
                sum(1 for w in members if self.registry.healthy(w, now))
            )
            m.cost_scale.labels(p.name).set(p.router.ctx.cost.scale)
            st = p.tokenizer.stats
            total = st.token_hits + st.token_misses
            if total:
                m.tokenizer_cache_hits.labels(p.name).set(st.token_hits / total)
        m.queued.set(self.admission.queued)
        m.unverified_seed.set(len(self.registry.unverified))
        st_i = self.index.stats
        m.orphans.set(st_i.orphan_stores)
        if self.consumer is not None:
            cs = self.consumer.stats
            m.redis_up.set(1 if cs.connected else 0)
            m.event_lag.set(cs.lag_last_s)
            m.resyncs.set(cs.resyncs)
            m.redis_client_rebuilds.set(getattr(self.consumer.bus, "client_rebuilds", 0))
            m.event_reads.set(cs.reads)
            m.event_entries_read.set(cs.entries_read)
            m.gaps.set(getattr(cs.apply, "gaps", 0))
        if self.placements is not None:
            ps = self.placements.stats
            m.placements.labels("published").set(ps.published)
            m.placements.labels("adopted").set(ps.adopted)
            m.placements.labels("dropped").set(ps.dropped)
            m.placements.labels("garbage").set(ps.garbage)
            rs = self.placements.remote.stats
            m.remote_requests.labels("started").set(rs.started)
            m.remote_requests.labels("ended").set(rs.ended)
            m.remote_requests.labels("expired").set(rs.expired)
            m.remote_requests.labels("unknown").set(rs.unknown)
            m.remote_requests.labels("inflight").set(len(self.placements.remote))

    def _forget_worker_metrics(self, wid: str) -> None:
        """Drop a departed worker's label sets (multiprocess mode cannot: the exposition
        leaves out workers the registry no longer has, which covers both modes)."""
        m = self.metrics
        if m.multiprocess():
            return
        gauges = (m.circuit, m.healthy, m.index_blocks, m.kv_usage, m.worker_info, m.trusted)
        for gauge in (*gauges, m.precision):
            for labels in list(gauge._metrics):  # the registry keeps label sets forever otherwise
                if len(labels) > 1 and labels[1] == wid:
                    with contextlib.suppress(KeyError):
                        gauge.remove(*labels)

    # -- authentication and limits ----------------------------------------------------------

    def authenticate(self, request: web.Request) -> _Client | None:
        if not self._clients:
            return None
        token = _bearer(request)
        for key, client in self._clients.items():
            if token is not None and hmac.compare_digest(token.encode(), key.encode()):
                return client
        raise ApiError(
            401,
            "invalid or missing API key (Authorization: Bearer <key>)",
            "authentication_error",
            code="invalid_api_key",
        )

    def authorize_admin(self, request: web.Request) -> None:
        key = self.config.auth.admin_key
        if not key:
            raise ApiError(
                404, "admin endpoints are disabled (auth.admin_key is not set)", code="not_found"
            )
        token = _bearer(request)
        if token is None or not hmac.compare_digest(token.encode(), key.encode()):
            raise ApiError(
                401,
                "invalid or missing admin key",
                "authentication_error",
                code="invalid_admin_key",
            )

    def rate_limit(self, client: _Client | None, tokens: int) -> None:
        if client is None:
            return
        now = self.clock()
        for bucket, amount, what in (
            (client.requests, 1.0, "requests"),
            (client.tokens, float(tokens), "tokens"),
        ):
            wait = bucket.take(amount, now)
            if wait > 0:
                self.metrics.rejected.labels("rate_limit").inc()
                raise ApiError(
                    429,
                    f"rate limit exceeded for {what} on this API key; retry in {wait:.1f}s",
                    "rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, round(wait)))},
                )

    # -- handlers ---------------------------------------------------------------------------

    def _pool(self, model: str | None) -> Pool:
        """The pool serving ``model``, or the OpenAI-shaped error (vLLM's type for 404)."""
        pool = self.registry.pool_for(model)
        if pool is not None:
            return pool
        for p in self.pools:  # a LoRA adapter that some worker of the pool serves
            if model is not None and p.router.adapters.known(model):
                return p
        if model is None:
            raise ApiError(
                400,
                "'model' is required (this gateway serves several models)",
                param="model",
                code="missing_field",
            )
        raise ApiError(
            404,
            f"The model `{model}` does not exist. It is neither a served model nor a LoRA "
            "adapter that a worker serves (GET /v1/models lists both).",
            "NotFoundError",
            param="model",
            code="model_not_found",
        )

    async def generation(self, request: web.Request, api: Api) -> web.StreamResponse:
        request[ERRORS] = api.errors
        client = self.authenticate(request)
        raw = await request.read()
        creq = parse_body(raw, api.kind)
        pool = self._pool(creq.model)
        request[POOL] = pool.name
        skip = self._not_serving(pool, api)
        prep = await pool.prepare(creq, pool.adapter_for(creq.model), self._may_overlap(client))
        m = self.metrics
        m.tokenize.labels(pool.name, api.kind).observe(prep.tokenize_s + prep.keys_s)
        if prep.rest is not None:
            m.tokenize_overlapped.labels(pool.name).inc()
        self.rate_limit(client, prep.prompt_tokens + (creq.max_tokens or 0))
        if self.config.log.log_prompts:
            log.info(
                "request %s pool=%s prompt=%r",
                request[REQUEST_ID],
                pool.name,
                creq.messages or creq.prompt_text,
            )
        priority = client.key.priority if client else 0
        try:
            await self.admission.acquire(priority)
        except ApiError as exc:
            m.rejected.labels(exc.code or "admission").inc()
            raise
        try:
            return await self.proxy.forward(
                request, creq, pool, prep, api.path, self._session_key(request, creq), skip
            )
        finally:
            self.admission.release()

    def _may_overlap(self, client: _Client | None) -> bool:
        """Whether a prompt may be routed before all of it is encoded (``Pool.prepare``): not
        when a token rate limit needs its exact count first, nor when the request log records
        decisions to be replayed on the exact keys."""
        return (client is None or client.tokens.rate <= 0) and self.proxy.request_log is None

    def _not_serving(self, pool: Pool, api: Api) -> frozenset[str]:
        """Workers of ``pool`` whose engine lacks ``api`` (501 when that is all of them)."""
        members = {w: e for w, e in self.registry.workers.items() if e.pool is pool}
        engines = {w: e.info.engine if e.info else None for w, e in members.items()}
        skip = frozenset(w for w, engine in engines.items() if not api.served_by(engine))
        if members and len(skip) == len(members):
            raise api.unsupported(pool.name, {e for e in engines.values() if e})
        return skip

    def _session_key(self, request: web.Request, creq: ClientRequest) -> str | None:
        return self.sessions.key(request.headers, creq.body)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.generation(request, APIS["chat"])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generation(request, APIS["completion"])

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self.generation(request, APIS["generate"])

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI Responses API: routed on its input rendered as the engine renders it."""
        return await self.generation(request, APIS["responses"])

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic Messages API: routed on its messages rendered as the engine renders them."""
        return await self.generation(request, APIS["messages"])

    async def reset_cache(self, request: web.Request) -> web.Response:
        """Admin: clear the prefix cache of every worker of a pool (``model`` in the query or
        body; default every pool), through each engine's own endpoint; per-worker results.
        The index follows from the engines' clear events (``gateway.cache_reset``)."""
        self.authorize_admin(request)
        model = request.query.get("model")
        raw = await request.read()
        if model is None and raw.strip():
            try:
                body = json.loads(raw)
            except ValueError:
                raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
            model = body.get("model") if isinstance(body, dict) else None
            if model is not None and not isinstance(model, str):
                raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
        pools = [self._pool(model)] if model is not None else self.pools
        targets = [
            ResetTarget(wid, e.url, e.pool.name, e.info.engine if e.info else None)
            for wid, e in sorted(self.registry.workers.items())
            if e.pool in pools
        ]
        headers = {"x-request-id": request[REQUEST_ID]}
        if self.config.proxy.upstream_api_key:
            headers["authorization"] = f"Bearer {self.config.proxy.upstream_api_key}"
        results = await reset_caches(
            self.proxy.session,
            targets,
            headers,
            request.query,
            self.config.proxy.connect_timeout * 5,
        )
        ok = all(r.success for r in results)
        log.info("prefix cache reset on %d workers: %s", len(results), "ok" if ok else "failed")
        return web.json_response(
            {
                "success": ok,
                "pools": [p.name for p in pools],
                "workers": [dataclasses.asdict(r) for r in results],
            },
            status=200 if ok else 502,
        )

    async def models(self, request: web.Request) -> web.Response:
        self.authenticate(request)
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvroute"}
            for name in self.registry.models()
        ]
        for p in self.pools:  # LoRA adapters, with their base model as vLLM lists them
            data.extend(
                {"id": a, "object": "model", "created": 0, "owned_by": "kvroute", "parent": p.name}
                for a in p.router.adapters.names()
            )
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readiness(self, request: web.Request) -> web.Response:
        ok, why = self.ready()
        return web.json_response(
            {"status": "ready" if ok else "not ready", "detail": why}, status=200 if ok else 503
        )

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        self._update_gauges(self.clock())
        return web.Response(
            body=self.metrics.exposition(workers=self.registry.workers),
            content_type="text/plain",
            charset="utf-8",
        )

    async def debug_route(self, request: web.Request) -> web.Response:
        """Dry-run a request: the routing decision with its full explanation."""
        self.authorize_admin(request)
        raw = await request.read()
        api = request.query.get("api")
        peek = APIS[api].kind if api in ("responses", "messages") else _peek_kind(raw)  # type: ignore[index]
        creq = parse_body(raw, peek)
        pool = self._pool(creq.model)
        prep = await pool.prepare(creq, pool.adapter_for(creq.model))
        now = self.clock()
        excluded = self.registry.exclude(pool, now)
        t0 = time.perf_counter()
        d = pool.router.route(
            prep.keys,
            prep.prompt_tokens,
            now,
            session_key=self._session_key(request, creq),
            exclude=excluded,
            dry_run=True,
            explain=True,
            adapter=prep.adapter,
        )
        decision_us = (time.perf_counter() - t0) * 1e6
        return web.json_response(
            {
                "model": pool.name,
                "policy": d.policy,
                "prompt_tokens": prep.prompt_tokens,
                "blocks": len(prep.keys),
                "block_size": pool.settings.block_size,
                "worker": d.worker,
                "reason": d.reason,
                "matched_tokens": d.matched_tokens,
                "predicted_ttft_ms": d.predicted_ttft_ms,
                "excluded": sorted(excluded),
                "decision_us": round(decision_us, 1),
                "candidates": sorted(
                    (
                        {
                            "worker": c.worker,
                            "matched_tokens": c.matched_tokens,
                            "predicted_ttft_ms": c.predicted_ttft_ms,
                            "score": c.score,
                        }
                        for c in d.candidates
                    ),
                    key=lambda c: (c["score"] is None, c["score"] or 0.0, c["worker"]),
                ),
            }
        )

    async def openapi(self, request: web.Request) -> web.Response:
        spec = resources.files("gateway").joinpath("openapi.yaml").read_bytes()
        return web.Response(body=spec, content_type="application/yaml")

    async def debug_index(self, request: web.Request) -> web.Response:
        """Per-worker block count and key digest: what must equal the agents' mirrors."""
        self.authorize_admin(request)
        out: dict[str, dict[str, Any]] = {}
        cursors = self.consumer.applier.cursors if self.consumer is not None else {}
        for wid in sorted(set(self.index.workers()) | set(self.registry.workers)):
            keys = self.index.worker_keys(wid)
            out[wid] = {"blocks": len(keys), "digest": key_digest(keys)}
            cur = cursors.get(wid)
            if cur is not None:  # how far its stream is applied (a gap waits for a snapshot)
                out[wid]["stream"] = {"epoch": cur.epoch, "seq": cur.seq, "waiting": cur.waiting}
        return web.json_response({"workers": out, "stats": dataclasses.asdict(self.index.stats)})

    async def workers(self, request: web.Request) -> web.Response:
        self.authorize_admin(request)
        now = self.clock()
        counts = self.index.block_counts()
        trust = self.registry.trust
        out = []
        for wid, e in sorted(self.registry.workers.items()):
            loads = e.pool.router_for(e.role).loads
            v = loads.view(wid)
            rep = loads.last_report(wid)
            out.append(
                {
                    "worker_id": wid,
                    "url": e.url,
                    "pool": e.pool.name,
                    "static": e.static,
                    "healthy": self.registry.healthy(wid, now),
                    "probe_ok": e.probe_ok,
                    "circuit": e.circuit.state.name.lower(),
                    "inflight": loads.inflight(wid),
                    "load": {
                        "queued_prefill_tokens": v.queued_prefill_tokens,
                        "running": v.running,
                        "kv_usage": v.kv_usage,
                    },
                    "engine_report": None
                    if rep is None
                    else {
                        "running": rep.running,
                        "waiting": rep.waiting,
                        "kv_usage": rep.kv_usage,
                        "ts": rep.ts,
                    },
                    "index_blocks": counts.get(wid, 0),
                    "trusted": wid not in trust.why,
                    "why": trust.why.get(wid),
                    "precision": trust.precision(wid, now),
                    "engine": e.info.engine if e.info else None,
                    "engine_block_size": e.info.engine_block_size if e.info else None,
                    "kv_capacity_blocks": e.info.kv_capacity_blocks if e.info else None,
                    "dp_rank": e.info.dp_rank if e.info else None,
                    "role": e.role,
                    "engine_id": e.info.engine_id if e.info else "",
                    "epoch": e.info.epoch if e.info else None,
                    "labels": e.labels,
                    "adapters": e.pool.router.adapters.served_by(wid),
                    "adapters_loaded": e.pool.router.adapters.loaded_on(wid),
                }
            )
        # pid: which process of a multi-process gateway answered (each keeps its own view)
        return web.json_response(
            {"workers": out, "rejected_registrations": self.registry.rejected, "pid": os.getpid()}
        )


def _shape(request: web.Request) -> ErrorShape:
    shape = request.get(ERRORS)
    return "anthropic" if shape == "anthropic" else "openai"


def _circuit_value(state: CircuitState) -> int:
    return {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}[state]


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return None


def _peek_kind(raw: bytes) -> Kind:
    if b'"messages"' in raw:
        return "chat"
    if b'"input_ids"' in raw or (b'"text"' in raw and b'"prompt"' not in raw):
        return "generate"
    return "completion"


# -- application --------------------------------------------------------------------------------


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(
        client_max_size=gw.config.server.max_body_bytes,
        middlewares=[_middleware(gw)],
        handler_args={"max_field_size": 16384},
    )
    app.router.add_post("/v1/chat/completions", gw.chat)
    app.router.add_post("/v1/completions", gw.completions)
    app.router.add_post("/generate", gw.generate)
    app.router.add_post("/v1/responses", gw.responses)
    app.router.add_post("/v1/messages", gw.messages)
    for path in ("/reset_prefix_cache", "/flush_cache"):
        app.router.add_post(path, gw.reset_cache)
    app.router.add_get("/flush_cache", gw.reset_cache)  # SGLang takes GET too
    app.router.add_get("/v1/models", gw.models)
    app.router.add_get("/health", gw.health)
    app.router.add_get("/ready", gw.readiness)
    if not gw.config.server.metrics_port:
        app.router.add_get("/metrics", gw.metrics_endpoint)
    app.router.add_post("/debug/route", gw.debug_route)
    app.router.add_get("/workers", gw.workers)
    app.router.add_get("/debug/index", gw.debug_index)
    app.router.add_get("/openapi.yaml", gw.openapi)

    async def on_startup(_: web.Application) -> None:
        await gw.start()

    async def on_cleanup(_: web.Application) -> None:
        await gw.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


#: the client API, whose responses are counted (probes, scrapes and admin calls are not traffic)
_API_PATHS = ("/v1/", "/generate")


def build_metrics_app(gw: Gateway) -> web.Application:
    """/metrics alone, for ``server.metrics_port`` (it shares the gateway's state)."""
    app = web.Application()
    app.router.add_get("/metrics", gw.metrics_endpoint)
    return app


#: the status of a request whose client left (nginx's "client closed request"): never sent
CLIENT_CLOSED = 499


def _middleware(gw: Gateway) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = request.headers.get("x-request-id", "")
        request[REQUEST_ID] = rid if _REQUEST_ID.match(rid) else new_request_id()
        request[POOL] = ""
        request[ERRORS] = "openai"
        response = await _answer(request, handler)
        if request.path.startswith(_API_PATHS) and response.status != CLIENT_CLOSED:
            gw.metrics.responses.labels(request[POOL], f"{response.status // 100}xx").inc()
        return response

    async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            gw.metrics.errors.labels(request[POOL], str(exc.status), exc.code or "").inc()
            headers = {"x-request-id": request[REQUEST_ID], **(exc.headers or {})}
            return web.Response(
                status=exc.status,
                body=exc.body(_shape(request)),
                content_type="application/json",
                headers=headers,
            )
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
                exc.status, "http_error"
            )
            msg = (
                exc.reason
                if exc.status != 413
                else f"request body is larger than {gw.config.server.max_body_bytes} bytes"
            )
            gw.metrics.errors.labels(request[POOL], str(exc.status), code).inc()
            return web.Response(
                status=exc.status,
                body=anthropic_error_body(exc.status, msg)
                if _shape(request) == "anthropic"
                else error_body(msg, "invalid_request_error", None, code),
                content_type="application/json",
                headers={"x-request-id": request[REQUEST_ID]},
            )
        except asyncio.CancelledError:
            raise
        except ConnectionResetError:
            if request.transport is not None and not request.transport.is_closing():
                raise  # not the client's connection: aiohttp logs it and answers 500
            # the client left while its answer was being written, before aiohttp cancelled
            # the handler (the proxy has closed the worker's side by now): nothing can reach
            # the client, and aiohttp's write of this answer fails quietly. Not a gateway
            # error, and not a response (as when aiohttp cancels the handler first).
            log.debug("client left during %s %s", request.method, request.path)
            return web.Response(status=CLIENT_CLOSED)
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            gw.metrics.errors.labels(request[POOL], "500", "internal_error").inc()
            return web.Response(
                status=500,
                body=ApiError(
                    500, "internal gateway error", "internal_error", code="internal_error"
                ).body(_shape(request)),
                content_type="application/json",
            )

    return middleware
