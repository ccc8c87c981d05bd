"""``kvroute bench NAME``: benchmarks that print one JSON object and a short table.

Each module in this package is one benchmark. It defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> dict`` (the JSON result); this dispatcher finds
them, so adding a benchmark means adding a module. Every benchmark compares against a
baseline measured in the same invocation where one exists (this machine is noisy).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from types import ModuleType
from typing import Any

from loadtest.report import print_table


def _modules() -> dict[str, ModuleType]:
    found: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "run"):
            found[mod.NAME] = mod
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, mod in sorted(_modules().items()):
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        p.add_argument("--json", action="store_true", help="print only the JSON object")
        p.add_argument("--out", help="also write the JSON object to this file")
        mod.add_arguments(p)
        p.set_defaults(_bench=mod)


def run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = args._bench.run(args)
    text = json.dumps(result, indent=2, sort_keys=False, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    if not args.json:
        rows = result.get("table")
        if rows:
            print_table(rows, file=sys.stdout)
    return 0 if result.get("ok", True) else 1
