"""``kvroute loadtest run|compare``: drive load at an endpoint, or compare routers.

``run`` sends a workload to any OpenAI-compatible endpoint (a kvroute gateway, a peer
router, an engine) and prints the summary. ``compare`` runs the full comparison on a private
sim cluster; its settings come from a preset (``loadtest/presets/NAME.yaml``), a YAML file,
``--set`` and named flags, in that order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from gateway.contract.settings import ConfigError, load_config, parse_assignments
from loadtest.compare import CompareConfig, run_compare
from loadtest.driver import DriverConfig, run_load
from loadtest.report import format_table
from loadtest.workloads import make_workload

__all__ = ["add_arguments", "preset_path", "presets", "run"]


def presets() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml")
        for p in resources.files("loadtest").joinpath("presets").iterdir()
        if p.name.endswith(".yaml")
    )


def preset_path(name: str) -> Path:
    path = Path(str(resources.files("loadtest").joinpath("presets", f"{name}.yaml")))
    if not path.exists():
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(presets())}")
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = sub.add_parser("run", help="send a workload to an endpoint and measure it")
    r.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--model", required=True)
    r.add_argument("--workload", default="chat", help="chat, agent, shared_prefix, trace")
    r.add_argument("--set", action="append", metavar="PARAM=VALUE", help="workload parameter")
    r.add_argument(
        "--rate", type=float, default=0.0, help="requests/s (0: the workload's own timing)"
    )
    r.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    r.add_argument("--max-requests", type=int)
    r.add_argument("--mode", default="chat", choices=["chat", "completion", "completion_ids"])
    r.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT objective for goodput")
    r.add_argument("--api-key", help="Authorization: Bearer key")
    r.add_argument("--json", action="store_true", help="print only JSON")
    r.add_argument("--out", help="write the JSON summary here")
    c = sub.add_parser("compare", help="the same workload through kvroute and peer routers")
    c.add_argument("--preset", help=f"a scenario ({', '.join(presets())})")
    c.add_argument("--config", help="YAML file with CompareConfig settings")
    c.add_argument("--workload", help="chat, agent, shared_prefix, trace (--set params.path=...)")
    c.add_argument("--loads", help="offered loads as fractions of capacity, e.g. 0.3,0.6,0.8,0.95")
    c.add_argument("--rates", help="alias of --loads")
    c.add_argument(
        "--capacity",
        type=float,
        help="requests/s at load 1.0 (default: the pooled-cache cluster's, estimated offline)",
    )
    c.add_argument(
        "--systems",
        help="comma-separated, e.g. kvroute,smg-cache_aware,vllm-router-kv_aware,smg-round_robin",
    )
    c.add_argument(
        "--tune-smg",
        action="store_true",
        help="first run every smg setting at tune_load; the best stands in for smg-cache_aware",
    )
    c.add_argument("--workers", type=int)
    c.add_argument("--duration", type=float, help="measured seconds per run")
    c.add_argument("--out-dir", help="where JSON, markdown and plots go")
    c.add_argument("--set", action="append", metavar="PATH=VALUE", help="any CompareConfig setting")
    c.add_argument("--json", action="store_true", help="print only the JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "run":
            return _run(args)
        return _compare(args)
    except ConfigError as exc:
        print(f"kvroute loadtest: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    params: dict[str, Any] = parse_assignments(args.set)
    workload = make_workload(args.workload, **params)
    if args.rate:
        workload = workload.scaled(args.rate)
    items = list(workload.items())
    if workload.prompt_kind == "ids" and args.mode != "completion_ids":
        args.mode = "completion_ids"
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    cfg = DriverConfig(
        args.url.rstrip("/"),
        args.model,
        args.mode,
        args.max_requests,
        args.duration,
        slo_ttft_ms=args.slo_ms,
        headers=headers,
        progress=not args.json,
    )
    result = asyncio.run(run_load(items, cfg))
    out = {"workload": workload.describe(), **result.to_json()}
    text = json.dumps(out, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    if not args.json:
        s = result.summary
        rows = [
            {
                k: s[k]
                for k in (
                    "requests",
                    "failed",
                    "throughput_rps",
                    "ttft_p50_ms",
                    "ttft_p99_ms",
                    "itl_p50_ms",
                    "hit_rate",
                    "goodput",
                    "max_mean_requests",
                )
            }
        ]
        print(format_table(rows))
    return 0 if result.summary["failed"] == 0 else 1


def compare_config(args: argparse.Namespace) -> CompareConfig:
    file = preset_path(args.preset) if args.preset else args.config
    overrides: dict[str, Any] = parse_assignments(args.set)
    loads = args.loads or args.rates
    named = {
        "workload": args.workload,
        "loads": [float(x) for x in loads.split(",")] if loads else None,
        "capacity_rps": args.capacity,
        "systems": args.systems.split(",") if args.systems else None,
        "workers": args.workers,
        "duration": args.duration,
        "out_dir": args.out_dir,
        "tune_smg": True if args.tune_smg else None,
    }
    overrides.update({k: v for k, v in named.items() if v is not None})
    return load_config(CompareConfig, file=file, env={}, overrides=overrides)


def _compare(args: argparse.Namespace) -> int:
    cfg = compare_config(args)
    cfg.progress = not args.json
    # capacity (load 1.0) and the pooled-cache bound of every run's window come from the
    # offline simulator on the very requests sent (see loadtest.compare)
    try:
        report = run_compare(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(json.dumps(_slim(report), indent=2, default=str))
    if not args.json:
        print(Path(cfg.out_dir, "compare.md").read_text())
    return 0


def _slim(obj: Any) -> Any:
    """The report without per-request TTFTs and per-worker tables (they are in the file)."""
    if isinstance(obj, dict):
        return {k: _slim(v) for k, v in obj.items() if k not in ("ttfts_ms", "per_worker")}
    if isinstance(obj, list):
        return [_slim(v) for v in obj]
    return obj
