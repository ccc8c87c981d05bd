"""``kvroute bench soak``: steady load for a while; memory, descriptors and state stay flat (R6).

The whole system runs as real processes (Redis, sim workers, agents, gateway) under a
constant multi-turn chat load with ever-new conversations. Every ``--sample`` seconds the
benchmark records each process's RSS and open file descriptors (from /proc), the shadow
index's size (``/debug/index``) and the event lag (``/metrics``). After the warm-up
(``--warmup`` of the run: every cache has reached its bound by then), growth is the mean of
the last fifth of the samples over the mean of the first samples after warm-up; R6 wants
<= 5% for RSS and descriptors (descriptors with a slack of 2: pooled connections come and go)
of kvroute's own processes (gateway, agents, Redis; the engine
simulator is reported but is a test tool), and the index bounded by the workers' KV capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.driver import DriverConfig, run_load
from loadtest.stack import ADMIN_KEY, Stack, StackConfig
from loadtest.workloads import ChatWorkload

NAME = "soak"
HELP = "steady load: RSS, open files, index size and event lag flat after warm-up (R6)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=8.0, help="requests/s")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=256,
        help="per worker: small, so eviction runs all the time",
    )
    p.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=0.4, help="fraction of the run before measuring")
    p.add_argument("--limit", type=float, default=0.05, help="allowed growth after warm-up")
    p.add_argument("--out-dir", default="", help="also write samples and a plot here")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _get(url: str, token: str | None = None) -> bytes:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return bytes(resp.read())


def _lag(metrics: bytes) -> float:
    for line in metrics.decode().splitlines():
        if line.startswith("kvroute_event_lag_seconds "):
            return float(line.split()[1])
    return 0.0


def _sampler(stack: Stack, every: float, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    procs = {
        "gateway": stack.gateways[0],
        "sim": stack.sim,
        **{f"agent-{i}": a for i, a in enumerate(stack.agents)},
    }
    pids = {name: p.proc.pid for name, p in procs.items() if p is not None and p.proc is not None}
    if stack.redis is not None and stack.redis.proc is not None:
        pids["redis"] = stack.redis.proc.pid
    t0 = time.monotonic()
    while not stop.is_set():
        try:
            index = json.loads(_get(stack.gateway_urls[0] + "/debug/index", ADMIN_KEY))["workers"]
            sample: dict[str, Any] = {
                "t": round(time.monotonic() - t0, 1),
                "rss_mb": {n: round(_rss_mb(p), 1) for n, p in pids.items()},
                "fds": {n: _fds(p) for n, p in pids.items()},
                "index_blocks": sum(w["blocks"] for w in index.values()),
                "event_lag_s": _lag(_get(stack.gateway_urls[0] + "/metrics")),
            }
            out.append(sample)
        except OSError:
            pass  # a sample lost to a slow answer is not a finding
        stop.wait(every)


def _growth(values: list[float], start: int) -> float:
    after = values[start:]
    if len(after) < 2:
        return 0.0
    head = after[: max(1, len(after) // 5)]
    tail = after[-max(1, len(after) // 5) :]
    base = sum(head) / len(head)
    return (sum(tail) / len(tail)) / base - 1.0 if base else 0.0


def _floor_growth(values: list[float], start: int) -> float:
    """How far the floor rose after the warm-up: the least value of the last fifth minus the
    least of the first fifth. Descriptors are mostly connections in flight, which follow
    the momentary concurrency (higher for a while when the machine is slow); a leak raises
    the floor under them, concurrency only the peaks."""
    after = values[start:]
    if len(after) < 2:
        return 0.0
    k = max(1, len(after) // 5)
    return min(after[-k:]) - min(after[:k])


def run(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.minutes * 60.0
    turns = 4.5
    workload = ChatWorkload(
        conversations=int(args.rate * duration / turns) + 10,
        turns=(3, 6),
        system_prompts=8,
        system_tokens=600,
        user_tokens=(30, 120),
        assistant_tokens=(8, 24),
        think_time=2.0,
        rate=args.rate / turns,
        seed=11,
    )
    items = [it for it in workload.items() if it.at <= duration]
    cfg = StackConfig(
        workers=args.workers,
        speedup=20.0,
        kv_blocks=args.kv_blocks,
        # small enough for the tokenization caches (gateway and simulator) to reach their
        # bound during the warm-up
        pool_settings={"tokenizer_cache_tokens": 50_000},
        sim_args=["--set", "tokenizer_cache_tokens=50000"],
        log_dir=Path(args.out_dir) / "logs" if args.out_dir else None,
    )
    samples: list[dict[str, Any]] = []
    with Stack(cfg) as stack:
        stop = threading.Event()
        sampler = threading.Thread(
            target=_sampler, args=(stack, args.sample, stop, samples), daemon=True
        )
        sampler.start()
        try:
            dcfg = DriverConfig(
                stack.gateway_urls[0],
                cfg.model,
                "chat",
                max_duration=duration,
                drain_timeout=60.0,
                progress=False,
                label="soak",
            )
            result = asyncio.run(run_load(items, dcfg))
        finally:
            stop.set()
            sampler.join(timeout=15)
    start = next(
        (i for i, s in enumerate(samples) if s["t"] >= args.warmup * duration), len(samples)
    )
    names = sorted(samples[0]["rss_mb"]) if samples else []
    procs = {}
    worst = 0.0
    for n in names:
        rss = [s["rss_mb"][n] for s in samples if n in s["rss_mb"]]
        fds = [float(s["fds"][n]) for s in samples if n in s["fds"]]
        g_rss = _growth(rss, start)
        # descriptors: the floor under the connections in flight, with a couple either way
        # (pooled connections come and go) not a leak
        fd_rise = _floor_growth(fds, start)
        floor = min(fds[start:]) if start < len(fds) else fds[-1]
        g_fds = max(0.0, fd_rise - 2.0) / max(1.0, floor)
        if n != "sim":
            worst = max(worst, g_rss, g_fds)
        procs[n] = {
            "rss_mb_start": rss[start] if start < len(rss) else None,
            "rss_mb_end": rss[-1],
            "rss_growth": round(g_rss, 4),
            "fds_end": int(fds[-1]),
            "fds_max": int(max(fds)),
            "fd_floor_rise": int(fd_rise),
            "fd_growth": round(g_fds, 4),
        }
    blocks = [s["index_blocks"] for s in samples]
    capacity = args.workers * args.kv_blocks
    lags = sorted(s["event_lag_s"] for s in samples)
    out: dict[str, Any] = {
        "minutes": args.minutes,
        "requests": result.summary["requests"],
        "failed": result.summary["failed"],
        "errors": result.summary.get("errors", {}),
        "hit_rate": result.summary["hit_rate"],
        "samples": len(samples),
        "warmup_s": round(args.warmup * duration, 1),
        "worst_growth": round(worst, 4),
        "index_blocks_max": max(blocks) if blocks else 0,
        "index_capacity_blocks": capacity,
        "event_lag_max_s": lags[-1] if lags else None,
        "processes": procs,
    }
    out["ok"] = (
        bool(samples)
        and worst <= args.limit
        and out["index_blocks_max"] <= capacity
        and out["failed"] == 0
    )
    out["table"] = [{"process": n, **v} for n, v in procs.items()]
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        Path(args.out_dir, "soak_samples.json").write_text(json.dumps(samples))
        _plot(samples, Path(args.out_dir) / "soak.png", out["warmup_s"])
    return out


def _plot(samples: list[dict[str, Any]], path: Path, warmup: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ts = [s["t"] for s in samples]
    for n in sorted(samples[0]["rss_mb"]):
        axes[0].plot(ts, [s["rss_mb"].get(n) for s in samples], label=n)
    axes[0].set_ylabel("RSS (MB)")
    axes[1].plot(ts, [s["index_blocks"] for s in samples], color="black")
    axes[1].set_ylabel("shadow index blocks")
    for ax in axes:
        ax.axvline(warmup, linestyle="--", color="grey")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
