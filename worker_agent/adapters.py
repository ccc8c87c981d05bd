"""LoRA adapters the engine serves, for the registration.

The engine's OpenAI ``GET /v1/models`` lists each LoRA adapter as a card whose ``parent`` is
the base model (vLLM ``--lora-modules`` and adapters loaded at runtime). The agent polls it
and registers the names, so a gateway routes a request naming an adapter only to workers
that serve it. Which adapters are *loaded* comes with the load report (the engine adapter's
``/metrics`` parsing, e.g. ``vllm:lora_requests_info``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

__all__ = ["MODELS_PATH", "ServedAdapters", "served_adapters"]

log = logging.getLogger(__name__)

MODELS_PATH = "/v1/models"


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
