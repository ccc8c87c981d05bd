"""``kvroute demo``: the whole system under load, kvroute against round robin, in minutes.

Starts a private Redis, 4 simulated GPU workers (vLLM flavor, the seed design's 70B timing)
each with its worker agent, and the gateway; replays the same multi-turn chat workload
(shared system prompts, growing conversations, caches too small for everything) through
kvroute's default policy and through round robin for about a minute each; prints a
side-by-side table and writes a report with plots. Every process it started is stopped at
the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.compare import CompareConfig, run_compare
from loadtest.peers import KINDS, PeerNotInstalled, peer_spec
from loadtest.report import format_table

__all__ = ["add_arguments", "demo_config", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds per system")
    p.add_argument(
        "--rate", type=float, default=None, help="requests/s offered (default 9; vllm-cpu 0.8)"
    )
    p.add_argument("--workers", type=int, default=None, help="workers (default 4; vllm-cpu 2)")
    p.add_argument(
        "--engine",
        choices=["sim", "vllm-cpu"],
        default="sim",
        help="simulated GPU workers, or real vLLM on this machine's CPU (scripts/install-vllm; "
        "a tiny model with random weights: vLLM's own caching, a CPU's timing)",
    )
    p.add_argument("--out-dir", default="reports/demo", help="where the report and plots go")
    p.add_argument("--json", action="store_true", help="print the JSON result at the end")


def demo_systems() -> list[str]:
    """kvroute, round robin and the strongest peer installed: vllm-router kv_aware, which
    reads the engines' KV events as kvroute does and served the most of the peers in the
    comparisons (docs/benchmarks.md)."""
    systems = ["kvroute", "kvroute-round_robin"]
    strongest = "vllm-router-kv_aware"
    try:
        KINDS[peer_spec(strongest).kind].check_installed()
    except PeerNotInstalled:
        return systems
    return [*systems, strongest]


def demo_config(args: argparse.Namespace) -> CompareConfig:
    real = args.engine == "vllm-cpu"
    return CompareConfig(
        workload="chat",
        params={
            "conversations": 1500,
            "turns": [3, 8] if not real else [2, 4],
            "system_prompts": 12,
            "system_tokens": 1500 if not real else 500,
            "user_tokens": [50, 250] if not real else [30, 120],
            "assistant_tokens": [20, 50] if not real else [8, 16],
            "think_time": 5.0,
        },
        loads=[1.0],
        capacity_rps=args.rate or (0.8 if real else 9.0),
        systems=demo_systems(),
        workers=args.workers or (2 if real else 4),
        # the working set does not fit, caches evict: 16k tokens per worker (the simulator's
        # 16-token blocks; vLLM's 32-token ones)
        kv_blocks=1024 if not real else 512,
        timing="seed-70b",
        speedup=1.0,
        duration=args.duration,
        slo_ttft_ms=1000.0 if not real else 5000.0,
        slo_probes=0,  # capacity at SLO from the run itself: no extra runs in the demo
        out_dir=args.out_dir,
        engine=args.engine,
    )


def run(args: argparse.Namespace) -> int:
    if shutil.which("redis-server") is None:
        print(
            "kvroute demo: redis-server is not installed; run scripts/setup (it installs the "
            "Debian package) or `apt-get install redis-server`, then try again.",
            file=sys.stderr,
        )
        return 2
    cfg = demo_config(args)
    workers = (
        f"{cfg.workers} real vLLM engines (CPU build, a tiny model with random weights: "
        "vLLM's own prefix cache and events, a CPU's timing)"
        if cfg.engine == "vllm-cpu"
        else f"{cfg.workers} simulated GPU workers (70B-class timing)"
    )
    print(
        f"kvroute demo: {workers} with agents, Redis and the gateway; systems "
        f"{', '.join(cfg.systems)}; multi-turn chat at {cfg.capacity_rps:g} req/s, "
        f"~{args.duration:g}s measured per system after a warm-up. Logs and report under "
        f"{cfg.out_dir}/.",
        flush=True,
    )
    t0 = time.monotonic()
    report = run_compare(cfg)
    rows = _side_by_side(report["results"])
    print()
    print(format_table(rows))
    kv, others = report["results"][0], report["results"][1:]
    print()
    print(_verdict(kv, others))
    md = Path(cfg.out_dir) / "README.md"
    md.write_text(_report_markdown(report, rows, kv, others))
    print(f"\nreport: {md} (plots beside it); took {time.monotonic() - t0:.0f}s")
    if args.json:
        print(
            json.dumps(
                {
                    **report,
                    "results": [
                        {k: v for k, v in r.items() if k not in ("ttfts_ms",)}
                        for r in report["results"]
                    ],
                },
                indent=2,
            )
        )
    return 0


def _side_by_side(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = {
        "kvroute": "kvroute (predicted TTFT)",
        "kvroute-round_robin": "round robin",
        "vllm-router-kv_aware": "vllm-router kv_aware",
    }
    return [
        {"system": names.get(r["system"], r["system"]), "failed": f"run failed: {r['error']}"}
        if "error" in r
        else {
            "system": names.get(r["system"], r["system"]),
            "hit rate": r["hit_rate"],
            "TTFT p50 (ms)": r["ttft_p50_ms"],
            "TTFT p99 (ms)": r["ttft_p99_ms"],
            "throughput (req/s)": r["throughput_rps"],
            "goodput": r["goodput"],
            "max/mean load": r["max_mean_load"],
            "failed": r["failed"],
        }
        for r in results
    ]


def _verdict(kv: dict[str, Any], others: list[dict[str, Any]]) -> str:
    def ratio(a: float | None, b: float | None) -> str:
        return f"{b / a:.1f}x" if a and b else "n/a"

    names = {"kvroute-round_robin": "round robin", "vllm-router-kv_aware": "vllm-router kv_aware"}
    if "error" in kv:
        return f"kvroute's run failed: {kv['error']}"
    lines = [f"kvroute served {kv['hit_rate']:.0%} of prompt tokens from cache."]
    for o in others:
        if "error" in o:
            lines.append(f"{names.get(o['system'], o['system'])}: the run failed ({o['error']}).")
            continue
        lines.append(
            f"Against {names.get(o['system'], o['system'])} ({o['hit_rate']:.0%} from cache): "
            f"TTFT p50 {ratio(kv['ttft_p50_ms'], o['ttft_p50_ms'])} and p99 "
            f"{ratio(kv['ttft_p99_ms'], o['ttft_p99_ms'])} lower."
        )
    return "\n".join(lines)


def _report_markdown(
    report: dict[str, Any],
    rows: list[dict[str, Any]],
    kv: dict[str, Any],
    others: list[dict[str, Any]],
) -> str:
    plots = "\n".join(
        f"![{Path(p).stem}]({Path(p).name})"
        for p in report.get("plots", [])
        if isinstance(report.get("plots"), list)
    )
    return (
        "# kvroute demo\n\n"
        f"Workload: `{json.dumps(report['workload'])}`\n\n"
        f"{format_table(rows, markdown=True)}\n\n{_verdict(kv, others)}\n\n{plots}\n"
    )
