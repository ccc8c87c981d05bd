"""``kvroute loadtest compare``: one workload, one sim cluster, several routers, one report.

For each system (kvroute with its default policy, kvroute with a baseline policy, real
sglang-router with ``cache_aware`` and ``round_robin``) and each offered load (a fraction of
the cluster's capacity), the same seeded workload is replayed open-loop against the same
simulated workers, whose caches are emptied before every run. Per-worker hit rates and
request counts are read from the workers' own ``/metrics`` (before/after each run), so
every router is measured the same way, headers or not.

Output: one JSON object (the shape in the issue), a markdown table, and PNG plots.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.driver import DriverConfig, balance, run_load, summarize
from loadtest.harness import ChildProcess
from loadtest.peers import sglang_router, wait_router_ready
from loadtest.report import format_table
from loadtest.stack import Stack, StackConfig
from loadtest.workloads import WorkItem, make_workload

__all__ = ["SYSTEMS", "CompareConfig", "run_compare", "scrape_workers"]

SYSTEMS = (
    "kvroute",
    "kvroute-round_robin",
    "kvroute-least_load",
    "kvroute-prefix",
    "kvroute-session",
    "kvroute-random",
    "sglang-cache_aware",
    "sglang-round_robin",
    "sglang-power_of_two",
)


@dataclass
class CompareConfig:
    workload: str = "chat"
    params: dict[str, Any] = field(default_factory=dict)
    loads: list[float] = field(default_factory=lambda: [0.3, 0.6, 0.8, 0.95])
    #: requests/s the cluster sustains on this workload (load 1.0); 0: estimate offline
    capacity_rps: float = 0.0
    systems: list[str] = field(
        default_factory=lambda: [
            "kvroute",
            "kvroute-round_robin",
            "sglang-cache_aware",
            "sglang-round_robin",
        ]
    )
    workers: int = 8
    kv_blocks: int = 4096
    block_size: int = 16
    speedup: float = 1.0
    timing: str = "mocker"
    duration: float = 60.0
    slo_ttft_ms: float = 1000.0
    #: gateway replicas per kvroute system (and sglang-router processes); the driver
    #: spreads requests over them round-robin, like a load balancer in front
    replicas: int = 1
    mode: str = "chat"
    out_dir: str = "reports/compare"
    seed: int = 0
    progress: bool = True


def scrape_workers(urls: list[str]) -> dict[str, dict[str, float]]:
    """Per worker: requests finished, prompt tokens, cached prompt tokens (engine counters)."""
    out = {}
    for i, url in enumerate(urls):
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out[f"worker-{i}"] = {
            "requests": _metric(text, ("vllm:request_success_total", "sglang:num_requests_total")),
            "prompt_tokens": _metric(
                text, ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total")
            ),
            "cached_tokens": _metric(
                text, ("vllm:prefix_cache_hits_total", "sglang:cached_tokens_total")
            ),
        }
    return out


def _metric(text: str, names: tuple[str, ...]) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(names) and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                total += float(line.rsplit(" ", 1)[1])
    return total


def _delta(
    after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    out = {}
    for w, a in after.items():
        b = before.get(w, {})
        d = {k: a[k] - b.get(k, 0.0) for k in a}
        d["hit_rate"] = (
            round(d["cached_tokens"] / d["prompt_tokens"], 4) if d["prompt_tokens"] else 0.0
        )
        out[w] = d
    return out


def run_compare(
    cfg: CompareConfig, bound_hit_rate: float | None = None, reference: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run every (system, load) pair; write JSON, markdown and plots to ``cfg.out_dir``."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workload = make_workload(cfg.workload, seed=cfg.seed, **cfg.params)
    if not cfg.capacity_rps:
        raise ValueError(
            "capacity_rps is required (estimate it with `kvroute simulate --capacity`)"
        )
    base_items = list(workload.items())
    stack_cfg = StackConfig(
        workers=cfg.workers,
        kv_blocks=cfg.kv_blocks,
        block_size=cfg.block_size,
        speedup=cfg.speedup,
        timing=cfg.timing,
        gateways=0,
        log_dir=out / "logs",
    )
    results: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "workload": workload.describe(),
        "bound_hit_rate": bound_hit_rate,
        "capacity_rps": cfg.capacity_rps,
        "config": asdict(cfg),
        "offline_reference": reference,
        "results": results,
    }
    with Stack(stack_cfg) as stack:
        for system in cfg.systems:
            for load in cfg.loads:
                rate = load * cfg.capacity_rps
                items, warmup = _window(base_items, rate, cfg.duration, workload.sessions_ramp)
                row: dict[str, Any] = {"system": system, "load": load, "rate": round(rate, 3)}
                try:
                    res = _run_one(stack, cfg, system, items, warmup, f"{system} @ {load:.0%}")
                except (OSError, TimeoutError, RuntimeError) as exc:
                    # one system failing (a peer that will not start, workers that will not
                    # drain) must not cost the runs already done or the systems after it
                    res = {"error": f"{type(exc).__name__}: {exc}"}
                row.update(res)
                results.append(row)
                print(_row_line(row), flush=True)
                _write_report(report, out)  # every finished run is on disk at once
    _write_report(report, out)
    try:
        from loadtest.plots import compare_plots

        report["plots"] = compare_plots(report, out)
    except ImportError as exc:  # matplotlib is in the bench extra
        report["plots"] = f"not drawn: {exc}"
    return report


def _write_report(report: dict[str, Any], out: Path) -> None:
    (out / "compare.json").write_text(json.dumps(report, indent=2))
    (out / "compare.md").write_text(markdown(report))


def _window(
    items: list[WorkItem], rate: float, duration: float, sessions_ramp: bool = True
) -> tuple[list[WorkItem], float]:
    """Retime ``items`` so the steady-state request rate is ``rate``; returns (items, warmup).

    With ``sessions_ramp`` (conversations, agents), sessions start as a Poisson stream and
    then issue their turns over time, so a run starting from nothing ramps up: the first
    requests all come from young sessions. Everything is sent from t=0, but only requests
    scheduled after the warm-up (the median session span) are measured, over ``duration``
    seconds. Without it (independent requests: shared-prefix groups, traces) the stream's
    own mean rate is scaled to ``rate`` and there is no warm-up.
    """
    if len(items) < 2:
        return items, 0.0
    if sessions_ramp:
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        for it in items:
            first.setdefault(it.session, it.at)
            last[it.session] = it.at
        starts = sorted(first.values())
        span = starts[-1] - starts[0]
        steady = (len(starts) - 1) / span * (len(items) / len(starts)) if span > 0 else 0.0
        spans = sorted(last[s] - first[s] for s in first)
    else:
        span = items[-1].at - items[0].at
        steady = (len(items) - 1) / span if span > 0 else 0.0
        spans = [0.0]
    if steady <= 0:
        raise ValueError("the workload's arrivals span no time: cannot retime it to a rate")
    factor = steady / rate
    warmup = spans[len(spans) // 2] * factor
    out = [
        WorkItem(it.index, it.at * factor, it.session, it.segments, it.max_tokens)
        for it in items
        if it.at * factor <= warmup + duration
    ]
    return out, warmup


#: engine gauges of requests still in a worker (vLLM and SGLang names)
BUSY_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
)


def _busy_requests(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            total += _metric(resp.read().decode(), BUSY_METRICS)
    return total


def _reset_workers(stack: Stack, timeout: float = 300.0) -> None:
    """Empty every worker's cache the engine's own way (AllBlocksCleared) and wait for the
    gateways' indexes to follow.

    An overloaded run (round robin past its capacity) leaves a backlog that the engines
    work off, or abort as their clients disconnect, after the driver stops; a request still
    running would cache blocks again after the reset. So: wait until no worker runs or
    queues a request, then reset, and reset again if blocks came back meanwhile."""
    deadline = time.monotonic() + timeout
    while (busy := _busy_requests(stack.worker_urls)) > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers still busy ({busy:g} requests) {timeout:g}s after a run")
        time.sleep(0.5)
    path = "/flush_cache" if stack.config.flavor == "sglang" else "/reset_prefix_cache"
    while True:
        for url in stack.worker_urls:
            req = urllib.request.Request(url + path, data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                resp.read()
        again = time.monotonic() + 10.0
        while time.monotonic() < again:
            if not any(w["index_blocks"] for url in stack.gateway_urls for w in stack.workers(url)):
                return
            time.sleep(0.1)
        if time.monotonic() > deadline:
            raise TimeoutError("gateway index not cleared after resetting the workers' caches")


def _run_one(
    stack: Stack, cfg: CompareConfig, system: str, items: list[WorkItem], warmup: float, label: str
) -> dict[str, Any]:
    kind, _, policy = system.partition("-")
    routers: list[ChildProcess] = []
    urls: list[str] = []
    if kind == "kvroute":
        stack.config.policy = policy or "ttft"
        for g in range(cfg.replicas):
            if g < len(stack.gateways):
                stack.restart_gateway(g)
            else:
                stack.start_gateway(g)
        stack.wait_ready()
        urls = stack.gateway_urls[: cfg.replicas]
        _reset_workers(stack)
    elif kind == "sglang":
        _reset_workers(stack)
        for g in range(cfg.replicas):
            proc, url = sglang_router(
                stack.worker_urls,
                policy or "cache_aware",
                stack.log_dir,
                name=f"sglang-{policy}-{g}",
            )
            routers.append(stack.add_process(proc))
            urls.append(url)
        for proc, url in zip(routers, urls, strict=True):
            wait_router_ready(proc, url, len(stack.worker_urls))
    else:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    try:
        snap: dict[str, dict[str, dict[str, float]]] = {}
        timer = threading.Timer(
            warmup, lambda: snap.setdefault("at_warmup", scrape_workers(stack.worker_urls))
        )
        dcfg = DriverConfig(
            base_url=urls[0],
            model=stack.config.model,
            mode=cfg.mode,  # type: ignore[arg-type]
            max_duration=warmup + cfg.duration,
            drain_timeout=max(60.0, cfg.duration),
            slo_ttft_ms=cfg.slo_ttft_ms,
            progress=cfg.progress,
            label=label,
        )
        timer.start()
        try:
            result = asyncio.run(run_load(items, dcfg, base_urls=urls))
        finally:
            timer.cancel()
        before = snap.get("at_warmup") or scrape_workers(stack.worker_urls)
        per_worker = _delta(scrape_workers(stack.worker_urls), before)
    finally:
        for proc in routers:
            proc.stop()
            stack.extra.remove(proc)
    measured = [
        r
        for r in result.records
        if r.scheduled >= warmup and r.error != "not sent: beyond max_duration"
    ]
    s = summarize(measured, cfg.duration, cfg.slo_ttft_ms)
    bal = balance(
        {w: v["requests"] for w, v in per_worker.items()},
        {w: v["prompt_tokens"] for w, v in per_worker.items()},
    )
    engine_prompt = sum(v["prompt_tokens"] for v in per_worker.values())
    engine_cached = sum(v["cached_tokens"] for v in per_worker.values())
    return {
        "hit_rate": s["hit_rate"],
        "engine_hit_rate": round(engine_cached / engine_prompt, 4) if engine_prompt else 0.0,
        "ttft_p50_ms": s["ttft_p50_ms"],
        "ttft_p99_ms": s["ttft_p99_ms"],
        "ttft_mean_ms": s["ttft_mean_ms"],
        "e2e_p50_ms": s["e2e_p50_ms"],
        "itl_p50_ms": s["itl_p50_ms"],
        "goodput": s["goodput"],
        "throughput_rps": s["throughput_rps"],
        "requests": s["requests"],
        "failed": s["failed"],
        "max_mean_load": bal["max_mean_requests"],
        "max_mean_tokens": bal["max_mean_tokens"],
        "per_worker": per_worker,
        "warmup_s": round(warmup, 1),
        "ttfts_ms": sorted(
            round(r.ttft * 1000, 2) for r in measured if r.ok and r.ttft is not None
        ),
    }


def _row_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return (
            f"{r['system']:<22} load {r['load']:.2f} rate {r['rate']:7.2f}/s  FAILED: {r['error']}"
        )
    return (
        f"{r['system']:<22} load {r['load']:.2f} rate {r['rate']:7.2f}/s  hit {r['hit_rate']:.3f}  "
        f"ttft p50 {r['ttft_p50_ms']} p99 {r['ttft_p99_ms']} ms  goodput {r['goodput']:.3f}  "
        f"max/mean {r['max_mean_load']}  failed {r['failed']}"
    )


#: markdown column -> result key
COLUMNS = {
    "system": "system",
    "load": "load",
    "rate (req/s)": "rate",
    "hit rate": "hit_rate",
    "TTFT p50 (ms)": "ttft_p50_ms",
    "TTFT p99 (ms)": "ttft_p99_ms",
    "goodput": "goodput",
    "max/mean load": "max_mean_load",
    "failed": "failed",
}


def markdown(report: dict[str, Any]) -> str:
    rows = [
        {col: r.get(key, "") for col, key in COLUMNS.items()}
        | ({"failed": f"run failed: {r['error']}"} if "error" in r else {})
        for r in report["results"]
    ]
    head = f"Workload: `{json.dumps(report['workload'])}`\n\n"
    if report.get("bound_hit_rate") is not None:
        head += f"Pooled-cache bound on the hit rate: **{report['bound_hit_rate']:.3f}**\n\n"
    return head + format_table(rows, markdown=True) + "\n"
