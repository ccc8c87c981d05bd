"""PNG plots of comparison and demo reports (matplotlib, bench extra, headless)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["compare_plots"]


def _systems(results: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["system"] for r in results))


def compare_plots(report: dict[str, Any], out: Path) -> list[str]:
    """TTFT CDF per system, p50/p90/p99 TTFT vs load, capacity at SLO per system, hit rate
    and load per worker."""
    results = [r for r in report["results"] if "error" not in r]  # runs that failed: no data
    if not results:
        return []
    systems = _systems(results)
    slo_ms = (report.get("config") or {}).get("slo_ttft_ms")
    top = max(r["load"] for r in results)
    at_top = {r["system"]: r for r in results if r["load"] == top}
    files = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in systems:
        xs = at_top[s].get("ttfts_ms") or [] if s in at_top else []
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=s)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF at {top:.0%} offered load")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:  # runs without per-request TTFTs draw nothing to name
        ax.legend()
    files.append(_save(fig, out / "ttft_cdf.png"))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharex=True)
    for key, ax in zip(("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"), axes, strict=True):
        for s in systems:
            rows = sorted((r for r in results if r["system"] == s), key=lambda r: r["load"])
            pts = [(r["load"], r.get(key)) for r in rows if r.get(key) is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=s)
        if key == "ttft_p90_ms" and slo_ms:
            ax.axhline(slo_ms, color="black", linestyle="--", linewidth=1, label="SLO")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (fraction of the policy-neutral capacity)")
        ax.set_ylabel(key.replace("_", " ").replace("ms", "(ms)"))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("TTFT vs offered load")
    files.append(_save(fig, out / "ttft_vs_load.png"))

    caps = {
        s: c["capacity_at_slo_rps"]
        for s, c in (report.get("capacity_at_slo") or {}).items()
        if c.get("capacity_at_slo_rps") is not None
    }
    if caps:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(caps) + 2), 4.2))
        names = list(caps)
        bars = ax.bar(range(len(names)), [caps[n] for n in names], color="tab:blue")
        for bar, n in zip(bars, names, strict=True):
            censored = report["capacity_at_slo"][n].get("censored")
            mark = {"above": "≥", "below": "<"}.get(censored or "", "")
            ax.annotate(
                f"{mark}{caps[n]:.3g}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        if report.get("capacity_rps"):
            ax.axhline(
                report["capacity_rps"],
                color="black",
                linestyle="--",
                linewidth=1,
                label="load 1.0 (pooled-cache cluster)",
            )
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_ylabel("requests/s")
        ax.set_title(f"capacity at SLO (highest rate with p90 TTFT <= {slo_ms:g} ms)")
        ax.grid(True, axis="y", alpha=0.3)
        files.append(_save(fig, out / "capacity_at_slo.png"))

    if report.get("versus"):
        files.append(_versus_plot(report["versus"], out / "kvroute_vs_systems.png"))

    for key, title, fname in (
        ("hit_rate", "prefix-cache hit rate per worker", "hit_rate_per_worker.png"),
        ("requests", "requests per worker", "load_per_worker.png"),
    ):
        fig, ax = plt.subplots(figsize=(9, 4.2))
        workers = sorted(
            {w for r in at_top.values() for w in r.get("per_worker") or {}},
            key=_worker_order,
        )
        width = 0.8 / max(1, len(systems))
        for k, s in enumerate(systems):
            if s not in at_top:
                continue
            pw = at_top[s].get("per_worker") or {}
            ax.bar(
                [i + k * width for i in range(len(workers))],
                [pw.get(w, {}).get(key, 0) for w in workers],
                width,
                label=s,
            )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workers))], workers, rotation=30)
        ax.set_title(f"{title} at {top:.0%} offered load")
        bound = (report.get("bound_by_load") or {}).get(str(top), report.get("bound_hit_rate"))
        if key == "hit_rate" and bound is not None:
            ax.axhline(
                bound,
                color="black",
                linestyle="--",
                linewidth=1,
                label="pooled-cache bound",
            )
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        files.append(_save(fig, out / fname))
    return files


def _versus_plot(rows: list[dict[str, Any]], path: Path) -> str:
    """kvroute's p50 and p99 TTFT over each system's per load, with the paired intervals."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharex=True)
    names = list(dict.fromkeys(r["system"] for r in rows))
    for tag, ax in zip(("p50", "p99"), axes, strict=True):
        for k, name in enumerate(names):
            pts = [(r["load"], r[tag]) for r in rows if r["system"] == name and r[tag]]
            if not pts:
                continue
            xs = [x + (k - (len(names) - 1) / 2) * 0.008 for x, _ in pts]  # side by side
            ys = [q["ratio"] for _, q in pts]
            # no bar where there is no interval (too few requests past the quantile)
            err = [
                [q["ratio"] - q["low"] if q["low"] is not None else 0.0 for _, q in pts],
                [q["high"] - q["ratio"] if q["high"] is not None else 0.0 for _, q in pts],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"vs {name}")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xlabel("offered load (fraction of the policy-neutral capacity)")
        ax.set_ylabel(f"{tag} TTFT, kvroute / system (< 1: kvroute faster)")
        ax.grid(True, alpha=0.3)
    if axes[0].lines:
        axes[0].legend(fontsize=8)
    fig.suptitle("kvroute against each system on the same requests (95% paired intervals)")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _worker_order(worker: str) -> tuple[int, ...]:
    """``worker-3`` and ``worker-3.dp1`` (a data-parallel rank) in numeric order."""
    return tuple(int(part) for part in re.findall(r"\d+", worker))
