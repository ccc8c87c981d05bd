"""kvroute against another system on the same requests: TTFT quantile ratios with a paired
bootstrap interval.

Every system in a comparison serves the same arrivals (one window of one stream, at the same
times), so the two TTFTs of one request are a pair. A quantile of a few dozen heavy-tailed
TTFTs can move by tens of per cent with one request: a median may fall in a gap between two
requests, and which side of 1 a ratio of two such medians lands on is then chance. The
interval says how far the ratio would move over other windows of requests like these.
Requests are resampled, not each system's TTFTs apart, so the pairing is kept: a request that
is slow through one router (a long prompt) is slow through the other, and that shared
variation cancels instead of widening the interval.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["MIN_PAIRS", "MIN_TAIL", "QuantileRatio", "paired_ratio", "versus"]

#: fewer requests served by both systems than this: no ratio at all
MIN_PAIRS = 10
#: an interval needs this many requests past the quantile on its shorter side (a p99 needs
#: 500 requests): resampling cannot say how an extreme quantile varies from the handful of
#: requests beyond it, and its interval would look far narrower than it is
MIN_TAIL = 5
RESAMPLES = 2000
LEVEL = 0.95
#: resampled TTFTs held at once (~8 MB per array): a window of 20,000 requests would
#: otherwise hold 2,000 x 20,000 of them twice over
_CELLS = 1_000_000

Verdict = Literal["lower", "higher", "level", "no interval"]


@dataclass(frozen=True)
class QuantileRatio:
    """``a``'s TTFT quantile over ``b``'s, on the requests both served."""

    q: float
    ratio: float
    low: float | None  # the interval's bounds (percentile bootstrap); None: too few requests
    high: float | None
    pairs: int

    @property
    def verdict(self) -> Verdict:
        """``lower``/``higher``: the whole interval is below/above 1; ``level``: it holds 1,
        so this window cannot tell the two apart."""
        if self.low is None or self.high is None:
            return "no interval"
        if self.high < 1.0:
            return "lower"
        if self.low > 1.0:
            return "higher"
        return "level"


def _pairs(a: Mapping[int, float | None], b: Mapping[int, float | None]) -> np.ndarray:
    """The TTFTs of the requests both systems served, as rows (a, b), by request index."""
    common = sorted(i for i, t in a.items() if t is not None and b.get(i) is not None)
    return np.array([(a[i], b[i]) for i in common], dtype=float).reshape(-1, 2)


def paired_ratio(
    a: Mapping[int, float | None],
    b: Mapping[int, float | None],
    q: float,
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> QuantileRatio | None:
    """The ratio of ``a``'s to ``b``'s ``q`` quantile (0..1, linear between order statistics,
    as the comparison's columns) over the requests both served (``None``: failed), with a
    ``level`` interval from ``resamples`` resamplings of those requests (no interval with
    fewer than :data:`MIN_TAIL` requests past the quantile); None when fewer than
    :data:`MIN_PAIRS` requests were served by both. Seeded: the same TTFTs, the same interval.
    """
    if not 0.0 < q < 1.0 or not 0.0 < level < 1.0 or resamples < 1:
        raise ValueError("q and level must be in (0, 1), resamples >= 1")
    xy = _pairs(a, b)
    n = len(xy)
    if n < MIN_PAIRS:
        return None
    ratio = round(float(np.percentile(xy[:, 0], q * 100) / np.percentile(xy[:, 1], q * 100)), 4)
    if n * min(q, 1.0 - q) < MIN_TAIL:
        return QuantileRatio(q, ratio, None, None, n)
    rng = np.random.default_rng(seed)
    step = max(1, _CELLS // n)  # resamplings at a time: memory bounded for long windows
    parts = []
    for start in range(0, resamples, step):
        idx = rng.integers(0, n, size=(min(step, resamples - start), n))
        qa = np.percentile(xy[idx, 0], q * 100, axis=1)
        parts.append(qa / np.percentile(xy[idx, 1], q * 100, axis=1))
    ratios = np.concatenate(parts)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return QuantileRatio(q, ratio, round(float(low), 4), round(float(high), 4), n)


def versus(
    results: Iterable[Mapping[str, Any]], reference: str = "kvroute", seed: int = 0
) -> list[dict[str, Any]]:
    """For each load, ``reference`` against every other system that ran it: p50 and p99
    ratios with their intervals and verdicts. Rows without per-request TTFTs
    (``ttft_by_request_ms``: [index, ms or None] pairs) or that failed are skipped."""
    by_load: dict[float, dict[str, dict[int, float | None]]] = {}
    for res in results:
        pairs = res.get("ttft_by_request_ms")
        if "error" in res or not pairs:
            continue
        by_load.setdefault(res["load"], {})[res["system"]] = {int(i): t for i, t in pairs}
    out: list[dict[str, Any]] = []
    for load, systems in sorted(by_load.items()):
        ref = systems.get(reference)
        if ref is None:
            continue
        for name, ttfts in systems.items():
            if name == reference:
                continue
            row: dict[str, Any] = {"load": load, "system": name}
            for q, tag in ((0.5, "p50"), (0.99, "p99")):
                qr = paired_ratio(ref, ttfts, q, seed=seed)
                if qr is None:
                    row[tag] = None
                    continue
                row["pairs"] = qr.pairs
                row[tag] = {
                    "ratio": qr.ratio,
                    "low": qr.low,
                    "high": qr.high,
                    "verdict": qr.verdict,
                }
            out.append(row)
    return out
