"""Open-loop load driver: send a workload to an OpenAI-compatible endpoint and measure it.

Every request starts at its scheduled time whatever happened to the others (open loop), is
streamed, and is timed from send to first token (TTFT), between tokens (ITL) and to the end.
Delivered cache hits come from the engine's ``usage.prompt_tokens_details.cached_tokens``.
The run is bounded in requests and time and stops by itself: after ``max_duration`` no new
request starts; after ``drain_timeout`` more, whatever is still running is cancelled and
counted as failed. A request so cut after its first token still has its measured TTFT: the
TTFT figures and goodput count it (``RequestRecord.timed``), so that a system whose slow
requests are still running at the cut is not credited with dropping them from its
percentiles; e2e, ITL and the hit rate (no usage) count completed requests only.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import aiohttp
from tqdm import tqdm

from loadtest.workloads import WorkItem

__all__ = ["CUT", "DriverConfig", "LoadResult", "RequestRecord", "run_load", "summarize"]

#: the error of a request still running when the run's drain timeout ends it
CUT = "cancelled at the end of the run"

Mode = Literal["chat", "completion", "completion_ids"]


@dataclass
class DriverConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (the /v1/... paths are appended)
    model: str
    mode: Mode = "completion"
    max_requests: int | None = None
    max_duration: float = 600.0  # seconds after which no new request starts
    drain_timeout: float = 120.0  # then seconds to wait for requests still running
    request_timeout: float = 300.0
    slo_ttft_ms: float = 2000.0
    headers: dict[str, str] = field(default_factory=dict)
    progress: bool = True
    label: str = ""


@dataclass
class RequestRecord:
    index: int
    session: str
    scheduled: float  # seconds after start
    sent: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None
    #: the endpoint (gateway replica) the request was sent to
    endpoint: str = ""
    status: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def timed(self) -> bool:
        """Its TTFT is a measurement: it completed, or the run's end cut it after its first
        token (the driver's cut, not the system's failure)."""
        return self.ttft is not None and (self.ok or (self.status == 200 and self.error == CUT))


@dataclass
class LoadResult:
    config: dict[str, Any]
    records: list[RequestRecord]
    duration: float
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "summary": self.summary}


def _payload(item: WorkItem, cfg: DriverConfig) -> tuple[str, dict[str, Any]]:
    common = {
        "model": item.model or cfg.model,
        "max_tokens": item.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    if cfg.mode == "chat":
        return "/v1/chat/completions", {**common, "messages": item.messages()}
    if cfg.mode == "completion_ids":
        return "/v1/completions", {**common, "prompt": item.prompt_ids()}
    return "/v1/completions", {**common, "prompt": item.prompt_text()}


async def _one(
    session: aiohttp.ClientSession,
    item: WorkItem,
    cfg: DriverConfig,
    base: str,
    t0: float,
    rec: RequestRecord,
) -> None:
    path, body = _payload(item, cfg)
    headers = {"content-type": "application/json", "x-session-id": item.session, **cfg.headers}
    rec.sent = time.monotonic() - t0
    rec.endpoint = base
    start = time.monotonic()
    last = start
    try:
        async with session.post(base + path, data=json.dumps(body), headers=headers) as resp:
            rec.status = resp.status
            rec.worker = resp.headers.get("x-kvroute-worker")
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
                return
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data:"):
                        continue
                    data = event[5:].strip()
                    if data == b"[DONE]":
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.error = f"stream error: {obj['error'].get('message')}"
                        continue
                    now = time.monotonic()
                    choices = obj.get("choices") or []
                    if choices and _has_token(choices[0]):
                        if rec.ttft is None:
                            rec.ttft = now - start
                        else:
                            rec.itl.append(now - last)
                        last = now
                        rec.output_tokens += 1
                    usage = obj.get("usage")
                    if isinstance(usage, dict):
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        rec.output_tokens = int(usage.get("completion_tokens") or rec.output_tokens)
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = int(details.get("cached_tokens") or 0)
            rec.e2e = time.monotonic() - start
            if rec.ttft is None and rec.error is None:
                rec.error = "stream ended without a token"
    except asyncio.CancelledError:
        rec.error = rec.error or CUT  # a stream error before the cut stays the reason
        raise
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


def _has_token(choice: dict[str, Any]) -> bool:
    if "text" in choice:
        return bool(choice["text"])
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


async def run_load(
    items: Sequence[WorkItem], cfg: DriverConfig, base_urls: Sequence[str] | None = None
) -> LoadResult:
    """Send ``items`` at their scheduled times; returns every record and a summary.

    ``base_urls``: several endpoints (gateway replicas) used in turn, like a round-robin
    load balancer in front of them; default ``[cfg.base_url]``.
    """
    urls = list(base_urls or [cfg.base_url])
    todo = list(items[: cfg.max_requests] if cfg.max_requests else items)
    records = [RequestRecord(it.index, it.session, it.at) for it in todo]
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    bar = tqdm(
        total=len(todo),
        desc=cfg.label or "load",
        unit="req",
        disable=not cfg.progress,
        leave=False,
        mininterval=0.5,
    )
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.monotonic()
        for n, (it, rec) in enumerate(zip(todo, records, strict=True)):
            if it.at > cfg.max_duration:
                rec.error = "not sent: beyond max_duration"
                continue
            delay = t0 + it.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(session, it, cfg, urls[n % len(urls)], t0, rec))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        _, pending = (
            await asyncio.wait(tasks, timeout=cfg.drain_timeout) if tasks else (set(), set())
        )
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        duration = time.monotonic() - t0
    bar.close()
    sent = [r for r in records if r.error != "not sent: beyond max_duration"]
    return LoadResult(
        {k: v for k, v in asdict(cfg).items() if k != "headers"},
        records,
        duration,
        summarize(sent, duration, cfg.slo_ttft_ms),
    )


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 2)


def summarize(
    records: Sequence[RequestRecord], duration: float, slo_ttft_ms: float
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in records if r.timed and r.ttft is not None]
    itls = [x for r in ok for x in r.itl]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_worker: dict[str, dict[str, float]] = defaultdict(
        lambda: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
    )
    for r in ok:
        if r.worker:
            w = per_worker[r.worker]
            w["requests"] += 1
            w["prompt_tokens"] += r.prompt_tokens
            w["cached_tokens"] += r.cached_tokens
    for w in per_worker.values():
        w["hit_rate"] = (
            round(w["cached_tokens"] / w["prompt_tokens"], 4) if w["prompt_tokens"] else 0.0
        )
    good = sum(
        1 for r in records if r.timed and r.ttft is not None and r.ttft * 1000 <= slo_ttft_ms
    )
    errors: dict[str, int] = defaultdict(int)
    for r in records:
        if not r.ok:
            errors[(r.error or f"HTTP {r.status}").split(":")[0]] += 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(errors),
        "duration_s": round(duration, 2),
        "throughput_rps": round(len(ok) / duration, 3) if duration > 0 else 0.0,
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / duration, 1)
        if duration > 0
        else 0.0,
        "ttft_p50_ms": _ms(_pct(ttfts, 0.5)),
        "ttft_p90_ms": _ms(_pct(ttfts, 0.9)),
        "ttft_p99_ms": _ms(_pct(ttfts, 0.99)),
        "ttft_mean_ms": _ms(sum(ttfts) / len(ttfts)) if ttfts else None,
        "itl_p50_ms": _ms(_pct(itls, 0.5)),
        "itl_p99_ms": _ms(_pct(itls, 0.99)),
        "e2e_p50_ms": _ms(_pct(e2es, 0.5)),
        "e2e_p99_ms": _ms(_pct(e2es, 0.99)),
        "slo_ttft_ms": slo_ttft_ms,
        "goodput": round(good / len(records), 4) if records else 0.0,
        "goodput_rps": round(good / duration, 3) if duration > 0 else 0.0,
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "per_worker": dict(per_worker),
        **balance(
            {w: v["requests"] for w, v in per_worker.items()},
            {w: v["prompt_tokens"] for w, v in per_worker.items()},
        ),
    }


def balance(requests: dict[str, float], tokens: dict[str, float]) -> dict[str, float | None]:
    """max/mean of requests and of prompt tokens per worker (1.0 = perfectly even)."""

    def ratio(xs: list[float]) -> float | None:
        if not xs or sum(xs) == 0:
            return None
        return round(max(xs) / (sum(xs) / len(xs)), 3)

    return {
        "max_mean_requests": ratio(list(requests.values())),
        "max_mean_tokens": ratio(list(tokens.values())),
    }
