"""The gateway's Prometheus metrics.

Per worker and pool: requests by routing reason, prompt tokens, predicted matched tokens,
delivered cached tokens (``usage.prompt_tokens_details.cached_tokens``), so the hit rate per
worker is one PromQL division::

    rate(kvroute_delivered_cached_tokens_total[5m]) / rate(kvroute_delivered_prompt_tokens_total[5m])

plus TTFT, retries, circuit state, index blocks; and gateway-wide routing-decision latency,
tokenization time, event lag and Redis connectivity.

With ``--workers N`` every process is a replica and the metrics are aggregated by
prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set by the parent):
counters and histograms add up; gauges that describe shared state (index size, circuit
state, lag) take the worst replica's value.

A worker that leaves must leave /metrics too (a dashboard of gone workers, an alert on a
circuit that no longer exists). A single process removes its label sets; in multiprocess
mode prometheus_client cannot (every process's file keeps a label set forever), so the
exposition leaves out every series whose ``worker`` is not one the serving process knows.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = ["GatewayMetrics", "WorkerSeries"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_FAST = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)


@dataclass(frozen=True)
class WorkerSeries:
    """One (pool, worker)'s series that every request touches, looked up once: ``labels()``
    takes a lock and builds a key on each call, a dozen times per request otherwise."""

    inflight: Gauge
    ttft: Histogram
    prompt_tokens: Counter
    matched_tokens: Counter
    delivered_prompt: Counter
    delivered_cached: Counter
    completion_tokens: Counter


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # label sets of these series are never removed (only gauges of departed workers
        # are), so the children cached here are the ones the registry holds anyway
        self._workers: dict[tuple[str, str], WorkerSeries] = {}
        r = self.registry
        pw = ["pool", "worker"]
        self.requests = Counter(
            "kvroute_requests",
            "Requests sent to a worker, by routing reason",
            [*pw, "reason"],
            registry=r,
        )
        self.errors = Counter(
            "kvroute_request_errors",
            "Requests answered with an error, by HTTP status (the gateway's own errors and "
            "the engines' error responses passed through, code engine_error)",
            ["pool", "status", "code"],
            registry=r,
        )
        self.responses = Counter(
            "kvroute_responses",
            "Responses sent to clients by status class (2xx, 4xx, 5xx): the SLO's denominator "
            "(a request whose client left before its answer ended is not one)",
            ["pool", "code"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens", "Prompt tokens routed (gateway tokenization)", pw, registry=r
        )
        self.matched_tokens = Counter(
            "kvroute_predicted_matched_tokens",
            "Prompt tokens the index predicted cached on the chosen worker",
            pw,
            registry=r,
        )
        self.delivered_prompt = Counter(
            "kvroute_delivered_prompt_tokens",
            "Prompt tokens of responses that reported usage",
            pw,
            registry=r,
        )
        self.delivered_cached = Counter(
            "kvroute_delivered_cached_tokens",
            "Cached prompt tokens the worker reported in usage",
            pw,
            registry=r,
        )
        self.agreed_cached = Counter(
            "kvroute_agreed_cached_tokens",
            "Per request min(predicted matched, reported cached) tokens: a worker's precision "
            "is this over kvroute_checked_predicted_tokens, exact per request",
            pw,
            registry=r,
        )
        self.checked_predicted = Counter(
            "kvroute_checked_predicted_tokens",
            "Prompt tokens the index predicted cached on the chosen worker, of the requests "
            "whose usage the engine reported (precision's denominator: a request that ends "
            "without usage, e.g. its client left mid-stream, has no answer to check)",
            pw,
            registry=r,
        )
        self.precision = Gauge(
            "kvroute_worker_precision",
            "Recent agreed/predicted cached tokens per worker (decayed; -1: no predictions)",
            pw,
            multiprocess_mode="min",
            registry=r,
        )
        self.trusted = Gauge(
            "kvroute_worker_trusted",
            "1 if routing believes the worker's index entries (0: routed by load alone)",
            pw,
            multiprocess_mode="min",
            registry=r,
        )
        self.antientropy_mismatches = Counter(
            "kvroute_antientropy_mismatches",
            "Index found different from the agent's stamped digest at the same stream position",
            pw,
            registry=r,
        )
        self.antientropy_resyncs = Counter(
            "kvroute_antientropy_resyncs",
            "Workers re-bootstrapped from snapshot after a digest mismatch",
            pw,
            registry=r,
        )
        self.completion_tokens = Counter(
            "kvroute_completion_tokens", "Completion tokens reported in usage", pw, registry=r
        )
        self.ttft = Histogram(
            "kvroute_ttft_seconds",
            "Time to first token through the gateway",
            pw,
            buckets=_LATENCY,
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Requests retried on another worker, by cause",
            [*pw, "cause"],
            registry=r,
        )
        # warm-ups (gateway/warmup.py): one-token requests that put a hot prefix on a new
        # holder off the request path; cost the routing pays, not traffic
        self.warmups_sent = Counter(
            "kvroute_warmups_sent", "Warm-up requests sent to a worker", pw, registry=r
        )
        self.warmups_failed = Counter(
            "kvroute_warmups_failed",
            "Warm-ups that failed or were not sent, by reason (not retried before the policy's "
            "warm-up timeout)",
            [*pw, "reason"],
            registry=r,
        )
        self.warmup_tokens = Counter(
            "kvroute_warmup_tokens",
            "Prompt tokens sent in warm-ups (the prefill they cost the worker)",
            pw,
            registry=r,
        )
        self.stream_errors = Counter(
            "kvroute_stream_errors", "Streams that broke after the first byte", pw, registry=r
        )
        self.circuit = Gauge(
            "kvroute_circuit_state",
            "Circuit state per worker: 0 closed, 1 half-open, 2 open",
            pw,
            multiprocess_mode="max",
            registry=r,
        )
        self.healthy = Gauge(
            "kvroute_worker_healthy",
            "1 if the worker may receive requests",
            pw,
            multiprocess_mode="min",
            registry=r,
        )
        self.worker_info = Gauge(
            "kvroute_worker_info",
            "1 per worker: its engine (agent) id, data-parallel rank and disaggregation role",
            ["pool", "worker", "engine_id", "dp_rank", "role"],
            multiprocess_mode="max",
            registry=r,
        )
        self.index_blocks = Gauge(
            "kvroute_index_blocks",
            "Canonical blocks the shadow index holds per worker",
            pw,
            multiprocess_mode="max",
            registry=r,
        )
        self.inflight = Gauge(
            "kvroute_worker_inflight",
            "Requests in flight per worker (this gateway)",
            pw,
            multiprocess_mode="livesum",
            registry=r,
        )
        self.kv_usage = Gauge(
            "kvroute_worker_kv_usage",
            "KV cache usage the worker's engine reported (0..1)",
            pw,
            multiprocess_mode="max",
            registry=r,
        )
        self.pool_workers = Gauge(
            "kvroute_pool_workers",
            "Workers registered in the pool",
            ["pool"],
            multiprocess_mode="max",
            registry=r,
        )
        self.pool_healthy = Gauge(
            "kvroute_pool_healthy_workers",
            "Workers of the pool that may receive requests",
            ["pool"],
            multiprocess_mode="min",
            registry=r,
        )
        self.worker_rejected = Counter(
            "kvroute_worker_rejected",
            "Worker registrations refused, by reason (seed_mismatch, unknown_model, "
            "upstream_not_allowed)",
            ["reason"],
            registry=r,
        )
        self.unverified_seed = Gauge(
            "kvroute_workers_unverified_seed",
            "Workers accepted whose registration has no seed fingerprint (older agents)",
            multiprocess_mode="max",
            registry=r,
        )
        self.decision = Histogram(
            "kvroute_routing_decision_seconds",
            "Routing decision time (index lookup + scoring)",
            ["pool"],
            buckets=_FAST,
            registry=r,
        )
        self.tokenize = Histogram(
            "kvroute_tokenization_seconds",
            "Tokenization time per request, on its path (overlapped: until it can be routed)",
            ["pool", "kind"],
            buckets=(*_FAST, 0.25, 1.0),
            registry=r,
        )
        self.tokenize_overlapped = Counter(
            "kvroute_tokenization_overlapped_total",
            "Prompts routed on their known first ids while their new text was encoded",
            ["pool"],
            registry=r,
        )
        self.tokenize_overlap_wait = Histogram(
            "kvroute_tokenization_overlap_wait_seconds",
            "How long an overlapped prompt's first chunk waited for its exact ids (0: they "
            "were ready before the engine's first token; the overlap then cost no latency)",
            ["pool"],
            buckets=(0.0, *_FAST),
            registry=r,
        )
        self.cost_scale = Gauge(
            "kvroute_cost_model_scale",
            "Online calibration factor of the TTFT cost model",
            ["pool"],
            multiprocess_mode="max",
            registry=r,
        )
        self.event_lag = Gauge(
            "kvroute_event_lag_seconds",
            "Engine event to index lag of the latest applied entry",
            multiprocess_mode="max",
            registry=r,
        )
        self.redis_up = Gauge(
            "kvroute_redis_connected",
            "1 if the event bus is reachable",
            multiprocess_mode="min",
            registry=r,
        )
        self.resyncs = Gauge(
            "kvroute_index_resyncs",
            "Worker re-bootstraps from snapshots (gaps, trims)",
            multiprocess_mode="max",
            registry=r,
        )
        self.redis_client_rebuilds = Gauge(
            "kvroute_redis_client_rebuilds",
            "Redis Cluster clients replaced because a shard's reads or appends kept failing (a "
            "slot map that did not heal after a failover)",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.event_reads = Gauge(
            "kvroute_event_reads",
            "XREADs of the KV-event streams (round trips to Redis)",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.event_entries_read = Gauge(
            "kvroute_event_entries_read",
            "KV-event stream entries those reads returned (entries per read: the batching)",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.placements = Gauge(
            "kvroute_placements",
            "Placements (speculative inserts) shared between gateway replicas, by what became "
            "of them: published by this replica, adopted from others, dropped unsent, garbage read",
            ["outcome"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.remote_requests = Gauge(
            "kvroute_remote_requests",
            "Other gateway replicas' requests counted in this replica's load views "
            "(replicas.share_load), by outcome: started, ended (their end heard), expired "
            "(their end lost: origin silent or TTL), unknown (an end whose start was missed), "
            "inflight (counted now)",
            ["outcome"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.gaps = Gauge(
            "kvroute_index_gaps",
            "Stream gaps detected by the consumer",
            multiprocess_mode="max",
            registry=r,
        )
        self.orphans = Gauge(
            "kvroute_index_orphan_stores",
            "Stores whose parent the worker did not hold",
            multiprocess_mode="max",
            registry=r,
        )
        self.gateway_inflight = Gauge(
            "kvroute_inflight_requests",
            "Requests in flight upstream",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.queued = Gauge(
            "kvroute_queued_requests",
            "Requests waiting for a concurrency slot",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.rejected = Counter(
            "kvroute_rejected",
            "Requests shed by admission control, by cause",
            ["cause"],
            registry=r,
        )
        self.tokenizer_cache_hits = Gauge(
            "kvroute_tokenizer_cache_hit_ratio",
            "Share of tokens served from the incremental tokenization cache",
            ["pool"],
            multiprocess_mode="max",
            registry=r,
        )
        self.request_log_records = Counter(
            "kvroute_request_log_records",
            "Records written to the request log (request_log.path)",
            registry=r,
        )
        self.request_log_dropped = Counter(
            "kvroute_request_log_dropped",
            "Request log records dropped, by cause (queue_full, write_error)",
            ["cause"],
            registry=r,
        )

    def worker(self, pool: str, worker: str) -> WorkerSeries:
        """The per-request series of ``worker`` in ``pool`` (cached children)."""
        series = self._workers.get((pool, worker))
        if series is None:
            series = WorkerSeries(
                self.inflight.labels(pool, worker),
                self.ttft.labels(pool, worker),
                self.prompt_tokens.labels(pool, worker),
                self.matched_tokens.labels(pool, worker),
                self.delivered_prompt.labels(pool, worker),
                self.delivered_cached.labels(pool, worker),
                self.completion_tokens.labels(pool, worker),
            )
            self._workers[pool, worker] = series
        return series

    def names(self) -> set[str]:
        """Every exported metric name (as Prometheus sees it, with _total, _bucket...)."""
        out: set[str] = set()
        for family in self.registry.collect():
            for sample in family.samples:
                out.add(sample.name)
            out.add(family.name)
            if family.type == "counter":
                out.add(family.name + "_total")
            if family.type == "histogram":
                out.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        return out

    @staticmethod
    def multiprocess() -> bool:
        return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

    def exposition(self, workers: Collection[str] | None = None) -> bytes:
        """The text exposition; with ``workers``, series of any other worker are left out."""
        source: CollectorRegistry = self.registry
        if self.multiprocess():
            source = CollectorRegistry()
            MultiProcessCollector(source)
        if workers is None:
            return generate_latest(source)
        return generate_latest(_OnlyWorkers(source, frozenset(workers)))


class _OnlyWorkers:
    """A collector view of ``source`` without the series of workers not in ``workers``."""

    def __init__(self, source: CollectorRegistry, workers: frozenset[str]) -> None:
        self.source = source
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [
                s for s in family.samples if s.labels.get("worker", "") in self.workers
                or "worker" not in s.labels
            ]  # fmt: skip
            yield out
