"""``python -m loadtest.gcpauses DIR``: summarise the collector logs that
``loadtest/gclog/sitecustomize.py`` wrote (see its docstring for how to record them).

Per process and generation: collections, total and largest pause (ms); for full
collections, the objects walked (largest) and whether a heap was frozen. Prints JSON, then a
table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def summarise(directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for log in sorted(directory.glob("*.log")):
        gens: dict[int, list[float]] = {0: [], 1: [], 2: []}
        walked = frozen = 0
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) != 6:
                continue  # a line cut short by a killed process
            gen, pause = int(parts[1]), float(parts[2])
            gens[gen].append(pause)
            if gen == 2:
                walked = max(walked, int(parts[4]))
                frozen = max(frozen, int(parts[5]))
        out[log.stem] = {
            f"gen{g}": {
                "collections": len(p),
                "pause_total_ms": round(sum(p), 1),
                "pause_max_ms": round(max(p), 1) if p else None,
            }
            for g, p in gens.items()
        } | {"full_walked_max": walked, "frozen_max": frozen}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gcpauses", description=__doc__)
    p.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    if not args.dir.is_dir():
        print(f"gcpauses: {args.dir} is not a directory", file=sys.stderr)
        return 2
    data = summarise(args.dir)
    print(json.dumps(data, indent=1))
    print("process | gen0 n / total / max ms | gen1 | gen2 | full: walked, frozen")
    for name, d in data.items():
        cells = [
            f"{d[g]['collections']} / {d[g]['pause_total_ms']} / {d[g]['pause_max_ms']}"
            for g in ("gen0", "gen1", "gen2")
        ]
        print(f"{name} | " + " | ".join(cells) + f" | {d['full_walked_max']}, {d['frozen_max']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
