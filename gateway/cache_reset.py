"""Clearing the workers' prefix caches through the gateway (admin ``/reset_prefix_cache``,
``/flush_cache``; ``aiperf --reset-kv-cache`` calls it between runs).

The call fans out to every worker of the pools named, each through its engine's own endpoint:
vLLM's ``POST /reset_prefix_cache`` (served only with ``VLLM_SERVER_DEV_MODE=1``; it refuses
while blocks are in use) and SGLang's ``POST /flush_cache`` (refused while requests run). A
worker of unknown engine (static) is tried with vLLM's, then SGLang's. The gateway's index is
not touched here: each engine that clears emits ``AllBlocksCleared``, its agent publishes a
clear, and the index follows from the event stream like for any other change.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

__all__ = ["ENGINE_RESET_PATHS", "ResetResult", "ResetTarget", "reset_caches"]

#: each engine's own cache-clearing endpoint
ENGINE_RESET_PATHS = {"vllm": "/reset_prefix_cache", "sglang": "/flush_cache"}
#: vLLM's query parameters the gateway passes on
VLLM_RESET_PARAMS = ("reset_running_requests", "reset_external")


@dataclass(frozen=True)
class ResetTarget:
    worker: str
    url: str
    pool: str
    engine: str | None


@dataclass
class ResetResult:
    worker: str
    pool: str
    engine: str | None
    endpoint: str
    #: the engine's HTTP status (0: no answer)
    status: int
    success: bool
    detail: str


async def reset_caches(
    session: aiohttp.ClientSession,
    targets: list[ResetTarget],
    headers: Mapping[str, str],
    params: Mapping[str, str],
    wait_s: float,
) -> list[ResetResult]:
    """Every target's cache cleared at once; one result per worker, failures included."""
    return list(
        await asyncio.gather(*(_reset(session, t, headers, params, wait_s) for t in targets))
    )


async def _reset(
    session: aiohttp.ClientSession,
    target: ResetTarget,
    headers: Mapping[str, str],
    params: Mapping[str, str],
    wait_s: float,
) -> ResetResult:
    engines = [target.engine] if target.engine in ENGINE_RESET_PATHS else ["vllm", "sglang"]
    result: ResetResult | None = None
    for engine in engines:
        result = await _call(session, target, engine, headers, params, wait_s)
        if result.status != 404:
            break
    assert result is not None
    if result.status == 404 and target.engine == "vllm":
        result.detail = "vLLM serves /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1"
    return result


async def _call(
    session: aiohttp.ClientSession,
    target: ResetTarget,
    engine: str,
    headers: Mapping[str, str],
    params: Mapping[str, str],
    wait_s: float,
) -> ResetResult:
    path = ENGINE_RESET_PATHS[engine]
    query = {k: v for k, v in params.items() if k in VLLM_RESET_PARAMS} if engine == "vllm" else {}
    try:
        async with session.post(
            target.url + path,
            params=query,
            headers=dict(headers),
            timeout=aiohttp.ClientTimeout(total=wait_s),
        ) as resp:
            text = (await resp.read()).decode("utf-8", "replace")
            status = resp.status
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return ResetResult(
            target.worker, target.pool, target.engine, path, 0, False, f"no answer: {exc!r}"
        )
    success = status == 200 and _says_success(text)
    return ResetResult(
        target.worker, target.pool, target.engine, path, status, success, text.strip()[:500]
    )


def _says_success(text: str) -> bool:
    """vLLM answers ``{"success": bool}`` (older versions an empty 200), SGLang plain text."""
    try:
        body = json.loads(text)
    except ValueError:
        return True
    return not (isinstance(body, dict) and body.get("success") is False)
