"""LoRA adapter slots of one simulated engine, as vLLM keeps them.

vLLM serves the adapters it was started with (``--lora-modules``) and holds at most
``--max-loras`` of them in GPU memory, least recently used out; a request for an adapter
that is not loaded waits for its load (from host memory or disk) before its prefill, and a
request cannot be scheduled while every slot holds an adapter that running requests use.
Pure and synchronous (the engine core drives it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

__all__ = ["LoraConfig", "LoraSlots"]


@dataclass
class LoraConfig:
    """Adapters the engine serves (``model`` names one), its GPU slots and load time."""

    adapters: list[str] = field(default_factory=list)
    max_loras: int = 1  # vLLM's default --max-loras
    load_ms: float = 20.0  # one adapter into a GPU slot (before the speed-up factor)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"lora.max_loras must be >= 1, got {self.max_loras}")
        if self.load_ms < 0:
            raise ValueError(f"lora.load_ms must be >= 0, got {self.load_ms}")
        if len(set(self.adapters)) != len(self.adapters):
            raise ValueError("lora.adapters lists an adapter twice")


class LoraSlots:
    """Which adapters are loaded (LRU) and which the running requests use."""

    def __init__(self, max_loras: int, load_s: float) -> None:
        self.max_loras = max_loras
        self.load_s = load_s
        self.loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.in_use: Counter[str] = Counter()
        self.loads = 0  # adapters loaded so far

    def can_acquire(self, adapter: str) -> bool:
        """Whether a request for ``adapter`` can start now (loaded, a free slot, or a slot
        whose adapter no running request uses)."""
        return (
            adapter in self.loaded
            or len(self.loaded) < self.max_loras
            or any(not self.in_use[a] for a in self.loaded)
        )

    def acquire(self, adapter: str) -> float:
        """A request for ``adapter`` starts; returns the load time it waits (0: loaded)."""
        self.in_use[adapter] += 1
        if adapter in self.loaded:
            self.loaded.move_to_end(adapter)
            return 0.0
        if len(self.loaded) >= self.max_loras:
            victim = next(a for a in self.loaded if not self.in_use[a])
            del self.loaded[victim]
        self.loaded[adapter] = None
        self.loads += 1
        return self.load_s

    def release(self, adapter: str) -> None:
        self.in_use[adapter] -= 1
        if self.in_use[adapter] <= 0:
            del self.in_use[adapter]

    def clear(self) -> None:
        self.loaded.clear()
        self.in_use.clear()
