"""``kvroute bench hot``: target Q3 in the offline cluster simulator (hot prefix vs round robin).

Q3: one 6,000-token system prompt on every request (2 and 8 workers), and one that appears
suddenly in steady traffic: TTFT p50 and p99 never worse than round robin at any load, with
max/mean load <= 1.3 and the hit rate >= 90% of the bound. The live comparison
(``kvroute loadtest compare --preset hot-prefix-2``) takes minutes per load on this machine;
this runs the same routing core against the engine simulator in virtual time, in seconds.

Streams (token ids, no tokenizer): ``steady``: every request is the hot prefix and its own
question (``--prefix-tokens``, ``--question-tokens``, ``--output-tokens``), Poisson arrivals;
``sudden``: background traffic of ``--groups`` shared prefixes of ``--background-prefix``
tokens, and from ``--sudden-at`` (a fraction of the run) a share ``--hot-share`` of the
requests carry the hot prefix instead.

Load 1.0 is policy-neutral, as in the live comparison: the capacity of the pooled-cache
cluster (one worker with all the cluster's compute and KV blocks, no routing), from
``estimate_capacity``. Each system runs the same stream at every load; ``vs_rr`` is its TTFT
over round robin's in the same run (≤ 1.0 meets Q3). Systems: ``kvroute`` (the default
policy: demand-sized holders, warm-ups), ``kvroute-spill`` (the same sizing, new holders
get a real request cold instead of a warm-up), ``round_robin``.
"""

from __future__ import annotations

import argparse
import random
import struct
from collections.abc import Callable
from typing import Any

from loadtest.clustersim import (
    Arrival,
    ClusterConfig,
    estimate_capacity,
    pooled_config,
    simulate,
)
from loadtest.simulate import parse_params

NAME = "hot"
HELP = "Q3 offline: a hot prefix (steady or sudden), kvroute vs round robin, by load"

SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "kvroute": ("ttft", {}),
    "kvroute-spill": ("ttft", {"warmup": False}),
    "round_robin": ("round_robin", {}),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="2,8", help="cluster sizes, comma-separated")
    p.add_argument("--loads", default="0.3,0.6,0.8,0.95", help="fractions of capacity")
    p.add_argument("--systems", default="kvroute,round_robin",
                   help=f"comma-separated, of {', '.join(SYSTEMS)}")  # fmt: skip
    p.add_argument("--stream", default="steady", choices=["steady", "sudden"])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument("--prefix-tokens", type=int, default=6000)
    p.add_argument("--question-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--groups", type=int, default=32, help="sudden: background prefixes")
    p.add_argument("--background-prefix", type=int, default=1000, help="sudden: their tokens")
    p.add_argument("--sudden-at", type=float, default=0.3, help="sudden: start, run fraction")
    p.add_argument("--hot-share", type=float, default=0.8, help="sudden: share once hot")
    p.add_argument("--kv-blocks", type=int, default=4096, help="16-token blocks per worker")
    p.add_argument("--timing", default="seed-70b")
    p.add_argument("--seeds", type=int, default=1, help="streams per load (p99 is noisy)")
    p.add_argument("--capacity", type=float, help="req/s per worker at load 1.0 "
                   "(default: estimated, the pooled-cache cluster's)")  # fmt: skip
    p.add_argument("--policy-param", action="append", default=[], metavar="NAME=VALUE",
                   help="extra ttft parameters for kvroute and kvroute-spill")  # fmt: skip


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 100_000) for _ in range(n)]


