"""Warm-ups: put a hot prefix on a new holder with a one-token request, off the request path.

The routing policy sizes a hot prefix's holder set from its demand and, when it needs another
holder, records a ``WarmupIntent`` instead of sending a real request there cold
(``gateway/routing/replication.py``). After each routed request ``Pool.settle`` hands the
intents whose prefix that request shares to a ``Warmer``, with the request's token ids; the
warmer sends the worker the prefix alone (``/v1/completions``, ``max_tokens: 1``, token ids,
no streaming) as a background task. The engine caches the prefix and says so in its KV
events, which make the worker a holder in the index.

A warm-up is cost, not traffic: it is accounted as load on the worker while it runs (so the
policy does not pile requests onto a worker busy warming), counted in
``kvroute_warmups_sent`` / ``kvroute_warmup_tokens``, and never retried here: a failure is
counted in ``kvroute_warmups_failed`` and the policy does not ask for the same (prefix,
worker) again before its warm-up timeout. At most one warm-up per (prefix, worker) and
``max_inflight`` in all are in flight; more are dropped and counted (``busy``), not queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gateway.config import WarmupSettings
from gateway.disagg import new_room, sglang_prefill_alone
from gateway.metrics import GatewayMetrics
from gateway.pinning import pin_rank
from gateway.routing.replication import WarmupIntent

if TYPE_CHECKING:
    from gateway.pool import Pool
    from gateway.server import Gateway

__all__ = ["Target", "Warmer", "attach"]

log = logging.getLogger("kvroute.warmup")


@dataclass(frozen=True)
class Target:
    """Where a worker's warm-up goes: its engine's URL and, for a data-parallel rank, the
    rank to pin (the engine's own balancer would otherwise warm whichever rank it picks);
    for an SGLang prefill worker, its role and bootstrap port (see ``_send``)."""

    url: str
    engine: str = "vllm"
    dp_rank: int | None = None
    role: str = ""
    bootstrap_port: int | None = None


class Warmer:
    """Sends the warm-ups of every pool of one gateway process."""

    def __init__(
        self,
        settings: WarmupSettings,
        session: Callable[[], aiohttp.ClientSession],
        target_of: Callable[[str], Target | None],
        metrics: GatewayMetrics,
        headers: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._session = session  # the proxy's pooled session (opened at start-up)
        self._target_of = target_of  # worker id -> its engine, from the registry (None: gone)
        self.metrics = metrics
        self.headers = headers or {}
        self.clock = clock
        self._inflight: dict[tuple[int, str], asyncio.Task[None]] = {}

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def submit(self, pool: Pool, intent: WarmupIntent, ids: Sequence[int]) -> bool:
        """Start a warm-up of ``ids`` (the prefix's token ids) on ``intent.worker``; False
        when it is not sent (disabled, one already in flight for it, too many in flight)."""
        key = (intent.key, intent.worker)
        reason = None
        if not self.settings.enabled:
            reason = "disabled"
        elif len(ids) != intent.tokens:  # the prompt does not cover the prefix
            reason = "bad_prefix"
        elif key in self._inflight:
            reason = "duplicate"
        elif len(self._inflight) >= self.settings.max_inflight:
            reason = "busy"
        if reason is not None:
            self.metrics.warmups_failed.labels(pool.name, intent.worker, reason).inc()
            return False
        task = asyncio.get_running_loop().create_task(
            self._send(pool, intent, list(ids)), name=f"warmup-{intent.worker}"
        )
        self._inflight[key] = task
        task.add_done_callback(lambda _: self._inflight.pop(key, None))
        return True

    async def close(self) -> None:
        """Cancel the warm-ups in flight (shutdown)."""
        tasks = list(self._inflight.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._inflight.clear()

    async def _send(self, pool: Pool, intent: WarmupIntent, ids: list[int]) -> None:
        wid = intent.worker
        m = self.metrics
        target = self._target_of(wid)
        if target is None:
            m.warmups_failed.labels(pool.name, wid, "gone").inc()
            return
        fields: dict[str, Any] = {
            "model": pool.name,
            "prompt": ids,
            "max_tokens": 1,
            "stream": False,
        }
        if target.engine == "sglang" and target.role == "prefill":
            # a prefill engine serves only the prefill half of a pair; alone it needs the fake
            # decode address (vLLM's prefill engines serve a plain request as it is)
            fields.update(sglang_prefill_alone(target.bootstrap_port, new_room()))
        body, headers = pin_rank(
            target.engine,
            target.dp_rank,
            json.dumps(fields, separators=(",", ":")).encode(),
            fields,
            {**self.headers, "Content-Type": "application/json"},
        )
        loads = pool.router.loads
        rid = loads.started(wid, len(ids), self.clock())
        m.warmups_sent.labels(pool.name, wid).inc()
        m.warmup_tokens.labels(pool.name, wid).inc(len(ids))
        reason = None
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.timeout)
            async with self._session().post(
                target.url + "/v1/completions", data=body, headers=headers, timeout=timeout
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    reason = f"http_{resp.status}"
        except TimeoutError:
            reason = "timeout"
        except aiohttp.ClientError:
            reason = "connection"
        finally:
            loads.finished(rid)
        if reason is not None:
            m.warmups_failed.labels(pool.name, wid, reason).inc()
            log.info("warm-up of %d tokens on %s failed: %s", len(ids), wid, reason)


def attach(app: web.Application, gw: Gateway) -> None:
    """Give every pool of ``gw`` a warmer for the app's lifetime: created once the gateway
    has started (the proxy's session is open), closed before the gateway stops."""

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        cfg = gw.config
        key = cfg.proxy.upstream_api_key
        warmer = Warmer(
            cfg.warmup,
            lambda: gw.proxy.session,
            lambda wid: _target(gw, wid),
            gw.metrics,
            headers={"Authorization": f"Bearer {key}"} if key else None,
        )
        for pool in gw.pools:
            pool.warmer = warmer
        yield
        for pool in gw.pools:
            pool.warmer = None
        await warmer.close()

    app.cleanup_ctx.append(lifetime)


def _target(gw: Gateway, wid: str) -> Target | None:
    entry = gw.registry.workers.get(wid)
    if entry is None:
        return None
    if entry.info is None:  # a static worker: no rank to pin
        return Target(entry.url)
    info = entry.info
    return Target(entry.url, info.engine, info.dp_rank, info.role, info.bootstrap_port)
