"""A compare preset's own stream in the offline cluster simulator, policy by policy.

``python -m loadtest.presettrace --preset hot-sudden --duration 20 ...`` retimes the preset's
requests exactly as ``kvroute loadtest compare`` sends them (``loadtest.compare.Stream``) and
runs them through ``loadtest.clustersim`` on the preset's cluster (workers, KV blocks,
timing, speed-up), to read a live cell offline:

* ``--capacity``: load 1.0 as the compare command estimates it (the pooled-cache cluster),
  and beside it the highest rate at which the N separate workers under each ``--policies``
  meet the same criterion (p99 TTFT of the window <= ``capacity_ttft_factor`` x the cold
  prefill p99 of the requests): how far the real cluster is from the yardstick.
* ``--rates`` (or ``--loads``, fractions of load 1.0) x ``--seeds``: TTFT p50 / p90 / p99,
  the hit rate and the goodput (share of requests within the preset's ``slo_ttft_ms``) of
  the window for every policy, per workload seed (seed 0 is the preset's stream), and the
  means; with ``--by-size 2000,5000``, seed 0's median TTFT by uncached prompt tokens too;
  ``--json PATH`` writes the same cells as JSON.
* ``--slo-capacity``: per policy and seed, capacity at SLO as the live comparison defines it
  (the highest rate whose window keeps p90 TTFT <= the preset's ``slo_ttft_ms``; bisection to
  ``--rel-tol``), where a live run can afford a probe or two.
* A policy may carry parameters: ``ttft:compute_weight=3,tie_ms=2`` (``;`` between policies
  when any has parameters), as ``--set policy_params`` does live.
* ``--set key=value``: a setting of the compare configuration, as the compare command takes
  it; ``--set gateway_cost=engine`` gives the simulated gateway the engines' own cost model.
* ``--trace RATE``: one line per request for the first policy (seed ``--seed``): arrival,
  the first segment's key (e.g. ``hot`` or a group's prefix), worker, reason, the policy's
  predicted TTFT, the simulated TTFT, cached tokens, each engine's queued prompt tokens and
  running sequences at the arrival; warm-ups as they are sent.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gateway.routing.policy import Decision, make_policy
from gateway.routing.replication import WarmupIntent
from loadtest import cli
from loadtest.clustersim import Arrival, ClusterConfig, ClusterSim, SimResult, simulate
from loadtest.compare import (
    CompareConfig,
    Stream,
    gateway_cost,
    kv_blocks_from_model,
    neutral_capacity,
    search_max_rate,
    write_trace_window,
)
from loadtest.simulate import parse_policy
from loadtest.workloads import make_workload

__all__ = [
    "load_rates",
    "main",
    "parse_loads",
    "preset_cluster",
    "preset_config",
    "preset_stream",
    "window_ttfts",
]


def preset_config(
    preset: str, duration: float | None = None, sets: Sequence[str] = ()
) -> CompareConfig:
    """The compare command's configuration of ``preset`` (``duration``: its measured window;
    ``sets``: its ``--set key=value`` overrides, e.g. ``gateway_cost=engine``)."""
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    argv = ["compare", "--preset", preset]
    if duration:
        argv += ["--duration", str(duration)]
    for item in sets:
        argv += ["--set", item]
    cfg = cli.compare_config(p.parse_args(argv))
    if cfg.workload == "trace" and not cfg.params.get("path"):
        # the compare writes the preset's synthetic trace window into its out_dir; here it
        # goes to a directory of this process's own
        if cfg.synthetic_trace is None:
            raise SystemExit(f"preset {preset!r}: workload 'trace' needs params.path")
        directory = Path(tempfile.mkdtemp(prefix="kvroute-presettrace-"))
        atexit.register(shutil.rmtree, directory, True)
        window = write_trace_window(directory / "trace.jsonl", **asdict(cfg.synthetic_trace))
        cfg.params = {**cfg.params, "path": str(window)}
    return cfg


def preset_stream(cfg: CompareConfig, seed: int) -> Stream:
    """The preset's requests as the compare command sends them (workload seed ``seed``)."""
    workload = make_workload(cfg.workload, seed=seed, **cfg.params)
    # a trace's prompts are token ids: the offline simulator takes them as they are
    return Stream(workload, "completion_ids" if workload.prompt_kind == "ids" else cfg.mode)


