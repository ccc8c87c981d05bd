"""Prefill/decode disaggregation in the simulator, in both engines' protocols.

* **vLLM** (KV connectors such as NIXL, as vLLM's own disaggregation proxy drives them): the
  router sends the prefill engine the request with ``max_tokens`` 1 and
  ``kv_transfer_params: {"do_remote_decode": true, ...}``; the prefill engine answers with
  ``kv_transfer_params`` naming where the KV waits (``remote_engine_id``, ``remote_host``,
  ``remote_port``, ``remote_request_id``, ``remote_block_ids``); the router then sends the
  decode engine the original request with those parameters (``do_remote_prefill``), and the
  decode engine pulls the KV before it generates.
* **SGLang** (``--disaggregation-mode prefill|decode``): the router sends the same request to
  both engines with ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` naming the
  prefill engine and a random room; the decode engine waits for the prefill engine to finish
  that room, pulls the KV and generates; the prefill engine's own answer is discarded.

Here the pull is an HTTP call to the prefill engine's ``/sim/pd/pull`` (the bootstrap port is
the prefill simulator's HTTP port) that waits until the KV is ready, followed by a delay
proportional to the tokens moved (those the decode engine does not already hold). A prefill
engine that restarted or died has nothing to pull: the decode request fails before its first
token, which a router can retry.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import aiohttp

from loadtest.enginesim.api import ApiError
from loadtest.enginesim.config import PdConfig

__all__ = ["FAKE_BOOTSTRAP_HOST", "Transfers", "decode_source", "pull", "vllm_prefill_params"]

#: SGLang's placeholder decode address (``sglang.srt.disaggregation.utils``): a prefill request
#: naming it runs with a fake KV sender (SGLang's own server warm-up sends it) and nothing waits
#: for a pull
FAKE_BOOTSTRAP_HOST = "2.2.2.2"

#: KV transfers a prefill engine remembers (the oldest are forgotten first)
MAX_TRANSFERS = 10_000


class Transfers:
    """A prefill engine's finished prefills, by transfer key, for decode engines to pull.

    A decode engine may ask before the prefill engine even received its half (SGLang sends
    both at once), so waiting creates the entry."""

    def __init__(self) -> None:
        self._ready: OrderedDict[str, asyncio.Future[int]] = OrderedDict()
        self.drop_next = 0  # fault: lose the KV of this many finished prefills
        self.dropped = 0

    def _entry(self, key: str) -> asyncio.Future[int]:
        fut = self._ready.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._ready[key] = fut
            while len(self._ready) > MAX_TRANSFERS:
                _, old = self._ready.popitem(last=False)
                if not old.done():
                    old.set_result(-1)
        return fut

    def done(self, key: str, tokens: int) -> None:
        """The prefill of ``key`` finished: ``tokens`` prompt tokens of KV are ready (unless
        the ``drop_next`` fault loses them, as an engine dying right after answering)."""
        if self.drop_next > 0:
            self.drop_next -= 1
            self.dropped += 1
            self.failed(key)
            return
        fut = self._entry(key)
        if not fut.done():
            fut.set_result(tokens)

    def failed(self, key: str) -> None:
        fut = self._entry(key)
        if not fut.done():
            fut.set_result(-1)

    def lose_all(self) -> None:
        """The engine died: every pending and finished transfer is gone."""
        for fut in self._ready.values():
            if not fut.done():
                fut.set_result(-1)
        self._ready.clear()

    async def wait(self, key: str, within: float) -> int | None:
        """Prompt tokens ready under ``key``, or None (failed, lost, or not ``within``
        seconds)."""
        fut = self._entry(key)
        try:
            tokens = await asyncio.wait_for(asyncio.shield(fut), within)
        except TimeoutError:
            return None
        return tokens if tokens >= 0 else None


def vllm_prefill_params(host: str, port: int, engine_id: str) -> tuple[str, dict[str, Any]]:
    """A new transfer key and the ``kv_transfer_params`` a vLLM prefill engine answers with."""
    key = f"pd-{uuid.uuid4().hex}"
    return key, {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": key,
        "remote_block_ids": [],
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


def decode_source(flavor: str, body: Mapping[str, Any]) -> tuple[str, str] | None:
    """Where a decode engine pulls the request's KV from: (base URL, transfer key), or None
    for a request that carries no disaggregation parameters."""
    if flavor == "vllm":
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        host, port = params.get("remote_host"), params.get("remote_port")
        key = params.get("remote_request_id")
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(key, str):
            raise ApiError(400, "kv_transfer_params lacks remote_host/remote_port/request id")
        return f"http://{host}:{port}", key
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    if room is None:
        return None
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(room, int):
        raise ApiError(400, "bootstrap_host, bootstrap_port and bootstrap_room are required")
    return f"http://{host}:{port}", f"room-{room}"


async def pull(
    source: tuple[str, str], cfg: PdConfig, speedup: float, uncached_tokens: int
) -> None:
    """Wait for the prefill engine's KV under ``source`` and move what is not held here.

    Raises ApiError (503, before any token: retryable) when the prefill engine has no such KV
    (it failed, restarted or died) or does not answer."""
    url, key = source
    timeout = aiohttp.ClientTimeout(total=cfg.wait_timeout + 5.0)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(f"{url}/sim/pd/pull", params={"key": key}) as resp,
        ):
            if resp.status != 200:
                raise ApiError(503, f"the prefill engine has no KV for {key} ({resp.status})")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ApiError(503, f"cannot reach the prefill engine at {url}: {exc!r}") from None
    delay = cfg.transfer_overhead_ms / 1e3 + uncached_tokens * cfg.transfer_us_per_token / 1e6
    await asyncio.sleep(delay / speedup)
