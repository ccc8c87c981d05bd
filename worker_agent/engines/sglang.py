"""SGLang: discovery from ``GET /server_info`` → ``kv_events`` and ``/metrics`` names."""

from __future__ import annotations

from typing import Any

from gateway.contract.wire import EngineReport
from worker_agent.engines.base import (
    Discovery,
    DiscoveryError,
    EngineAdapter,
    EventSource,
    Samples,
    mean,
    resolve_host,
    total,
)

__all__ = ["SglangAdapter"]

RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
TOKEN_USAGE = "sglang:token_usage"
PROMPT_TOKENS = "sglang:prompt_tokens_total"
CACHED_TOKENS = "sglang:cached_tokens_total"
MAX_TOKENS = "sglang:max_total_num_tokens"


class SglangAdapter(EngineAdapter):
    kind = "sglang"
    # HiCache tiers publish CPU_PINNED / DISK / EXTERNAL: not GPU.
    gpu_media = frozenset({None, "GPU"})
    rank_label = "dp_rank"

    @property
    def discovery_path(self) -> str:
        return "/server_info"

    @property
    def metric_names(self) -> tuple[str, ...]:
        return (RUNNING, WAITING, TOKEN_USAGE, PROMPT_TOKENS, CACHED_TOKENS, MAX_TOKENS)

    def discover(self, info: Any, engine_url: str) -> Discovery:
        kv = info.get("kv_events") if isinstance(info, dict) else None
        if not isinstance(kv, dict) or kv.get("publisher") in (None, "null"):
            raise DiscoveryError("/server_info has no enabled kv_events block")
        host = kv.get("endpoint_host", "*")
        port = kv.get("endpoint_port_base")
        if not isinstance(port, int):
            raise DiscoveryError(f"kv_events block without endpoint_port_base: {kv!r:.300}")
        replay_port = kv.get("replay_endpoint_port_base")
        dp = int(kv.get("dp_size") or 1)
        sources = []
        for rank in range(dp):
            endpoint = resolve_host(f"tcp://{host}:{port + rank}", engine_url)
            replay = None
            if isinstance(replay_port, int):
                replay = resolve_host(f"tcp://{host}:{replay_port + rank}", engine_url)
            sources.append(EventSource(rank, endpoint, replay, str(kv.get("topic") or "")))
        block = kv.get("block_size")
        # a prefill engine under disaggregation: where decode engines pull its KV from
        boot = info.get("disaggregation_bootstrap_port")
        prefill = info.get("disaggregation_mode") == "prefill" and isinstance(boot, int)
        return Discovery(
            sources, block if isinstance(block, int) else None, boot if prefill else None
        )

    def report(self, samples: Samples, ts: float) -> EngineReport:
        return EngineReport(
            running=int(total(samples, RUNNING) or 0),
            waiting=int(total(samples, WAITING) or 0),
            kv_usage=float(mean(samples, TOKEN_USAGE) or 0.0),
            waiting_prefill_tokens=None,
            prefix_cache_queries=int(total(samples, PROMPT_TOKENS) or 0),
            prefix_cache_hits=int(total(samples, CACHED_TOKENS) or 0),
            ts=ts,
        )

    def capacity_tokens(self, samples: Samples) -> int | None:
        value = total(samples, MAX_TOKENS)
        return int(value) if value else None