def split_policies(text: str) -> list[str]:
    """``--policies``: comma-separated names, or ``;``-separated when a policy has parameters."""
    return [p for p in (text.split(";") if ";" in text or ":" in text else text.split(",")) if p]


def preset_cluster(cfg: CompareConfig, spec: str, seed: int, replicas: int = 1) -> ClusterConfig:
    """The preset's cluster under policy ``spec`` (``name`` or ``name:k=v,...``)."""
    policy, params = parse_policy(spec)
    config = ClusterConfig(
        replicas=replicas,
        workers=(cfg.prefill_workers or cfg.workers) * cfg.dp_size,
        policy=policy,
        policy_params=params,
        kv_blocks=cfg.kv_blocks or kv_blocks_from_model(cfg),
        block_size=cfg.block_size,
        timing=cfg.timing,
        speedup=cfg.speedup,
        attention=cfg.attention,
        seed=seed,
        slo_ttft_ms=cfg.slo_ttft_ms,
    )
    cost = gateway_cost(cfg)
    if cost is not None:
        config.cost = cost
    return config


def window_ttfts(res: SimResult, warmup: float) -> np.ndarray:
    arrival = np.frombuffer(res.table.arrival, dtype=np.float64)
    return np.frombuffer(res.table.ttft, dtype=np.float64)[arrival >= warmup] * 1000.0


def _max_rate(
    cfg: CompareConfig, stream: Stream, spec: str, seed: int, q: float, limit: float, tol: float
) -> float:
    """The highest rate at which ``spec``'s window keeps the q-th percentile TTFT <= ``limit``
    (ms): doubling, then bisection to ``tol``."""

    def probe(rate: float) -> bool:
        items, warmup = stream.window(rate, cfg.duration)
        t = window_ttfts(simulate(stream.arrivals(items), preset_cluster(cfg, spec, seed)), warmup)
        return len(t) > 0 and float(np.percentile(t, q)) <= limit

    return search_max_rate(probe, start=float(cfg.workers), max_probes=16, rel_tol=tol).rate


def capacities(cfg: CompareConfig, policies: list[str]) -> dict[str, Any]:
    stream = preset_stream(cfg, cfg.seed)
    pooled = neutral_capacity(stream, cfg)
    limit = pooled["limit_ms"]
    out: dict[str, Any] = {"load_1.0": pooled["capacity_rps"], "limit_ms": limit}
    for policy in policies:
        out[policy] = _max_rate(cfg, stream, policy, cfg.seed, 99, limit, 0.05)
    return out


def by_size(res: SimResult, warmup: float, edges: list[int]) -> str:
    """Median TTFT of the window's requests by uncached prompt tokens (bins between
    ``edges``, the last open-ended): which requests a policy makes wait."""
    tab = res.table
    arrival = np.frombuffer(tab.arrival, dtype=np.float64)
    ttft = np.frombuffer(tab.ttft, dtype=np.float64) * 1000.0
    new = np.frombuffer(tab.prompt_tokens, dtype=np.int64) - np.frombuffer(
        tab.cached_tokens, dtype=np.int64
    )
    keep = arrival >= warmup
    ttft, new = ttft[keep], new[keep]
    bounds = [0, *edges]
    cells = []
    for i, lo in enumerate(bounds):
        hi = bounds[i + 1] if i + 1 < len(bounds) else None
        sel = new >= lo if hi is None else (new >= lo) & (new < hi)
        label = f">= {lo}" if hi is None else f"[{lo}, {hi})"
        median = f"{np.median(ttft[sel]):.0f}" if sel.any() else "-"
        cells.append(f"{label} n {int(sel.sum())} p50 {median}")
    return " | ".join(cells)


