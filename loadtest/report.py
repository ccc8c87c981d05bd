"""Plain-text and markdown tables for benchmark and load-test output."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import IO, Any


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, nearest rank (NaN when empty): what the
    benchmarks' p50/p99 columns report."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0 or 0.01 <= abs(v) < 1e6:
            return f"{v:,.2f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:,.1f}"
        return f"{v:.3g}"
    return str(v)


def format_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """Rows of dicts (same keys) as an aligned text table or a markdown table."""
    if not rows:
        return ""
    cols = list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    if markdown:
        head = "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + " |"
        sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        body = [
            "| " + " | ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) + " |"
            for row in cells
        ]
        return "\n".join([head, sep, *body])
    head = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    body = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([head, "-" * len(head), *body])


def print_table(
    rows: Sequence[dict[str, Any]], file: IO[str] = sys.stdout, markdown: bool = False
) -> None:
    print(format_table(rows, markdown=markdown), file=file)
