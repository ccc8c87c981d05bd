"""Engine adapters (vLLM, SGLang) and the shared KV event decoder."""

from __future__ import annotations

from worker_agent.engines.base import EngineAdapter
from worker_agent.engines.sglang import SglangAdapter
from worker_agent.engines.vllm import VllmAdapter

__all__ = ["ADAPTERS", "EngineAdapter", "adapter_for"]

ADAPTERS: dict[str, type[EngineAdapter]] = {"vllm": VllmAdapter, "sglang": SglangAdapter}


def adapter_for(kind: str) -> EngineAdapter:
    try:
        return ADAPTERS[kind]()
    except KeyError:
        raise ValueError(f"unknown engine {kind!r}; expected one of {sorted(ADAPTERS)}") from None
