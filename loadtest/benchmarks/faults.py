"""``kvroute bench faults``: the fault-injection suite as one report (R1-R5, docs/reliability.md).

Each fault runs on a fresh stack (Redis, sim workers, agents, gateway) under background
load; the JSON has one entry per fault plus the totals ``failed_requests`` (client requests
that failed and should not have) and ``lost`` (workers whose index entry diverged from
their agent's mirror after recovery).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loadtest.faults import FAULTS, FaultResult, run_fault, summary
from loadtest.stack import Stack, StackConfig

NAME = "faults"
HELP = "fault injection: Redis outage, agent/engine restarts, gaps, dead/stuck workers, bad events"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}"
    )
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--redis-outage", type=float, default=30.0, help="seconds Redis stays down (R1)")
    p.add_argument("--log-dir", default="", help="keep each scenario's process logs here")


def stack_for(fault: str, workers: int, log_dir: Path | None) -> StackConfig:
    """The stack a fault runs on. A stuck worker is shown with a load-blind policy: the
    default policy already steers away from a worker whose requests get no first token, so
    only round robin keeps sending it requests that must time out and open its circuit."""
    if fault == "stuck_worker":
        settings: dict[str, Any] = {"proxy": {"first_byte_timeout": 2.0, "idle_timeout": 3.0}}
        return StackConfig(
            workers=workers,
            speedup=10.0,
            kv_blocks=2048,
            policy="round_robin",
            gateway_settings=settings,
            log_dir=log_dir,
        )
    return StackConfig(workers=workers, speedup=10.0, kv_blocks=2048, log_dir=log_dir)


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: list[FaultResult] = []
    for name in [f.strip() for f in args.faults.split(",") if f.strip()]:
        log_dir = Path(args.log_dir) / name if args.log_dir else None
        with Stack(stack_for(name, args.workers, log_dir)) as stack:
            params = {"outage_s": args.redis_outage} if name == "redis_outage" else {}
            res = run_fault(name, stack, **params)
        print(
            f"{name:<16} ok={res.ok} requests={res.requests} failed={res.failed} broken_streams={res.broken_streams} lost={res.lost} recovery_s={res.recovery_s} {res.detail}",
            file=sys.stderr,
            flush=True,
        )
        results.append(res)
    out = summary(results)
    out["table"] = [
        {
            "fault": r.fault,
            "injected": r.injected,
            "requests": r.requests,
            "failed": r.failed,
            "broken streams": r.broken_streams,
            "lost": r.lost,
            "recovery (s)": r.recovery_s,
            "ok": r.ok,
        }
        for r in results
    ]
    return out
