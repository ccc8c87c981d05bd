"""Generate deploy/grafana/kvroute.json, the kvroute Grafana dashboard (stdlib only).

Run ``python deploy/grafana/generate.py`` after editing; tests/test_deploy.py checks that the
committed JSON equals this script's output and that every metric it queries is exported by
the gateway or the agent.

Per-worker gateway series carry ``pool`` and ``worker`` labels (the worker id: the pod name
when the Helm chart runs the workers). Agent series have no ``worker`` label; their scrape
target's ``pod`` label is the worker id, so they are filtered with ``pod=~"$worker"``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvroute.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
POOL = 'pool=~"$pool"'
SEL = 'pool=~"$pool", worker=~"$worker"'
AGENT = 'pod=~"$worker"'


class Layout:
    """Panels placed left to right on a 24-column grid, rows stacked."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "id": len(self.panels) + 1,
                "panels": [],
            }
        )
        self.y += 1

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x = 0
        self.row_h = 0


def target(expr: str, legend: str = "", ref: str = "A") -> dict[str, Any]:
    return {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": True,
        "refId": ref,
    }


def targets(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(pairs)]


def timeseries(
    title: str,
    tgts: list[dict[str, Any]],
    unit: str = "short",
    description: str = "",
    maximum: float | None = None,
    stack: bool = False,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": 0,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": True,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        },
    }
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {
                "displayMode": "table",
                "placement": "right",
                "calcs": ["lastNotNull", "max"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    expr: str,
    unit: str = "short",
    description: str = "",
    mappings: list[dict[str, Any]] | None = None,
    thresholds: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "mappings": mappings or [],
                "thresholds": {
                    "mode": "absolute",
                    "steps": thresholds or [{"color": "green", "value": None}],
                },
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
    }


def state_timeline(
    title: str,
    tgts: list[dict[str, Any]],
    states: dict[int, tuple[str, str]],
    description: str = "",
) -> dict[str, Any]:
    mapping = {
        "type": "value",
        "options": {
            str(v): {"text": text, "color": color, "index": i}
            for i, (v, (text, color)) in enumerate(states.items())
        },
    }
    return {
        "type": "state-timeline",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": {
            "defaults": {
                "mappings": [mapping],
                "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": [{"color": "text", "value": None}]},
            },
            "overrides": [],
        },
        "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.8},
    }


def hit_ratio(num: str, den: str, by: str, sel: str) -> str:
    return f"sum by ({by}) (rate({num}{{{sel}}}[5m]))\n/\nsum by ({by}) (rate({den}{{{sel}}}[5m]))"


def quantile(q: float, metric: str, by: str, sel: str) -> str:
    inner = f"sum by ({by}) (rate({metric}_bucket{{{sel}}}[{RATE}]))"
    return f"histogram_quantile({q}, {inner})"


