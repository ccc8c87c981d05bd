"""Upstream side of a request: route, send, retry before the first byte, stream back.

* One pooled, keep-alive aiohttp session for all workers (per-host connection limits).
* Retries go to another worker (the failed ones are excluded) with exponential backoff, on
  connection errors, timeouts before the first body byte, and 429/502/503/504 — as long as
  the client has received nothing: the client's response starts only with the upstream's
  first body chunk, so everything before that is retryable.
* SSE is passed through event by event; a stream that breaks afterwards ends with an
  error event in the client's API's form, never a hang or a silent truncation. A stream is
  whole at ``[DONE]``, at a Responses ``response.completed`` (or ``.incomplete``/``.failed``)
  and at a Messages ``message_stop``.
* ``usage`` is read on the way (on chat and completion streams the gateway asks for it and
  strips the extra chunk if the client did not) to count delivered cached tokens per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from gateway.apis import APIS
from gateway.config import ProxySettings
from gateway.disagg import new_room, sglang_pair_body, vllm_decode_body, vllm_prefill_body
from gateway.errors import ApiError, ErrorShape, stream_error
from gateway.metrics import GatewayMetrics
from gateway.pinning import pin_rank
from gateway.pool import Pool, Prepared
from gateway.registry import Registry
from gateway.request_log import RequestLog
from gateway.requests import ClientRequest
from gateway.routing.policy import Decision
from gateway.routing.router import NoCandidates

__all__ = ["REQUEST_ID", "Proxy", "Usage", "parse_usage"]

#: the request id (client's x-request-id when well-formed, else generated), set by the server
REQUEST_ID = web.RequestKey("request_id", str)

log = logging.getLogger(__name__)

#: never forwarded in either direction (RFC 9110 hop-by-hop, plus what aiohttp recomputes)
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Content-Encoding",
    )
)  # fmt: skip
#: upstream URLs kept parsed (worker x API path), at most
_MAX_URLS = 4096
#: how long an SGLang prefill half may still answer after its decode half has (its usage)
_PREFILL_GRACE_S = 30.0
#: client headers forwarded upstream (everything else is dropped: no spoofing, no credentials)
FORWARD_REQUEST = frozenset(("accept", "user-agent", "x-request-id", "traceparent", "tracestate"))


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


USAGE = web.RequestKey("usage", Usage)  # the response's usage, once read


def _cached(usage: Usage | None) -> int | None:
    return None if usage is None else usage.cached_tokens


def parse_usage(obj: Any) -> Usage | None:
    """Usage from an OpenAI body/chunk (``usage``), a Responses one (``usage`` with
    ``input_tokens``, or under ``response``), an Anthropic one (``usage`` with
    ``cache_read_input_tokens``, or under ``message``) or an SGLang one (``meta_info``)."""
    if isinstance(obj, list):  # SGLang batch
        parts = [u for u in map(parse_usage, obj) if u is not None]
        if not parts:
            return None
        return Usage(
            *(
                sum(getattr(u, f) for u in parts)
                for f in ("prompt_tokens", "cached_tokens", "completion_tokens")
            )
        )
    if not isinstance(obj, dict):
        return None
    inner = obj.get("response") or obj.get("message")
    if not isinstance(obj.get("usage"), dict) and isinstance(inner, dict):
        obj = inner  # Responses' response.completed, Anthropic's message_start
    u = obj.get("usage")
    if isinstance(u, dict) and "input_tokens" in u:
        return _input_usage(u)
    if isinstance(u, dict):
        details = u.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Usage(_int(u.get("prompt_tokens")), _int(cached), _int(u.get("completion_tokens")))
    m = obj.get("meta_info")
    if isinstance(m, dict):
        return Usage(
            _int(m.get("prompt_tokens")),
            _int(m.get("cached_tokens")),
            _int(m.get("completion_tokens")),
        )
    return None


def _input_usage(u: dict[str, Any]) -> Usage:
    """Responses usage (``input_tokens`` counts all) or Anthropic's (``input_tokens`` counts
    the uncached part; ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` the
    rest)."""
    details = u.get("input_tokens_details")
    if isinstance(details, dict):
        return Usage(
            _int(u.get("input_tokens")),
            _int(details.get("cached_tokens")),
            _int(u.get("output_tokens")),
        )
    cached = _int(u.get("cache_read_input_tokens"))
    prompt = _int(u.get("input_tokens")) + cached + _int(u.get("cache_creation_input_tokens"))
    return Usage(prompt, cached, _int(u.get("output_tokens")))


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


class _SseResponse(web.StreamResponse):
    """A streamed response whose headers leave with its first chunk.

    ``StreamResponse.prepare`` otherwise sends the headers on their own; on loopback every
    send costs a syscall plus the receiver's network processing, so coalescing saves one
    per request (measured: ~0.3 ms each on the 2-core test machine).
    """

    _send_headers_immediately = False


class TimedResolver(AbstractResolver):
    """aiohttp's resolver with a deadline: a worker named by a hostname whose lookup hangs
    fails over like a refused connection, after ``connect_timeout``, instead of holding its
    requests until ``first_byte_timeout`` (the session's ``sock_connect`` bound starts only
    once the address is known; its ``connect`` bound would also cut the wait for a pooled
    connection, which is queueing). Addresses skip it: aiohttp resolves no IP literal."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._inner = aiohttp.DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        try:
            async with asyncio.timeout(self.timeout):
                return await self._inner.resolve(host, port, family)
        except TimeoutError:
            # a lookup error, not a timeout (aiohttp would report a timeout as the request's
            # own, a first-byte timeout here): a ClientConnectorDNSError, a connect failure
            raise socket.gaierror(
                socket.EAI_AGAIN, f"resolving {host}: no answer in {self.timeout:g}s"
            ) from None

    async def close(self) -> None:
        await self._inner.close()


class _Retry(Exception):
    """This attempt failed before the client saw a byte: try another worker."""

    def __init__(self, cause: str, fatal: bool, message: str, worker: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.fatal = fatal
        self.worker = worker  # the worker that failed (None: the attempt's own)


class _Answered(Exception):
    """A prefill worker refused the request itself (a 4xx): its answer is the client's."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(f"prefill answered {response.status}")
        self.response = response


class Proxy:
    def __init__(
        self,
        settings: ProxySettings,
        registry: Registry,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.metrics = metrics
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None
        #: set by the gateway when ``request_log.path`` is configured
        self.request_log: RequestLog | None = None
        self._urls: dict[tuple[str, str], URL] = {}
        self._prefills: set[asyncio.Task[Any]] = set()  # see _finish_prefill

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=self.settings.connections_per_worker,
            keepalive_timeout=60,
            resolver=TimedResolver(self.settings.connect_timeout),
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout),
            auto_decompress=False,
            # a worker's Set-Cookie must never ride on other clients' requests (and a jar
            # filters cookies for every request: CPU for nothing)
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        for task in list(self._prefills):
            task.cancel()
        await asyncio.gather(*self._prefills, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Proxy.start() was not called"
        return self._session

    def _url(self, base: str, path: str) -> URL:
        """``base + path`` parsed once: aiohttp would parse the string on every request."""
        url = self._urls.get((base, path))
        if url is None:
            if len(self._urls) >= _MAX_URLS:  # workers come and go: stay bounded
                self._urls.clear()
            url = self._urls[base, path] = URL(base + path)
        return url

    # -- one client request -----------------------------------------------------------------

    async def forward(
        self,
        request: web.Request,
        creq: ClientRequest,
        pool: Pool,
        prep: Prepared,
        path: str,
        session_key: str | None,
        skip: frozenset[str] = frozenset(),
    ) -> web.StreamResponse:
        """``skip``: workers that cannot serve this request (their engine lacks the API)."""
        s = self.settings
        inject_usage = (
            creq.stream and creq.kind in ("chat", "completion") and not creq.include_usage
        )
        body = prep.body or creq.raw
        if inject_usage:
            body = _with_usage(body, creq)
        headers = self._upstream_headers(request)
        tried: set[str] = set(skip)
        last: _Retry | None = None
        for attempt in range(s.max_retries + 1):
            if attempt:
                await asyncio.sleep(s.retry_backoff * 2 ** (attempt - 1))
            now = self.clock()
            exclude = self.registry.exclude(pool, now, tried)
            t0 = time.perf_counter()
            try:
                decision = pool.router.route(
                    prep.keys,
                    prep.prompt_tokens,
                    now,
                    session_key=session_key,
                    exclude=exclude,
                    untrusted=self.registry.trust.untrusted,
                    adapter=prep.adapter,
                )
                decode = None
                if pool.disaggregated:
                    decode = pool.decode_router.route(
                        prep.keys, prep.prompt_tokens, now, session_key=session_key,
                        exclude=exclude, adapter=prep.adapter,
                        untrusted=self.registry.trust.untrusted,
                    )  # fmt: skip
            except NoCandidates:
                break
            self.metrics.decision.labels(pool.name).observe(time.perf_counter() - t0)
            if prep.pending:  # decided on the known ids: the rest is speculated there too
                prep.routes.append((decision, now))
            asyncio.get_running_loop().call_soon(pool.settle, prep)  # once forwarded
            try:
                if decode is not None:
                    response = await self._attempt_pair(
                        request, creq, pool, prep, path, body, headers, decision, decode,
                        inject_usage,
                    )  # fmt: skip
                else:
                    response = await self._attempt(
                        request, creq, pool, prep, path, body, headers, decision, inject_usage
                    )
            except _Answered as exc:
                return exc.response
            except _Retry as exc:
                last = exc
                failed = exc.worker or decision.worker
                tried.add(failed)
                self.metrics.retries.labels(pool.name, failed, exc.cause).inc()
                log.info("retrying request away from %s: %s", failed, exc)
                continue
            except (asyncio.CancelledError, ConnectionResetError):
                # the client left (aiohttp cancels the handler, or a write to its closing
                # connection fails first); if the worker's usage was read, its answer was
                # whole (the client left once it had it): the request was served, and counts
                # as such
                if USAGE in request:
                    self._served(request, pool, prep, decision, decode, exclude, session_key,
                                 now, 200)  # fmt: skip
                raise
            self._served(
                request, pool, prep, decision, decode, exclude, session_key, now, response.status
            )
            return response
        if last is not None:
            raise ApiError(
                502,
                f"no worker could serve the request (last error: {last})",
                "upstream_error",
                code="upstream_failed",
                headers={"Retry-After": "1"},
            )
        raise ApiError(
            503,
            f"no healthy worker in pool {pool.name!r}",
            "service_unavailable",
            code="no_healthy_worker",
            headers={"Retry-After": "1"},
        )

    async def _attempt(
        self,
        request: web.Request,
        creq: ClientRequest,
        pool: Pool,
        prep: Prepared,
        path: str,
        body: bytes,
        headers: dict[str, str],
        decision: Decision,
        inject_usage: bool,
        prefill: Decision | None = None,
    ) -> web.StreamResponse:
        """Send the request to ``decision.worker`` and relay its answer. ``prefill``: the
        request is the decode half of a disaggregated pair (the decode router's worker)."""
        wid = decision.worker
        entry = self.registry.workers[wid]
        router = pool.router if prefill is None else pool.decode_router
        m = self.metrics
        ws = m.worker(pool.name, wid)
        self.registry.on_send(wid)
        ticket = router.started(decision, prep.prompt_tokens, self.clock(), prep.adapter)
        ws.inflight.inc()
        m.gateway_inflight.inc()
        # One deadline covers the response headers and the first body chunk: engines send
        # nothing at all until their first token, so a stuck worker stalls in post().
        deadline = asyncio.get_running_loop().time() + self.settings.first_byte_timeout
        if entry.info is not None and entry.info.dp_rank is not None:
            info = entry.info
            body, headers = pin_rank(info.engine, info.dp_rank, body, creq.body, headers)
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    resp = await self.session.post(
                        self._url(entry.url, path), data=body, headers=headers
                    )
            except TimeoutError:
                raise self._first_byte_timeout(wid) from None
            except aiohttp.ClientConnectorError as exc:
                self.registry.on_failure(wid, self.clock(), fatal=True)
                raise _Retry(
                    "connect", True, f"cannot connect to {wid}: {exc.strerror or exc}"
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                self.registry.on_failure(wid, self.clock(), fatal=False)
                raise _Retry("send", False, f"{wid} failed before answering: {exc!r}") from None
            async with resp:
                if resp.status in self.settings.retry_statuses:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(resp.read(), self.settings.connect_timeout)
                    if resp.status != 429:  # 429: busy, not broken
                        self.registry.on_failure(wid, self.clock(), fatal=False)
                    raise _Retry(f"http_{resp.status}", False, f"{wid} answered {resp.status}")
                first = await self._first_chunk(resp, wid, deadline)
                now = self.clock()
                router.first_token(ticket, now)
                ws.ttft.observe(now - ticket.sent_at)
                if prep.rest is not None:  # the exact ids (encoded meanwhile) decide
                    held = time.perf_counter() if prep.pending else None
                    await prep.ready()
                    waited = 0.0 if held is None else time.perf_counter() - held
                    m.tokenize_overlap_wait.labels(pool.name).observe(waited)
                    decision = prep.exact(decision)
                m.requests.labels(pool.name, wid, decision.reason).inc()
                ws.prompt_tokens.inc(prep.prompt_tokens)
                ws.matched_tokens.inc(decision.matched_tokens)
                if resp.status >= 400:
                    return await self._error_response(resp, first, pool, wid)
                headers = self._client_headers(resp, decision, request, prefill)
                if creq.stream and resp.headers.get("content-type", "").startswith(
                    "text/event-stream"
                ):
                    out = _SseResponse(
                        status=resp.status, headers={**headers, "cache-control": "no-cache"}
                    )
                    return await self._stream(
                        request, resp, out, first, pool, wid, inject_usage, APIS[creq.kind].errors
                    )
                data = first + await self._rest(resp, wid)
                self._count_usage(pool, wid, _json(data), request)
                self.registry.on_success(wid)
                return web.Response(status=resp.status, headers=headers, body=data)
        finally:
            router.finished(ticket, self.clock())
            ws.inflight.dec()
            m.gateway_inflight.dec()

    def _first_byte_timeout(self, wid: str) -> _Retry:
        """Nothing from ``wid`` before the first-byte deadline: count it against the
        worker (not fatal: it may be busy, not dead) and retry elsewhere."""
        self.registry.on_failure(wid, self.clock(), fatal=False)
        return _Retry(
            "first_byte_timeout",
            False,
            f"{wid} sent nothing for {self.settings.first_byte_timeout:g}s",
        )

    async def _first_chunk(self, resp: aiohttp.ClientResponse, wid: str, deadline: float) -> bytes:
        """The first body bytes, or a retry (the client has not been answered yet)."""
        try:
            async with asyncio.timeout_at(deadline):
                first = await resp.content.readany()
        except TimeoutError:
            raise self._first_byte_timeout(wid) from None
        except (aiohttp.ClientError, OSError) as exc:
            self.registry.on_failure(wid, self.clock(), fatal=False)
            raise _Retry("broken", False, f"{wid} broke before the first byte: {exc!r}") from None
        if not first and resp.status < 400:
            self.registry.on_failure(wid, self.clock(), fatal=False)
            raise _Retry("empty", False, f"{wid} closed the response without a body")
        return first

    async def _rest(self, resp: aiohttp.ClientResponse, wid: str) -> bytes:
        chunks: list[bytes] = []
        while True:
            try:
                async with asyncio.timeout(self.settings.idle_timeout):
                    chunk = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                self.registry.on_failure(wid, self.clock(), fatal=False)
                raise ApiError(
                    502,
                    f"worker {wid} failed while answering: {exc!r}",
                    "upstream_error",
                    code="upstream_broken",
                ) from None
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    async def _error_response(
        self, resp: aiohttp.ClientResponse, first: bytes, pool: Pool, wid: str
    ) -> web.Response:
        data = first + await self._rest(resp, wid)
        if resp.status < 500:
            self.registry.on_success(wid)  # the worker is fine; the request was not
            # passed through as it is, but an error all the same (5xx become an ApiError)
            self.metrics.errors.labels(pool.name, str(resp.status), "engine_error").inc()
            return web.Response(status=resp.status, body=data, content_type="application/json")
        self.registry.on_failure(wid, self.clock(), fatal=False)
        detail = data[:500].decode("utf-8", "replace")
        raise ApiError(
            502,
            f"worker {wid} failed with {resp.status}: {detail}",
            "upstream_error",
            code="upstream_error",
        )

    def _client_headers(
        self,
        resp: aiohttp.ClientResponse,
        decision: Decision,
        request: web.Request,
        prefill: Decision | None = None,
    ) -> dict[str, str]:
        """The worker's response headers minus hop-by-hop ones, plus the routing headers
        (a disaggregated pair: the decode worker's, and the prefill worker's match)."""
        headers = {
            k: v
            for k, v in resp.headers.items()
            if k.lower() not in HOP_BY_HOP and not k.lower().startswith("x-kvroute-")
        }
        headers["x-kvroute-worker"] = decision.worker
        headers["x-kvroute-matched-tokens"] = str(decision.matched_tokens)
        headers["x-kvroute-reason"] = decision.reason
        if decision.predicted_ttft_ms is not None:
            headers["x-kvroute-predicted-ttft-ms"] = f"{decision.predicted_ttft_ms:.1f}"
        if prefill is not None:
            headers["x-kvroute-prefill-worker"] = prefill.worker
            headers["x-kvroute-prefill-matched-tokens"] = str(prefill.matched_tokens)
        headers["x-request-id"] = request[REQUEST_ID]
        return headers

    # -- prefill/decode disaggregation (gateway.disagg) -------------------------------------

    async def _attempt_pair(
        self,
        request: web.Request,
        creq: ClientRequest,
        pool: Pool,
        prep: Prepared,
        path: str,
        body: bytes,
        headers: dict[str, str],
        prefill: Decision,
        decode: Decision,
        inject_usage: bool,
    ) -> web.StreamResponse:
        """One disaggregated attempt: the prefill worker ``prefill``, then (vLLM) or with
        (SGLang) the decode worker ``decode``, in the decode engine's protocol. A failure of
        either half before the client saw a byte retries the pair without the failed one;
        the halves live and die together (a cancelled request cancels both)."""
        entry = self.registry.workers[decode.worker]
        engine = entry.info.engine if entry.info is not None else "vllm"
        if engine == "sglang":
            return await self._pair_sglang(
                request, creq, pool, prep, path, body, headers, prefill, decode, inject_usage
            )
        params = await self._prefill(pool, prep, path, vllm_prefill_body(body), headers, prefill)
        return await self._decode(
            request, creq, pool, prep, path, vllm_decode_body(body, params), headers, decode,
            inject_usage, prefill,
        )  # fmt: skip

    async def _pair_sglang(
        self,
        request: web.Request,
        creq: ClientRequest,
        pool: Pool,
        prep: Prepared,
        path: str,
        body: bytes,
        headers: dict[str, str],
        prefill: Decision,
        decode: Decision,
        inject_usage: bool,
    ) -> web.StreamResponse:
        entry = self.registry.workers[prefill.worker]
        port = entry.info.bootstrap_port if entry.info is not None else None
        host = urlsplit(entry.url).hostname
        if port is None or host is None:
            raise _Retry(
                "no_bootstrap", False, f"{prefill.worker} registered no bootstrap port",
                prefill.worker,
            )  # fmt: skip
        pair = sglang_pair_body(body, host, port, new_room())
        first = asyncio.create_task(self._prefill(pool, prep, path, pair, headers, prefill))
        second = asyncio.create_task(
            self._decode(
                request, creq, pool, prep, path, pair, headers, decode, inject_usage, prefill
            )
        )
        try:
            await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
            if first.done() and first.exception() is not None and not second.done():
                # the prefill half failed before its answer began: the decode half waits for
                # KV that will not come and has sent the client nothing yet
                raise first.exception()  # type: ignore[misc]
            answer = await second
        except BaseException:
            if second.done() and not second.cancelled() and second.exception() is None:
                # the client had its whole answer and left (its handler cancelled): the
                # prefill half is read to its end all the same
                self._finish_prefill(first)
                raise
            for task in (first, second):
                task.cancel()
            await asyncio.gather(first, second, return_exceptions=True)
            raise
        self._finish_prefill(first)
        return answer

    def _finish_prefill(self, task: asyncio.Task[Any]) -> None:
        """The decode half has answered the client; the prefill half's own answer may still
        be arriving (SGLang's prefill server ends it after the KV transfer). It carries what
        that worker reused (its precision), so it is read to its end off the client's path,
        for at most ``_PREFILL_GRACE_S``, instead of being cancelled unread."""
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: a failure there was the decode's to report
            return
        self._prefills.add(task)
        timer = asyncio.get_running_loop().call_later(_PREFILL_GRACE_S, task.cancel)

        def done(t: asyncio.Task[Any]) -> None:
            timer.cancel()
            self._prefills.discard(t)
            if not t.cancelled():
                t.exception()

        task.add_done_callback(done)

    async def _prefill(
        self,
        pool: Pool,
        prep: Prepared,
        path: str,
        body: bytes,
        headers: dict[str, str],
        decision: Decision,
    ) -> dict[str, Any]:
        """The prefill half: its ``kv_transfer_params`` (vLLM; SGLang's answer is read and
        dropped, ``{}``). Raises _Retry (blaming the prefill worker) when it fails, and
        _Answered when it refuses the request itself (the client's error)."""
        wid = decision.worker
        entry = self.registry.workers[wid]
        router, m = pool.router, self.metrics
        if entry.info is not None and entry.info.dp_rank is not None:
            body, headers = pin_rank(entry.info.engine, entry.info.dp_rank, body, {}, headers)
        self.registry.on_send(wid)
        ticket = router.started(decision, prep.prompt_tokens, self.clock(), prep.adapter)
        m.inflight.labels(pool.name, wid).inc()
        try:
            try:
                async with asyncio.timeout(self.settings.first_byte_timeout):
                    resp = await self.session.post(entry.url + path, data=body, headers=headers)
            except TimeoutError:
                raise _with_worker(self._first_byte_timeout(wid), wid) from None
            except aiohttp.ClientConnectorError as exc:
                self.registry.on_failure(wid, self.clock(), fatal=True)
                raise _Retry("connect", True, f"cannot connect to {wid}: {exc}", wid) from None
            except (aiohttp.ClientError, OSError) as exc:
                self.registry.on_failure(wid, self.clock(), fatal=False)
                raise _Retry("send", False, f"{wid} failed: {exc!r}", wid) from None
            async with resp:
                router.first_token(ticket, self.clock())
                m.requests.labels(pool.name, wid, "prefill").inc()
                m.matched_tokens.labels(pool.name, wid).inc(decision.matched_tokens)
                m.prompt_tokens.labels(pool.name, wid).inc(prep.prompt_tokens)
                if resp.status in self.settings.retry_statuses or resp.status >= 500:
                    self.registry.on_failure(wid, self.clock(), fatal=False)
                    raise _Retry(f"http_{resp.status}", False, f"{wid} answered {resp.status}", wid)
                if resp.status >= 400:  # the request itself is bad: no other worker helps
                    data = await resp.read()
                    raise _Answered(
                        web.Response(status=resp.status, body=data, content_type="application/json")
                    )
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with asyncio.timeout(self.settings.idle_timeout):
                        data = await resp.read()
                    self.registry.on_success(wid)
                    if not isinstance(params := _json(data), dict):
                        params = {}
                    # the prefill worker's own precision: its prediction against the cache
                    # it reported reusing (the decode's usage speaks for the decode worker);
                    # SGLang's prefill answers a streamed request with a stream
                    usage = parse_usage(params or _stream_usage(data))
                    self.registry.observe(pool.name, decision, _cached(usage), self.clock())
                    kv = params.get("kv_transfer_params")
                    return kv if isinstance(kv, dict) else {}
                return {}  # the answer broke after it began: the KV is on its way
        finally:
            router.finished(ticket, self.clock())
            m.inflight.labels(pool.name, wid).dec()

    async def _decode(
        self,
        request: web.Request,
        creq: ClientRequest,
        pool: Pool,
        prep: Prepared,
        path: str,
        body: bytes,
        headers: dict[str, str],
        decision: Decision,
        inject_usage: bool,
        prefill: Decision,
    ) -> web.StreamResponse:
        """The decode half (the client's answer); a failure blames the decode worker."""
        try:
            return await self._attempt(
                request, creq, pool, prep, path, body, headers, decision, inject_usage, prefill
            )
        except _Retry as exc:
            raise _with_worker(exc, decision.worker) from None

    async def _stream(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        out: web.StreamResponse,
        first: bytes,
        pool: Pool,
        wid: str,
        inject_usage: bool,
        shape: ErrorShape = "openai",
    ) -> web.StreamResponse:
        await out.prepare(request)
        events = _SseFilter(strip_usage=inject_usage)
        content = resp.content
        data = events.feed(first)
        if events.final:  # the whole answer came in the first chunk (a short reply)
            return await self._stream_end(request, content, out, data, events, pool, wid)
        await out.write(data)
        watch = _IdleWatch(self.settings.idle_timeout, content)
        clock = watch.loop.time
        try:
            while True:
                watch.since = clock()
                try:
                    chunk = await content.readany()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    self.registry.on_failure(wid, self.clock(), fatal=False)
                    self.metrics.stream_errors.labels(pool.name, wid).inc()
                    await _end_with_error(out, f"worker {wid} failed mid-stream: {exc!r}", shape)
                    return out
                watch.since = None  # writing to the client is not the worker's idleness
                if not chunk:
                    break
                data = events.feed(chunk)
                if events.final:
                    return await self._stream_end(request, content, out, data, events, pool, wid)
                if data:
                    await out.write(data)
        finally:
            watch.cancel()
        tail = events.flush()
        if tail:
            await out.write(tail)
        if not events.done:
            self.registry.on_failure(wid, self.clock(), fatal=False)
            self.metrics.stream_errors.labels(pool.name, wid).inc()
            await _end_with_error(out, f"worker {wid} closed the stream early", shape)
            return out
        self._count_usage(pool, wid, events.usage, request)
        self.registry.on_success(wid)
        await out.write_eof()
        return out

    async def _stream_end(
        self,
        request: web.Request,
        content: aiohttp.StreamReader,
        out: web.StreamResponse,
        data: bytes,
        events: _SseFilter,
        pool: Pool,
        wid: str,
    ) -> web.StreamResponse:
        """The stream's final event arrived: nothing may follow, so the last events leave
        with the body's end at once (the client has its whole answer), and the worker's body
        is read to its own end after that."""
        self._count_usage(pool, wid, events.usage, request)
        self.registry.on_success(wid)
        await out.write_eof(data + events.flush())
        await _drain(content, self.settings.connect_timeout)
        return out

    def _served(
        self,
        request: web.Request,
        pool: Pool,
        prep: Prepared,
        decision: Decision,
        decode: Decision | None,
        exclude: Iterable[str],
        session_key: str | None,
        decided_at: float,
        status: int,
    ) -> None:
        """A served request: its prediction judged against the usage of the worker that
        answered (a pair's decode half), and its request log record."""
        served = decode or prep.exact(decision)
        self.registry.observe(pool.name, served, _cached(request.get(USAGE)), self.clock())
        if self.request_log is not None:
            self._log_request(
                request, pool, prep, decision, exclude, session_key, decided_at, status
            )

    def _log_request(
        self,
        request: web.Request,
        pool: Pool,
        prep: Prepared,
        decision: Decision,
        exclude: Iterable[str],
        session_key: str | None,
        decided_at: float,
        status: int,
    ) -> None:
        """The request log's hook: the decision that served the request and its usage."""
        assert self.request_log is not None
        ex = set(exclude)
        try:
            self.request_log.record(
                pool.name,
                pool.router.block_size,
                prep.keys.all(),
                prep.prompt_tokens,
                decision,
                [w for w in pool.router.workers() if w not in ex],
                self.clock() - decided_at,
                request.get(USAGE),
                status,
                session_key,
            )
        except Exception:  # the log must never fail a request that was served
            log.exception("request log: record failed")

    def _count_usage(
        self, pool: Pool, wid: str, obj: Any, request: web.Request | None = None
    ) -> None:
        u = parse_usage(obj)
        if u is None:
            return
        if request is not None:
            request[USAGE] = u  # for the request log
        ws = self.metrics.worker(pool.name, wid)
        ws.delivered_prompt.inc(u.prompt_tokens)
        ws.delivered_cached.inc(u.cached_tokens)
        ws.completion_tokens.inc(u.completion_tokens)

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_REQUEST}
        headers["content-type"] = "application/json"
        headers["x-request-id"] = request[REQUEST_ID]
        if self.settings.upstream_api_key:
            headers["authorization"] = f"Bearer {self.settings.upstream_api_key}"
        return headers


class _IdleWatch:
    """Fails a read of a stream that waits more than ``idle`` seconds for its worker.

    One timer per stream, moved lazily: a read only stamps ``since`` (None while the
    gateway writes to the client), and the timer, when it fires early, re-arms itself at
    ``since + idle``. A timeout context around every read (a timer created, rescheduled and
    cancelled per SSE chunk) cost ~5% of a streamed request's CPU. Expiry fails the read
    as aiohttp's own read timeout does: the body's reader gets the exception, and the
    pending ``readany`` raises it."""

    def __init__(self, idle: float, content: aiohttp.StreamReader) -> None:
        self.loop = asyncio.get_running_loop()
        self.idle = idle
        self.content = content
        self.since: float | None = None
        self._timer: asyncio.TimerHandle | None = self.loop.call_later(idle, self._due)

    def _due(self) -> None:
        now = self.loop.time()
        due = now + self.idle if self.since is None else self.since + self.idle
        if now < due:
            self._timer = self.loop.call_at(due, self._due)
            return
        self._timer = None
        self.content.set_exception(TimeoutError(f"no data for {self.idle:g}s"))

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


#: named SSE events after which a stream is whole (Responses' terminal events, Messages' end)
_TERMINAL_EVENTS = frozenset(
    (b"response.completed", b"response.incomplete", b"response.failed", b"message_stop")
)
#: ...and after which nothing follows (Messages: vLLM still sends ``data: [DONE]``)
_FINAL_EVENTS = frozenset((b"response.completed", b"response.incomplete", b"response.failed"))


class _SseFilter:
    """Splits an SSE byte stream into events; drops the injected usage chunk; keeps usage.

    ``done``: the stream is whole; ``final``: nothing can follow (end the response now)."""

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.buf = b""
        self.usage: Any = None
        self.done = False
        self.final = False
        self.last_data: bytes | None = None

    def feed(self, chunk: bytes) -> bytes:
        if (
            not self.buf
            and chunk.endswith(b"\n\n")
            and b"usage" not in chunk
            and b"[DONE]" not in chunk
            and b"meta_info" not in chunk
            and b"event:" not in chunk
        ):
            return chunk  # whole events, none of them one this filter acts on: as they are
        self.buf += chunk
        if b"\n\n" not in self.buf:
            return b""
        head, _, self.buf = self.buf.rpartition(b"\n\n")
        out = []
        for event in head.split(b"\n\n"):
            if self._keep(event):
                out.append(event)
        return b"\n\n".join(out) + b"\n\n" if out else b""

    def flush(self) -> bytes:
        rest, self.buf = self.buf, b""
        if rest.strip() and self._keep(rest.rstrip(b"\n")):
            return rest
        return b""

    def _keep(self, event: bytes) -> bool:
        if event.startswith(b"event:"):
            return self._named(event)
        data = event[5:].strip() if event.startswith(b"data:") else None
        if data is None:
            return True
        if data == b"[DONE]":
            self.done = self.final = True
            if self.usage is None and self.last_data is not None:
                self.usage = _json(self.last_data)  # SGLang: meta_info in the last event
            return True
        if b'"usage":' in data and (b'"usage":{' in data or b'"usage": {' in data):
            obj = _json(data)
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj
                if self.strip_usage and not obj.get("choices"):
                    return False
        elif b'"meta_info"' in data:
            self.last_data = data
        return True

    def _named(self, event: bytes) -> bool:
        """An ``event: NAME`` + ``data:`` event (Responses, Messages): relayed as it is."""
        head, _, data = event.partition(b"\n")
        name = head[6:].strip()
        if name in _TERMINAL_EVENTS or (b"usage" in data and name in _USAGE_EVENTS):
            obj = _json(data[5:] if data.startswith(b"data:") else data)
            if parse_usage(obj) is not None:
                self.usage = obj
        if name in _TERMINAL_EVENTS:
            self.done = True
            self.final = name in _FINAL_EVENTS
        return True


#: named events that carry usage (Messages: input in message_start, totals in message_delta)
_USAGE_EVENTS = frozenset((b"message_start", b"message_delta"))


async def _end_with_error(
    out: web.StreamResponse, message: str, shape: ErrorShape = "openai"
) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):
        await out.write(stream_error(shape, message))
        await out.write_eof()


async def _drain(content: aiohttp.StreamReader, seconds: float) -> None:
    """Read a finished stream's body to its end (the chunked terminator follows the last
    event), so its connection goes back to the pool instead of being closed: a stream that
    stopped reading early cost the next request a new TCP connection. Bounded by ``seconds``:
    a worker still sending after that has its connection closed, as before. The client has
    its whole answer by now and may leave, cancelling the handler here: the request still
    counts as served (``Proxy.forward``)."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
        async with asyncio.timeout(seconds):
            while await content.readany():
                pass


def _with_worker(exc: _Retry, worker: str) -> _Retry:
    exc.worker = exc.worker or worker
    return exc


def _stream_usage(data: bytes) -> Any:
    """The usage-bearing object of a whole SSE answer (None if it carries none)."""
    events = _SseFilter(strip_usage=False)
    events.feed(data)
    events.flush()
    return events.usage


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None


def _with_usage(body: bytes, creq: ClientRequest) -> bytes:
    """``body`` asking for the usage chunk at the end of the stream.

    Without ``stream_options`` in the request (the common case) the member is spliced in
    after the opening brace instead of re-encoding a body that may hold 8,000 tokens.
    """
    if "stream_options" not in creq.body:
        brace = body.index(b"{")
        return body[: brace + 1] + b'"stream_options":{"include_usage":true},' + body[brace + 1 :]
    obj = json.loads(body)
    obj["stream_options"] = {**(obj.get("stream_options") or {}), "include_usage": True}
    return json.dumps(obj, ensure_ascii=False).encode()


def new_request_id() -> str:
    return f"kvr-{uuid.uuid4().hex}"
