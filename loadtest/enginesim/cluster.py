"""N simulated workers in one asyncio process, plus an optional cluster admin API.

    async with SimCluster(config) as cluster:
        url = cluster.workers[0].http_url
        await cluster.fault(0, "kill")

The admin API (``admin_port``) reaches workers whose own HTTP port is down (killed or
refusing): ``GET /sim/workers`` and ``POST /sim/fault {"worker": i, "action": ..., ...}``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
import zmq.asyncio
from aiohttp import web

from loadtest.enginesim.api import ApiError, decode_body, error_body
from loadtest.enginesim.config import SimConfig
from loadtest.enginesim.text import TextCodec, load_tokenizer, tokenizer_path
from loadtest.enginesim.worker import FaultError, SimWorker

if TYPE_CHECKING:
    from gateway.tokenization import Tokenizer

__all__ = ["SimCluster"]

_UNSET: Any = object()


class SimCluster:
    """``config.workers`` workers sharing one tokenizer and one ZMQ context.

    ``tokenizer``: a loaded ``gateway.tokenization.Tokenizer`` to share (tests load it once),
    None for token-id prompts only, or left out to load what the config names.
    """

    def __init__(self, config: SimConfig, tokenizer: Tokenizer | None = _UNSET) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self.workers: list[SimWorker] = []
        self._zmq: zmq.asyncio.Context | None = None
        self._admin: web.AppRunner | None = None
        self.admin_port: int | None = None

    @property
    def admin_url(self) -> str | None:
        return None if self.admin_port is None else f"http://{self.config.host}:{self.admin_port}"

    async def start(self) -> SimCluster:
        cfg = self.config
        tokenizer = self._tokenizer
        if tokenizer is _UNSET:
            tokenizer = await asyncio.to_thread(
                load_tokenizer, cfg.tokenizer, cfg.chat_template, cfg.tokenizer_cache_tokens
            )
        codec = TextCodec(tokenizer, cfg.output_text, tokenizer_path(cfg.tokenizer))
        self._zmq = zmq.asyncio.Context()
        n, d, base = cfg.workers, cfg.dp_size, cfg.base_port
        for i in range(n):
            ports = (base + i, base + n + i * d, base + n + n * d + i * d) if base else (0, 0, 0)
            worker = SimWorker(
                i, cfg, codec, self._zmq,
                http_port=ports[0], events_port=ports[1], replay_port=ports[2],
            )  # fmt: skip
            self.workers.append(worker)
        try:
            for worker in self.workers:
                await worker.start()
            if cfg.admin_port is not None:
                await self._start_admin(cfg.admin_port)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        for worker in self.workers:
            await worker.stop()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    async def fault(self, worker: int, action: str, **params: Any) -> dict[str, Any]:
        """Apply a fault to one worker (see ``SimWorker.fault``)."""
        return await self.workers[worker].fault(action, **params)

    def describe(self) -> list[dict[str, Any]]:
        return [w.state() for w in self.workers]

    async def __aenter__(self) -> SimCluster:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- admin API -------------------------------------------------------------------------

    async def _start_admin(self, port: int) -> None:
        app = web.Application()
        app.router.add_get("/sim/workers", self._admin_workers)
        app.router.add_post("/sim/fault", self._admin_fault)
        self._admin = web.AppRunner(app, access_log=None)
        await self._admin.setup()
        site = web.TCPSite(self._admin, self.config.host, port, reuse_address=True)
        await site.start()
        self.admin_port = int(self._admin.addresses[0][1])

    async def _admin_workers(self, request: web.Request) -> web.Response:
        return _json(self.describe())

    async def _admin_fault(self, request: web.Request) -> web.Response:
        try:
            body = decode_body(await request.read())
            index, action = body.pop("worker", None), body.pop("action", None)
            if type(index) is not int or not 0 <= index < len(self.workers):
                raise ApiError(
                    400, f"worker must be an index in [0, {len(self.workers)})", "worker"
                )
            if not isinstance(action, str):
                raise ApiError(400, "action (a string) is required", "action")
            state = await self.fault(index, action, **body)
        except ApiError as exc:
            return _json(exc.body(), exc.status)
        except (FaultError, TypeError) as exc:
            return _json(error_body(400, str(exc), "action"), 400)
        return _json(state)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json"
    )
