"""vLLM: discovery from ``GET /kv_event_sources`` and ``/metrics`` names (vLLM ≥0.10)."""

from __future__ import annotations

from typing import Any

from gateway.contract.wire import EngineReport
from worker_agent.engines.base import (
    Discovery,
    DiscoveryError,
    EngineAdapter,
    EventSource,
    Samples,
    endpoint_for_rank,
    label,
    mean,
    resolve_host,
    total,
)

__all__ = ["VllmAdapter"]

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
CACHE_INFO = "vllm:cache_config_info"  # labels carry num_gpu_blocks and block_size
LORA_INFO = "vllm:lora_requests_info"  # labels carry running/waiting adapters, max_lora


class VllmAdapter(EngineAdapter):
    kind = "vllm"
    gpu_media = frozenset({None, "GPU"})

    @property
    def discovery_path(self) -> str:
        return "/kv_event_sources"

    @property
    def metric_names(self) -> tuple[str, ...]:
        return (RUNNING, WAITING, KV_USAGE, QUERIES, HITS, CACHE_INFO, LORA_INFO)

    def discover(self, info: Any, engine_url: str) -> Discovery:
        """Accepts a list of per-rank configs, ``{"sources": [...]}``, a map keyed by rank,
        or one config (then ranks follow the port + rank rule up to ``dp_size``)."""
        items = _rank_configs(info)
        sources = []
        for i, cfg in items:
            endpoint = cfg.get("endpoint")
            if not isinstance(endpoint, str):
                continue
            if cfg.get("enable_kv_cache_events") is False or cfg.get("publisher") == "null":
                continue
            replay = cfg.get("replay_endpoint")
            sources.append(
                EventSource(
                    rank=i,
                    endpoint=resolve_host(endpoint, engine_url),
                    replay=resolve_host(replay, engine_url) if isinstance(replay, str) else None,
                    topic=str(cfg.get("topic") or ""),
                )
            )
        if not sources:
            raise DiscoveryError(f"no enabled KV event publisher in {info!r:.300}")
        if len(sources) == 1 and isinstance(info, dict):
            dp = info.get("dp_size") or info.get("data_parallel_size") or 1
            base = sources[0]
            sources = [
                EventSource(
                    r,
                    endpoint_for_rank(base.endpoint, r),
                    endpoint_for_rank(base.replay, r) if base.replay else None,
                    base.topic,
                )
                for r in range(int(dp))
            ]
        block = info.get("block_size") if isinstance(info, dict) else None
        return Discovery(sources, block if isinstance(block, int) else None)

    def report(self, samples: Samples, ts: float) -> EngineReport:
        adapters, slots = loaded_adapters(samples)
        return EngineReport(
            running=int(total(samples, RUNNING) or 0),
            waiting=int(total(samples, WAITING) or 0),
            kv_usage=float(mean(samples, KV_USAGE) or 0.0),
            waiting_prefill_tokens=None,
            prefix_cache_queries=int(total(samples, QUERIES) or 0),
            prefix_cache_hits=int(total(samples, HITS) or 0),
            ts=ts,
            adapters=adapters,
            max_adapters=slots,
        )

    def block_size(self, samples: Samples) -> int | None:
        for labels, _ in samples.get(CACHE_INFO, []):
            bs = label(labels, "block_size")
            if bs and bs.isdigit() and int(bs) > 0:
                return int(bs)
        return None

    def capacity_tokens(self, samples: Samples) -> int | None:
        tokens = 0
        for labels, _ in samples.get(CACHE_INFO, []):
            blocks, bs = label(labels, "num_gpu_blocks"), label(labels, "block_size")
            if blocks and bs and blocks.isdigit() and bs.isdigit():
                tokens += int(blocks) * int(bs)
        return tokens or None


def _rank_configs(info: Any) -> list[tuple[int, dict[str, Any]]]:
    if isinstance(info, dict):
        for key in ("sources", "kv_event_sources", "data"):
            if isinstance(info.get(key), list):
                return _rank_configs(info[key])
        if "endpoint" in info:
            return [(_rank(info, 0), info)]
        return sorted(
            (int(k), v) for k, v in info.items() if str(k).isdigit() and isinstance(v, dict)
        )
    if isinstance(info, list):
        return [(_rank(c, i), c) for i, c in enumerate(info) if isinstance(c, dict)]
    return []


def _rank(cfg: dict[str, Any], default: int) -> int:
    for key in ("dp_rank", "data_parallel_rank", "rank"):
        if isinstance(cfg.get(key), int):
            return int(cfg[key])
    return default


def loaded_adapters(samples: Samples) -> tuple[tuple[str, ...] | None, int | None]:
    """(LoRA adapters loaded now, GPU slots) from ``vllm:lora_requests_info`` (None: absent).

    Its labels name the adapters of the running and waiting requests and ``max_lora``;
    vLLM keeps a series per label set, set to the time of the update, so the newest (the
    largest value) is the present.
    """
    series = samples.get(LORA_INFO)
    if not series:
        return None, None
    labels, _ = max(series, key=lambda s: s[1])
    names: set[str] = set()
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        names.update(n for n in (label(labels, key) or "").split(",") if n)
    slots = label(labels, "max_lora")
    return tuple(sorted(names)), int(slots) if slots and slots.isdigit() else None
