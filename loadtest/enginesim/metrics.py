"""``/metrics`` of a simulated engine, with vLLM's or SGLang's metric names and labels.

One ``CollectorRegistry`` per worker (no global state). Gauges and counters are read from the
engine core at scrape time, so they are always current and cost nothing per request;
latency histograms are observed by the server when requests progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loadtest.enginesim.scheduler import EngineCore, SimRequest

__all__ = ["CONTENT_TYPE", "EngineMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


class EngineMetrics:
    """Prometheus metrics of one engine (``flavor`` picks names and labels)."""

    def __init__(
        self,
        flavor: Literal["vllm", "sglang"],
        model: str,
        cores: Callable[[], list[EngineCore]],
        dp_size: int = 1,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # one series per data-parallel rank, labelled as the engine labels it: vLLM's
        # ``engine`` is the rank's index; SGLang adds ``dp_rank`` when DP is on
        per_rank: list[dict[str, str]]
        if flavor == "vllm":
            names = "vllm"
            per_rank = [{"model_name": model, "engine": str(r)} for r in range(dp_size)]
            queue = "vllm:request_queue_time_seconds"
        else:
            names = "sglang"
            base = {
                "model_name": model,
                "engine_type": "unified",
                "tp_rank": "0",
                "pp_rank": "0",
                "moe_ep_rank": "0",
            }
            per_rank = (
                [{**base, "dp_rank": str(r)} for r in range(dp_size)] if dp_size > 1 else [base]
            )
            queue = "sglang:queue_time_seconds"
        self.registry.register(_CoreCollector(flavor, per_rank, cores))
        keys = list(per_rank[0])

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> list[Any]:
            h = Histogram(name, doc, keys, registry=self.registry, buckets=buckets)
            return [h.labels(*labels.values()) for labels in per_rank]

        self._ttft = hist(f"{names}:time_to_first_token_seconds", "Time to first token.")
        self._itl = hist(
            f"{names}:inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS
        )
        self._e2e = hist(f"{names}:e2e_request_latency_seconds", "End-to-end request latency.")
        self._queue = hist(queue, "Time spent waiting in the queue.")

    def first_token(self, req: SimRequest, rank: int = 0) -> None:
        assert req.first_token_time is not None and req.scheduled_time is not None
        self._ttft[rank].observe(req.first_token_time - req.arrival)
        self._queue[rank].observe(req.scheduled_time - req.arrival)

    def finished(self, req: SimRequest, rank: int = 0) -> None:
        """One end-to-end sample and the request's mean inter-token gap (cheap, per request)."""
        assert req.finish_time is not None and req.first_token_time is not None
        self._e2e[rank].observe(req.finish_time - req.arrival)
        if req.num_output > 1:
            gap = (req.finish_time - req.first_token_time) / (req.num_output - 1)
            self._itl[rank].observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CoreCollector(Collector):
    """Gauges and counters read from the live core on each scrape."""

    def __init__(
        self, flavor: str, per_rank: list[dict[str, str]], cores: Callable[[], list[EngineCore]]
    ) -> None:
        self._flavor = flavor
        self._per_rank = per_rank
        self._labels = per_rank[0]
        self._cores = cores
        self._last = [(time.monotonic(), 0)] * len(per_rank)  # for SGLang's gen_throughput
        self._rank = 0

    def collect(self) -> Iterator[Metric]:
        """Each rank's families, merged: one family per name with a series per rank."""
        merged: dict[str, Metric] = {}
        for rank, core in enumerate(self._cores()):
            self._rank, self._labels = rank, self._per_rank[rank]
            fams = self._vllm(core) if self._flavor == "vllm" else self._sglang(core)
            for fam in fams:
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        yield from merged.values()

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float, **extra: str) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=[*self._labels, *extra])
        c.add_metric([*self._labels.values(), *extra.values()], value)
        return c

    def _vllm(self, core: EngineCore) -> Iterator[Metric]:
        st = core.stats
        g, c = self._gauge, self._counter
        yield g(
            "vllm:num_requests_running", "Requests in model execution batches.", core.num_running
        )
        yield g("vllm:num_requests_waiting", "Requests waiting to be processed.", core.num_waiting)
        yield g(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.kv_usage
        )
        yield c("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", st.cache_queries)
        yield c("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", st.cache_hits)
        yield c("vllm:num_preemptions", "Cumulative number of preemptions.", 0)
        yield c("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield c("vllm:generation_tokens", "Number of generation tokens.", st.generation_tokens)
        yield c(
            "vllm:request_success", "Successfully processed requests.", st.finished,
            finished_reason="length",
        )  # fmt: skip
        if core.adapters:  # vLLM exports this with LoRA enabled; the agent reads it
            yield self._lora_info(core)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"],
        )
        info.add_metric(
            [str(core.block_size), str(core.allocator.num_blocks), "True", self._labels["engine"]],
            1.0,
        )
        yield info

    @staticmethod
    def _lora_info(core: EngineCore) -> GaugeMetricFamily:
        """``vllm:lora_requests_info``: adapters of running and waiting requests in labels,
        the value the time of the update (vLLM keeps a series per label set)."""
        running, waiting = core.lora_requests()
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        info.add_metric(
            [str(core.loras.max_loras), ",".join(waiting), ",".join(running)], time.time()
        )
        return info

    def _sglang(self, core: EngineCore) -> Iterator[Metric]:
        st = core.stats
        g, c = self._gauge, self._counter
        bs = core.block_size
        total = core.allocator.num_blocks * bs
        used = core.used_blocks * bs
        now = time.monotonic()
        then, gen_then = self._last[self._rank]
        self._last[self._rank] = (now, st.generation_tokens)
        rate = (st.generation_tokens - gen_then) / (now - then) if now > then else 0.0
        hit_rate = st.cache_hits / st.cache_queries if st.cache_queries else 0.0
        yield g("sglang:num_running_reqs", "The number of running requests.", core.num_running)
        yield g(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            core.num_waiting,
        )
        yield g("sglang:token_usage", "The token usage.", used / total)
        yield g("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
        yield g("sglang:gen_throughput", "The generation throughput (token/s).", rate)
        yield g("sglang:kv_used_tokens", "KV tokens in use.", used)
        yield g("sglang:kv_available_tokens", "KV tokens available.", total - used)
        yield g("sglang:max_total_num_tokens", "Maximum total number of KV tokens.", total)
        yield g("sglang:page_size", "KV cache page size.", bs)
        yield c("sglang:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield c("sglang:generation_tokens", "Number of generation tokens.", st.generation_tokens)
        yield c("sglang:cached_tokens", "Number of cached prompt tokens.", st.cache_hits)
        yield c("sglang:num_requests", "Number of requests processed.", st.finished)
