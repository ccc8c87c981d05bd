"""LoRA adapters of the engine: which it serves (registration) and which are loaded (load).

* Served: the engine's OpenAI ``GET /v1/models`` lists each LoRA adapter as a card whose
  ``parent`` is the base model (vLLM ``--lora-modules``, adapters loaded at runtime, SGLang
  ``--lora-paths``). The agent polls it and registers the names, so a gateway routes a
  request naming an adapter only to workers that serve it.
* Loaded: vLLM's ``vllm:lora_requests_info`` gauge names, in its labels, the adapters of the
  running and waiting requests and the number of GPU slots (``max_lora``). A series is kept
  per label set and set to the current time, so the newest (largest value) is the present.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from worker_agent.engines.base import Samples, label

__all__ = ["LORA_INFO", "MODELS_PATH", "ServedAdapters", "loaded_adapters", "served_adapters"]

log = logging.getLogger(__name__)

MODELS_PATH = "/v1/models"
LORA_INFO = "vllm:lora_requests_info"


def served_adapters(doc: Any, base: str) -> tuple[str, ...]:
    """Adapter names in a ``/v1/models`` document: cards with a ``parent`` (sorted)."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("not an OpenAI model list")
    out = {
        card["id"]
        for card in data
        if isinstance(card, dict)
        and isinstance(card.get("id"), str)
        and card.get("parent") is not None
        and card["id"] != base
    }
    return tuple(sorted(out))


def loaded_adapters(samples: Samples) -> tuple[tuple[str, ...] | None, int | None]:
    """(adapters loaded now, GPU slots) from ``vllm:lora_requests_info``; None if absent."""
    series = samples.get(LORA_INFO)
    if not series:
        return None, None
    labels, _ = max(series, key=lambda s: s[1])
    names: set[str] = set()
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        names.update(n for n in (label(labels, key) or "").split(",") if n)
    slots = label(labels, "max_lora")
    return tuple(sorted(names)), int(slots) if slots and slots.isdigit() else None


class ServedAdapters:
    """Polls the engine's ``/v1/models``; ``names`` is what the registration carries."""

    def __init__(self, engine_url: str, base_model: str, interval: float = 5.0) -> None:
        self.url = engine_url.rstrip("/") + MODELS_PATH
        self.base = base_model
        self.interval = interval
        self.names: tuple[str, ...] = ()

    async def poll(self, session: aiohttp.ClientSession) -> None:
        async with session.get(self.url) as resp:
            resp.raise_for_status()
            names = served_adapters(await resp.json(content_type=None), self.base)
        if names != self.names:
            log.info("engine serves LoRA adapters: %s", ", ".join(names) or "none")
        self.names = names

    async def run(self, session: aiohttp.ClientSession, stopping: Callable[[], bool]) -> None:
        failing = False
        while not stopping():
            try:
                await self.poll(session)
                failing = False
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                if not failing:
                    log.warning("cannot read the engine's %s: %s", MODELS_PATH, exc)
                failing = True
            await asyncio.sleep(self.interval)