def sweep(
    cfg: CompareConfig,
    policies: list[str],
    rates: list[float],
    seeds: int,
    edges: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Print each (rate, policy) cell's figures per seed and their means; return them too
    (``--json``): one dict per cell, per-seed lists and their means."""
    cells: list[dict[str, Any]] = []
    for rate in rates:
        per: dict[str, list[tuple[float, ...]]] = {p: [] for p in policies}
        sizes: dict[str, str] = {}
        for seed in range(seeds):
            stream = preset_stream(cfg, seed)
            items, warmup = stream.window(rate, cfg.duration)
            arrivals = stream.arrivals(items)
            for policy in policies:
                res = simulate(arrivals, preset_cluster(cfg, policy, seed))
                t = window_ttfts(res, warmup)
                if edges and seed == 0:
                    sizes[policy] = by_size(res, warmup, edges)
                precision = res.summary["index_precision"]
                p50, p90, p99 = np.percentile(t, [50, 90, 99])
                per[policy].append(
                    (
                        float(p50),
                        float(p90),
                        float(p99),
                        res.hit_rate,
                        np.nan if precision is None else precision,
                        float(np.mean(t <= cfg.slo_ttft_ms)),
                    )
                )
        for policy, xs in per.items():
            a = np.array(xs)
            columns = (  # (name, format, column of ``a``); column 4 is the precision
                ("p50", "{:6.0f}", 0),
                ("p90", "{:6.0f}", 1),
                ("p99", "{:6.0f}", 2),
                ("hit", "{:.3f}", 3),
                (f"goodput(<={cfg.slo_ttft_ms:.0f}ms)", "{:.3f}", 5),
            )
            cols = " | ".join(
                f"{name} {' '.join(fmt.format(x) for x in a[:, j])} mean {fmt.format(a[:, j].mean())}"
                for name, fmt, j in columns
            )
            print(f"rate {rate:6.2f} {policy:12s} {cols} | index precision (whole run)"
                  f" {' '.join(f'{x:.4f}' for x in a[:, 4])}")  # fmt: skip
            cell: dict[str, Any] = {"rate": rate, "policy": policy, "seeds": list(range(seeds))}
            for name, j in _CELL_COLUMNS:
                values = [None if np.isnan(x) else round(float(x), 6) for x in a[:, j]]
                cell[name] = values
                known = [x for x in values if x is not None]
                cell[f"{name}_mean"] = round(float(np.mean(known)), 6) if known else None
            cells.append(cell)
        for policy, line in sizes.items():
            print(f"rate {rate:6.2f} {policy:12s} seed 0, TTFT by uncached tokens: {line}")
    return cells


#: a sweep cell's JSON keys and their columns in ``sweep``'s per-seed tuples
_CELL_COLUMNS = (
    ("ttft_p50_ms", 0),
    ("ttft_p90_ms", 1),
    ("ttft_p99_ms", 2),
    ("hit_rate", 3),
    ("index_precision", 4),
    ("goodput", 5),
)


def slo_capacity(
    cfg: CompareConfig, policies: list[str], seeds: int, rel_tol: float
) -> dict[str, list[float]]:
    """Capacity at SLO offline, per policy and workload seed: the live definition
    (p90 TTFT of the measured window <= ``slo_ttft_ms``), bisected to ``rel_tol``."""
    streams = [preset_stream(cfg, seed) for seed in range(seeds)]
    out: dict[str, list[float]] = {}
    for policy in policies:
        rates = [
            _max_rate(cfg, stream, policy, seed, 90, cfg.slo_ttft_ms, rel_tol)
            for seed, stream in enumerate(streams)
        ]
        out[policy] = rates
        print(f"slo capacity {policy:12s} {' '.join(f'{r:6.2f}' for r in rates)}"
              f" mean {float(np.mean(rates)):6.2f} req/s", flush=True)  # fmt: skip
    return out


def _traced(config: ClusterConfig) -> tuple[ClusterSim, dict[int, tuple[Any, ...]]]:
    """The simulator, noting each decision with the engines' state at the arrival, and
    printing each warm-up as it is sent."""
    sim = ClusterSim(config)
    notes: dict[int, tuple[Any, ...]] = {}
    queues: list[tuple[int, int]] = []

    def before(a: Arrival) -> None:
        queues[:] = [(w.core.waiting_prompt_tokens, w.core.num_running) for w in sim.workers]

    def after(a: Arrival, d: Decision) -> None:
        notes[a.index] = (
            a.at,
            d.worker,
            d.reason,
            d.predicted_ttft_ms,
            d.matched_tokens,
            list(queues),
        )

    def warm(intent: WarmupIntent, t: float) -> None:
        print(f"  warm-up {intent.worker} {intent.tokens} tokens at {t:.3f} s")

    sim.before_route, sim.after_route, sim.on_warmup = before, after, warm
    return sim, notes


def trace(cfg: CompareConfig, policy: str, rate: float, seed: int) -> None:
    stream = preset_stream(cfg, seed)
    items, warmup = stream.window(rate, cfg.duration)
    first = {it.index: it.segments[0].key for it in items}
    sim, notes = _traced(preset_cluster(cfg, policy, seed))
    res = sim.run(stream.arrivals(items))
    rows = {int(r["index"]): r for r in res.table.rows()}
    print(
        "index arrival_s first_segment worker reason predicted_ms ttft_ms"
        " predicted_cached cached queues"
    )
    for i in sorted(notes):
        at, worker, reason, pred, matched, queues = notes[i]
        r = rows.get(i)
        ttft = f"{r['ttft'] * 1000:8.0f}" if r else "  failed"
        cached = int(r["cached_tokens"]) if r else -1
        shown = -1 if pred is None else round(pred)
        print(f"{i:5d} {at:8.3f} {first[i]:>8s} {worker:>9s} {reason:>9s} {shown:7d} {ttft}"
              f" {matched:6d} {cached:6d} {queues}")  # fmt: skip
    t = window_ttfts(res, warmup)
    eng = res.engine
    print(f"p50 {np.percentile(t, 50):.0f} ms, p99 {np.percentile(t, 99):.0f} ms, "
          f"hit rate {res.hit_rate:.4f}, warm-ups {eng['warmups']} "
          f"({eng['warmup_tokens']} tokens), uncached prompt tokens computed "
          f"{eng['engine_prompt_tokens'] - eng['engine_cached_tokens']}, "
          f"index precision {res.summary['index_precision']}, "
          f"last event at {res.duration:.1f} s")  # fmt: skip


def _numbers(p: argparse.ArgumentParser, flag: str, text: str, hint: str) -> list[float]:
    """A comma-separated list of positive numbers (a usage error otherwise)."""
    try:
        xs = [float(x) for x in text.split(",")]
    except ValueError:
        xs = []
    if not xs or min(xs) <= 0:
        p.error(f"{flag} {text!r}: {hint}")
    return xs


def _edges(p: argparse.ArgumentParser, text: str) -> list[int]:
    """``--by-size``: positive, increasing token counts."""
    hint = "increasing positive token counts, e.g. 2000,5000,10000"
    xs = _numbers(p, "--by-size", text, hint)
    edges = [int(x) for x in xs]
    if edges != xs or edges != sorted(set(edges)):  # whole and increasing
        p.error(f"--by-size {text!r}: {hint}")
    return edges


def parse_loads(text: str, cfg: CompareConfig) -> list[float]:
    """``--loads``: comma-separated positive fractions of load 1.0, or ``preset`` (the
    preset's own loads); ValueError otherwise."""
    if text == "preset":
        return list(cfg.loads)
    try:
        xs = [float(x) for x in text.split(",")]
    except ValueError:
        xs = []
    if not xs or min(xs) <= 0:
        raise ValueError(
            f"--loads {text!r}: positive fractions of load 1.0, e.g. 0.3,0.6, or 'preset'"
        )
    return xs


def _loads(p: argparse.ArgumentParser, text: str, cfg: CompareConfig) -> list[float]:
    try:
        return parse_loads(text, cfg)
    except ValueError as exc:
        p.error(str(exc))


def load_rates(cfg: CompareConfig, loads: list[float]) -> list[float]:
    """The rates of ``loads`` (fractions of the policy-neutral capacity the live comparison
    calls load 1.0, from the preset's own stream), printed beside them."""
    one = neutral_capacity(preset_stream(cfg, cfg.seed), cfg)["capacity_rps"]
    rates = [round(x * one, 3) for x in loads]
    print(f"load 1.0 = {one:.3f} req/s: loads {loads} -> rates {rates}", flush=True)
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.presettrace", description=__doc__)
    p.add_argument("--preset", default="hot-sudden")
    p.add_argument("--duration", type=float, help="measured seconds (default: the preset's)")
    p.add_argument(
        "--policies",
        default="ttft,round_robin",
        help="comma-separated; with parameters ';'-separated: 'ttft:compute_weight=3;round_robin'",
    )
    p.add_argument("--capacity", action="store_true")
    p.add_argument("--slo-capacity", action="store_true")
    p.add_argument("--rel-tol", type=float, default=0.03, help="--slo-capacity's bracket")
    p.add_argument("--rates", help="req/s, comma-separated")
    p.add_argument(
        "--loads",
        help="as --rates, in fractions of load 1.0 as the live comparison defines it"
        " (comma-separated, or 'preset': the preset's own loads)",
    )
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument(
        "--by-size",
        metavar="EDGES",
        help="--rates: also the median TTFT by uncached prompt tokens, bins between these"
        " comma-separated edges (seed 0)",
    )
    p.add_argument("--trace", type=float, metavar="RATE")
    p.add_argument("--seed", type=int, default=0, help="--trace: the workload's seed")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the compare configuration, as `kvroute loadtest compare --set`"
        " takes it (e.g. gateway_cost=engine); repeatable",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="--rates / --loads: also write the sweep's cells (per seed, and means) as JSON",
    )
    args = p.parse_args(argv)
    try:
        cfg = preset_config(args.preset, args.duration, args.set)
        gateway_cost(cfg)
    except (ValueError, TypeError) as exc:
        p.error(str(exc))
    policies = split_policies(args.policies)
    try:
        for spec in policies:
            name, params = parse_policy(spec)
            make_policy(name, **params)  # an unknown policy or parameter fails here, clearly
    except (ValueError, TypeError) as exc:
        p.error(f"--policies: {exc}")
    if args.capacity:
        print(capacities(cfg, policies))
    if args.slo_capacity:
        slo_capacity(cfg, policies, args.seeds, args.rel_tol)
    if args.rates or args.loads is not None:
        edges = _edges(p, args.by_size) if args.by_size else None
        rates = _numbers(p, "--rates", args.rates, "positive req/s, e.g. 2,4") if args.rates else []
        if args.loads is not None:
            rates += load_rates(cfg, _loads(p, args.loads, cfg))
        cells = sweep(cfg, policies, rates, args.seeds, edges)
        if args.json:
            report = {
                "preset": args.preset,
                "set": args.set,
                "duration": cfg.duration,
                "slo_ttft_ms": cfg.slo_ttft_ms,
                "cells": cells,
            }
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.trace:
        trace(cfg, policies[0], args.trace, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
