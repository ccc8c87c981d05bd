"""PNG plots of comparison and demo reports (matplotlib, bench extra, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["compare_plots"]


def _systems(results: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["system"] for r in results))


def compare_plots(report: dict[str, Any], out: Path) -> list[str]:
    """TTFT CDF per system, p50/p99 TTFT vs load, hit rate and load per worker."""
    results = [r for r in report["results"] if "error" not in r]  # runs that failed: no data
    if not results:
        return []
    systems = _systems(results)
    top = max(r["load"] for r in results)
    at_top = {r["system"]: r for r in results if r["load"] == top}
    files = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in systems:
        xs = at_top[s]["ttfts_ms"] if s in at_top else []
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=s)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF at {top:.0%} offered load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    files.append(_save(fig, out / "ttft_cdf.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for key, ax in zip(("ttft_p50_ms", "ttft_p99_ms"), axes, strict=True):
        for s in systems:
            rows = sorted((r for r in results if r["system"] == s), key=lambda r: r["load"])
            ax.plot([r["load"] for r in rows], [r[key] for r in rows], marker="o", label=s)
        ax.set_yscale("log")
        ax.set_xlabel("offered load (fraction of capacity)")
        ax.set_ylabel(key.replace("_", " ").replace("ms", "(ms)"))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle("TTFT vs offered load")
    files.append(_save(fig, out / "ttft_vs_load.png"))

    for key, title, fname in (
        ("hit_rate", "prefix-cache hit rate per worker", "hit_rate_per_worker.png"),
        ("requests", "requests per worker", "load_per_worker.png"),
    ):
        fig, ax = plt.subplots(figsize=(9, 4.2))
        workers = sorted(
            {w for r in at_top.values() for w in r["per_worker"]},
            key=lambda w: int(w.rsplit("-", 1)[1]),
        )
        width = 0.8 / max(1, len(systems))
        for k, s in enumerate(systems):
            if s not in at_top:
                continue
            pw = at_top[s]["per_worker"]
            ax.bar(
                [i + k * width for i in range(len(workers))],
                [pw.get(w, {}).get(key, 0) for w in workers],
                width,
                label=s,
            )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workers))], workers, rotation=30)
        ax.set_title(f"{title} at {top:.0%} offered load")
        if key == "hit_rate" and report.get("bound_hit_rate") is not None:
            ax.axhline(
                report["bound_hit_rate"],
                color="black",
                linestyle="--",
                linewidth=1,
                label="pooled-cache bound",
            )
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        files.append(_save(fig, out / fname))
    return files


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