def _pack(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def stream(args: argparse.Namespace, rate: float, seed: int) -> list[Arrival]:
    """The run's requests at ``rate`` req/s for ``args.duration`` seconds."""
    rng = random.Random(seed)
    hot = _pack(_ids(random.Random("hot-prefix"), args.prefix_tokens))
    background = [
        _pack(_ids(random.Random(f"bg-{g}"), args.background_prefix)) for g in range(args.groups)
    ]
    start = args.sudden_at * args.duration if args.stream == "sudden" else 0.0
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < args.duration:
        question = _pack(_ids(rng, args.question_tokens))
        if args.stream == "steady" or (t >= start and rng.random() < args.hot_share):
            prefix = hot
        else:
            prefix = background[rng.randrange(len(background))]
        out.append(Arrival(len(out), t, prefix + question, args.output_tokens))
        t += rng.expovariate(rate)
    return out


def _config(args: argparse.Namespace, workers: int, system: str) -> ClusterConfig:
    policy, params = SYSTEMS[system]
    if policy == "ttft":
        params = {**params, **parse_params(args.policy_param)}
    return ClusterConfig(
        workers=workers,
        policy=policy,
        policy_params=params,
        kv_blocks=args.kv_blocks,
        timing=args.timing,
    )


def _capacity(args: argparse.Namespace, workers: int) -> float:
    if args.capacity:
        return float(args.capacity) * workers
    cfg = pooled_config(_config(args, workers, "round_robin"))
    source: Callable[[float], list[Arrival]] = lambda r: stream(args, r, 0)  # noqa: E731
    return estimate_capacity(source, cfg, reference=stream(args, 4.0 * workers, 0)).rate


def run(args: argparse.Namespace) -> dict[str, Any]:
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    try:
        parse_params(args.policy_param)
    except ValueError as exc:
        raise SystemExit(f"--policy-param: {exc}") from None
    rows: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    capacities: dict[int, float] = {}
    for workers in [int(x) for x in args.workers.split(",")]:
        cap = capacities[workers] = round(_capacity(args, workers), 2)
        for load in [float(x) for x in args.loads.split(",")]:
            rate = load * cap
            by: dict[str, dict[str, Any]] = {}
            for system in systems:
                acc = _Acc()
                for seed in range(args.seeds):
                    res = simulate(stream(args, rate, seed), _config(args, workers, system))
                    acc.add(res.summary, res.engine)
                by[system] = acc.row()
            base = by.get("round_robin")
            for system, r in by.items():
                row = {"workers": workers, "load": load, "rate": round(rate, 2),
                       "system": system, **r}  # fmt: skip
                if base is not None:
                    row["p50_vs_rr"] = _ratio(r["ttft_p50_ms"], base["ttft_p50_ms"])
                    row["p99_vs_rr"] = _ratio(r["ttft_p99_ms"], base["ttft_p99_ms"])
                rows.append(row)
                table.append({k: row.get(k) for k in _COLUMNS})
    met = [r["p50_vs_rr"] <= 1.0 and r["p99_vs_rr"] <= 1.0
           for r in rows if r["system"] == "kvroute" and "p50_vs_rr" in r]  # fmt: skip
    return {
        # Q3's TTFT clause on this run: kvroute's p50 and p99 <= round robin's at every load
        "ok": all(met),
        "stream": args.stream,
        "capacity_rps": capacities,
        "seeds": args.seeds,
        "duration_s": args.duration,
        "rows": rows,
        "table": table,
    }


_COLUMNS = ("workers", "load", "rate", "system", "ttft_p50_ms", "ttft_p99_ms", "p50_vs_rr",
            "p99_vs_rr", "hit_rate", "max_mean_requests", "warmups")  # fmt: skip


class _Acc:
    """Mean over seeds of each run's figures (p99 of 60 s of arrivals is noisy)."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []

    def add(self, summary: dict[str, Any], engine: dict[str, Any]) -> None:
        self.runs.append({
            "ttft_p50_ms": summary["ttft_p50_ms"],
            "ttft_p99_ms": summary["ttft_p99_ms"],
            "hit_rate": summary["hit_rate"],
            "max_mean_requests": summary["max_mean_requests"],
            "requests": summary["requests"],
            "warmups": engine.get("warmups", 0),
            "warmup_tokens": engine.get("warmup_tokens", 0),
        })  # fmt: skip

    def row(self) -> dict[str, Any]:
        n = len(self.runs)
        return {
            k: round(sum(r[k] or 0 for r in self.runs) / n, 4 if k == "hit_rate" else 1)
            for k in self.runs[0]
        }


def _ratio(a: float | None, b: float | None) -> float:
    return round(a / b, 3) if a and b else float("nan")