def panels() -> list[dict[str, Any]]:
    L = Layout()
    delivered = ("kvroute_delivered_cached_tokens_total", "kvroute_delivered_prompt_tokens_total")
    predicted = ("kvroute_predicted_matched_tokens_total", "kvroute_prompt_tokens_total")

    L.row("Overview")
    L.add(stat("Requests/s", f"sum(rate(kvroute_requests_total{{{SEL}}}[{RATE}]))", "reqps"), 4, 4)
    L.add(
        stat(
            "Delivered hit rate",
            hit_ratio(*delivered, "", SEL).replace("sum by () ", "sum "),
            "percentunit",
            "Cached prompt tokens / prompt tokens, as the engines report them (last 5 m).",
        ),
        4,
        4,
    )
    L.add(
        stat(
            "Predicted hit rate",
            hit_ratio(*predicted, "", SEL).replace("sum by () ", "sum "),
            "percentunit",
            "Prompt tokens the index expected cached on the chosen worker / prompt tokens.",
        ),
        4,
        4,
    )
    L.add(
        stat(
            "Healthy workers",
            f"sum(min by (pool, worker) (kvroute_worker_healthy{{{SEL}}}))",
            thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 1}],
        ),
        4,
        4,
    )
    L.add(
        stat(
            "Redis (all gateways)",
            "min(kvroute_redis_connected)",
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "unreachable", "color": "red"},
                        "1": {"text": "connected", "color": "green"},
                    },
                }
            ],
        ),
        4,
        4,
    )
    L.add(
        stat(
            "Event lag (worst gateway)",
            "max(kvroute_event_lag_seconds)",
            "s",
            thresholds=[
                {"color": "green", "value": None},
                {"color": "orange", "value": 0.05},
                {"color": "red", "value": 1},
            ],
        ),
        4,
        4,
    )

    L.row("Cache hit rate")
    L.add(
        timeseries(
            "Delivered hit rate per worker",
            targets((hit_ratio(*delivered, "pool, worker", SEL), "{{worker}}")),
            "percentunit",
            "rate(kvroute_delivered_cached_tokens_total) / rate(kvroute_delivered_prompt_tokens_total)"
            " per worker: what the engines report in usage.prompt_tokens_details.cached_tokens.",
            maximum=1,
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Predicted hit rate per worker",
            targets((hit_ratio(*predicted, "pool, worker", SEL), "{{worker}}")),
            "percentunit",
            "kvroute_predicted_matched_tokens_total / kvroute_prompt_tokens_total per worker: "
            "what the shadow index expected when it routed.",
            maximum=1,
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Hit rate per pool: predicted vs delivered",
            targets(
                (hit_ratio(*predicted, "pool", SEL), "{{pool}} predicted"),
                (hit_ratio(*delivered, "pool", SEL), "{{pool}} delivered"),
            ),
            "percentunit",
            "A persistent gap means the index and the engines' caches disagree.",
            maximum=1,
        ),
        24,
        7,
    )
    agreed = ("kvroute_agreed_cached_tokens_total", "kvroute_checked_predicted_tokens_total")
    L.add(
        timeseries(
            "Index precision per worker",
            targets((hit_ratio(*agreed, "pool, worker", SEL), "{{worker}}")),
            "percentunit",
            "Per request min(predicted, engine-reported cached tokens), summed, over predicted "
            "tokens, of the requests whose usage the engine reported (one whose client left "
            "mid-stream has nothing to check): the share of the index's claims the engine "
            "confirmed. Exact per worker "
            "(an under-claim never hides an over-claim). Below trust.min_precision the worker "
            "is routed by load alone.",
            maximum=1,
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Anti-entropy resyncs and untrusted workers",
            targets(
                (
                    f"sum by (worker) (increase(kvroute_antientropy_resyncs_total{{{SEL}}}[5m]))",
                    "{{worker}} resyncs",
                ),
                (
                    f"count by (worker) (min by (pool, worker) "
                    f"(kvroute_worker_trusted{{{SEL}}}) == 0)",
                    "{{worker}} untrusted",
                ),
            ),
            "short",
            "Resyncs: a worker's index differed from its agent's digest at the same stream "
            "position and was re-bootstrapped from snapshot. Untrusted: routed by load alone "
            "(digest mismatch, stream gap or low precision; /workers says why).",
        ),
        12,
        8,
    )

    L.row("Latency")
    L.add(
        timeseries(
            "TTFT p50 / p99 (all workers)",
            targets(
                (quantile(0.5, "kvroute_ttft_seconds", "le", SEL), "p50"),
                (quantile(0.99, "kvroute_ttft_seconds", "le", SEL), "p99"),
            ),
            "s",
            "Time to first token through the gateway.",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "TTFT p50 per worker",
            targets((quantile(0.5, "kvroute_ttft_seconds", "le, worker", SEL), "{{worker}}")),
            "s",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "TTFT p99 per worker",
            targets((quantile(0.99, "kvroute_ttft_seconds", "le, worker", SEL), "{{worker}}")),
            "s",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "Routing decision time",
            targets(
                (
                    quantile(0.5, "kvroute_routing_decision_seconds", "le, pool", POOL),
                    "{{pool}} p50",
                ),
                (
                    quantile(0.99, "kvroute_routing_decision_seconds", "le, pool", POOL),
                    "{{pool}} p99",
                ),
            ),
            "s",
            "Index lookup and scoring per request (target p50 ≤ 50 µs, p99 ≤ 150 µs).",
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Tokenization time",
            targets(
                (
                    quantile(0.5, "kvroute_tokenization_seconds", "le, pool, kind", POOL),
                    "{{pool}} {{kind}} p50",
                ),
                (
                    quantile(0.99, "kvroute_tokenization_seconds", "le, pool, kind", POOL),
                    "{{pool}} {{kind}} p99",
                ),
                (
                    quantile(0.99, "kvroute_tokenization_overlap_wait_seconds", "le, pool", POOL),
                    "{{pool}} overlap wait p99",
                ),
            ),
            "s",
            "Chat template rendering, tokenization and block keys per request, on its path "
            "(an overlapped prompt's until it can be routed); overlap wait: how long an "
            "overlapped prompt's first chunk waited for the rest of its ids.",
        ),
        12,
        8,
    )

    L.row("Traffic")
    L.add(
        timeseries(
            "Requests/s per worker",
            targets(
                (f"sum by (worker) (rate(kvroute_requests_total{{{SEL}}}[{RATE}]))", "{{worker}}")
            ),
            "reqps",
            stack=True,
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Requests/s by routing reason",
            targets(
                (f"sum by (reason) (rate(kvroute_requests_total{{{SEL}}}[{RATE}]))", "{{reason}}")
            ),
            "reqps",
            "Why the policy chose the worker it chose.",
            stack=True,
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Errors/s by status",
            targets(
                (
                    f"sum by (status, code) (rate(kvroute_request_errors_total{{{POOL}}}[{RATE}]))",
                    "{{status}} {{code}}",
                ),
                (
                    f"sum by (cause) (rate(kvroute_rejected_total[{RATE}]))",
                    "shed: {{cause}}",
                ),
            ),
            "reqps",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "Retries/s and broken streams",
            targets(
                (
                    f"sum by (cause) (rate(kvroute_retries_total{{{SEL}}}[{RATE}]))",
                    "retry: {{cause}}",
                ),
                (f"sum(rate(kvroute_stream_errors_total{{{SEL}}}[{RATE}]))", "broken streams"),
            ),
            "reqps",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "Gateway requests in flight and queued",
            targets(
                ("sum by (pod) (kvroute_inflight_requests)", "{{pod}} in flight"),
                ("sum by (pod) (kvroute_queued_requests)", "{{pod}} queued"),
            ),
        ),
        8,
        8,
    )

    L.add(
        timeseries(
            "Responses/s by status class",
            targets(
                (
                    f"sum by (code) (rate(kvroute_responses_total{{{POOL}}}[{RATE}]))",
                    "{{code}}",
                ),
            ),
            "reqps",
            "Every API response, engine errors passed through included: the SLO's denominator.",
            stack=True,
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Server-error ratio (objective 0.1%)",
            targets(
                (
                    f'((sum(rate(kvroute_responses_total{{code="5xx",{POOL}}}[{RATE}])) or vector(0))'
                    f" + (sum(rate(kvroute_stream_errors_total{{{SEL}}}[{RATE}])) or vector(0)))"
                    f" / sum(rate(kvroute_responses_total{{{POOL}}}[{RATE}]))",
                    "errors",
                ),
            ),
            "percentunit",
            "5xx responses and streams broken after their first byte, over all responses "
            "(the KvrouteErrorBudgetBurn* alerts).",
        ),
        12,
        8,
    )

    L.row("Workers")
    L.add(
        timeseries(
            "Refused worker registrations by reason",
            targets(
                (
                    f"sum by (reason) (increase(kvroute_worker_rejected_total[{RATE}]))",
                    "{{reason}}",
                ),
                ("max(kvroute_workers_unverified_seed)", "accepted without a seed fingerprint"),
            ),
            description="seed_mismatch: an agent keyed with another hash seed (no cache hit "
            "could ever match); see /workers rejected_registrations and the gateway's log.",
        ),
        24,
        6,
    )
    L.add(
        timeseries(
            "Index blocks per worker",
            targets((f"max by (worker) (kvroute_index_blocks{{{SEL}}})", "{{worker}}")),
            description="Canonical blocks the gateway's shadow index holds for each worker.",
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "KV cache usage per worker",
            targets((f"max by (worker) (kvroute_worker_kv_usage{{{SEL}}})", "{{worker}}")),
            "percentunit",
            "As the worker's engine reports it (agent load reports).",
            maximum=1,
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Requests in flight per worker (all gateways)",
            targets((f"sum by (worker) (kvroute_worker_inflight{{{SEL}}})", "{{worker}}")),
            stack=True,
        ),
        8,
        8,
    )
    L.add(
        state_timeline(
            "Circuit state per worker",
            targets((f"max by (worker) (kvroute_circuit_state{{{SEL}}})", "{{worker}}")),
            {0: ("closed", "green"), 1: ("half-open", "orange"), 2: ("open", "red")},
            "Worst state over the gateway replicas.",
        ),
        8,
        8,
    )
    L.add(
        state_timeline(
            "Healthy per worker",
            targets((f"min by (worker) (kvroute_worker_healthy{{{SEL}}})", "{{worker}}")),
            {0: ("unhealthy", "red"), 1: ("healthy", "green")},
        ),
        8,
        8,
    )
    # topologies: a data-parallel rank is a worker "<engine>.dp<r>"; disaggregated workers
    # have a role (kvroute_worker_info carries both, to join on)
    L.add(
        timeseries(
            "Requests per second by role",
            targets(
                (
                    "sum by (role) (sum by (pool, worker) "
                    f"(rate(kvroute_requests_total{{{SEL}}}[$__rate_interval])) "
                    f"* on (pool, worker) group_left (role) max by (pool, worker, role) "
                    f"(kvroute_worker_info{{{SEL}}}))",
                    "{{role}}",
                )
            ),
            "reqps",
            "Prefill and decode halves of disaggregated pairs (empty role: whole requests).",
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Requests per second per data-parallel rank",
            targets(
                (
                    "sum by (engine_id, dp_rank) (sum by (pool, worker) "
                    f"(rate(kvroute_requests_total{{{SEL}}}[$__rate_interval])) "
                    f"* on (pool, worker) group_left (engine_id, dp_rank) max by "
                    f"(pool, worker, engine_id, dp_rank) (kvroute_worker_info{{{SEL}}}))",
                    "{{engine_id}} rank {{dp_rank}}",
                )
            ),
            "reqps",
            "Each rank holds its own prefix cache: an even spread over ranks with high hit "
            "rates means the pinning works.",
        ),
        12,
        8,
    )

    L.row("Event bus and index")
    L.add(
        state_timeline(
            "Redis connectivity",
            targets(
                ("min by (pod) (kvroute_redis_connected)", "gateway {{pod}}"),
                (f"min by (pod) (kvroute_agent_redis_connected{{{AGENT}}})", "agent {{pod}}"),
            ),
            {0: ("unreachable", "red"), 1: ("connected", "green")},
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Event lag per gateway",
            targets(("max by (pod) (kvroute_event_lag_seconds)", "{{pod}}")),
            "s",
            "Engine event to shadow index, for the latest applied entry.",
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "KV-event reads/s and entries per read",
            targets(
                ("sum by (pod) (rate(kvroute_event_reads[$__rate_interval]))", "{{pod}} reads/s"),
                (
                    "sum(rate(kvroute_event_entries_read[$__rate_interval])) / "
                    "sum(rate(kvroute_event_reads[$__rate_interval]))",
                    "entries per read (all gateways)",
                ),
            ),
            description="XREADs each gateway sends Redis, and how many stream entries one "
            "brings back: near 1 on a lightly loaded bus (a read per entry), higher as "
            "events arrive faster than reads return.",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "Index resyncs, gaps and orphan stores",
            targets(
                ("max(kvroute_index_resyncs)", "resyncs"),
                ("max(kvroute_index_gaps)", "stream gaps"),
                ("max(kvroute_index_orphan_stores)", "orphan stores"),
            ),
            description="Totals since the gateway started (worst replica).",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "Placements shared between gateway replicas/s",
            targets(
                (
                    "sum by (pod, outcome) (rate(kvroute_placements[$__rate_interval]))",
                    "{{pod}} {{outcome}}",
                ),
            ),
            description="Speculative inserts each replica sent the others (published), took "
            "from them (adopted: about the other replicas' published), lost to a Redis error or "
            "a full outbox (dropped) or could not decode (garbage). A lone gateway publishes "
            "none: only a heartbeat a second. With replicas, adopted near 0 means they route "
            "without knowing each other's placements (docs/protocol.md, section 9).",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "Other replicas' requests counted in each replica's load view",
            targets(
                ('sum by (pod) (kvroute_remote_requests{outcome="inflight"})', "{{pod}} in flight"),
                (
                    'sum by (pod, outcome) (rate(kvroute_remote_requests{outcome!="inflight"}'
                    "[$__rate_interval]))",
                    "{{pod}} {{outcome}}/s",
                ),
            ),
            description="replicas.share_load: the other replicas' requests each replica counts "
            "in its load views and prefix rates (started), and how they stopped counting: their "
            "end heard (ended), or lost (expired: their replica fell silent, or the TTL). Expired "
            "or unknown above a trickle means notes are lost on the way (Redis errors, a full "
            "journal), and each replica then sees the others' load later, from engine reports.",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "Agent: canonical blocks published/s",
            targets(
                (
                    f"sum by (op) (rate(kvroute_agent_canonical_blocks_total{{{AGENT}}}[{RATE}]))",
                    "{{op}}",
                ),
                (
                    f"sum(rate(kvroute_agent_entries_published_total{{{AGENT}}}[{RATE}]))",
                    "stream entries",
                ),
            ),
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "Agent: errors and recoveries/s",
            targets(
                (
                    f"sum by (pod) (rate(kvroute_agent_publish_errors_total{{{AGENT}}}[{RATE}]))",
                    "{{pod}} bus errors",
                ),
                (
                    f"sum by (pod) (rate(kvroute_agent_sequence_gaps_total{{{AGENT}}}[{RATE}]))",
                    "{{pod}} sequence gaps",
                ),
                (
                    f"sum by (result) (rate(kvroute_agent_replays_total{{{AGENT}}}[{RATE}]))",
                    "replay {{result}}",
                ),
                (
                    f"sum by (reason) (rate(kvroute_agent_events_bad_total{{{AGENT}}}[{RATE}]))",
                    "bad: {{reason}}",
                ),
            ),
            description="Failed Redis writes (events and heartbeats), engine sequence gaps, "
            "replays and skipped frames.",
        ),
        8,
        8,
    )
    L.add(
        timeseries(
            "Agent: unpublished events",
            targets((f"max by (pod) (kvroute_agent_buffer_depth{{{AGENT}}})", "{{pod}}")),
            description="Buffered while Redis is slow or away.",
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Tokenizer cache hit ratio and cost model scale",
            targets(
                (
                    f"max by (pool) (kvroute_tokenizer_cache_hit_ratio{{{POOL}}})",
                    "{{pool}} token cache",
                ),
                (f"max by (pool) (kvroute_cost_model_scale{{{POOL}}})", "{{pool}} cost scale"),
            ),
            description="Share of tokens served by the incremental tokenization cache; the TTFT "
            "cost model's online calibration factor.",
        ),
        12,
        8,
    )
    return L.panels


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    return {
        "title": "kvroute",
        "uid": "kvroute",
        "description": "kvroute cache-aware routing: hit rate, latency, traffic, workers, event bus.",
        "tags": ["kvroute", "llm", "inference"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Data source",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable("pool", "Pool", "label_values(kvroute_cost_model_scale, pool)"),
                variable(
                    "worker",
                    "Worker",
                    'label_values(kvroute_worker_healthy{pool=~"$pool"}, worker)',
                ),
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
