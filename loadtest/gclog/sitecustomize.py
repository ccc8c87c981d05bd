"""Log every cyclic-garbage collection of a Python process: generation, pause, objects walked.

Put this directory first on ``PYTHONPATH`` and set ``KVROUTE_GC_LOG_DIR``: every Python
process started with that environment (a benchmark, the gateway and workers it launches)
appends one line per collection to ``<dir>/<role>-<pid>.log``, where ``role`` is the
process's kvroute subcommand (``gateway``, ``sim``, ``agent``, ``bench``) or ``python``.
``python -m loadtest.gcpauses <dir>`` summarises the logs. A full collection also records how
many objects it walks (every tracked object not frozen) and how many are frozen. Without the variable this does nothing.

    KVROUTE_GC_LOG_DIR=/tmp/gc PYTHONPATH=loadtest/gclog kvroute bench gateway ...

``KVROUTE_GC_GATEWAY_THRESHOLD=N[,N1,N2]`` (with or without the log) also sets the collector's
thresholds (``gc.set_threshold``) in the gateway's own processes only, for an A/B of the
young-generation threshold against Python's default (700, 10, 10): docs/benchmarks.md, "Where
a routed request's CPU goes". The gateway sets its own young threshold once started
(``server.gc_young_threshold``, default 10,000), which replaces this one's unless set to 0; an
A/B of the young threshold alone is ``KVROUTE_SERVER__GC_YOUNG_THRESHOLD=700`` against
``=10000``.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any

_DIR = os.environ.get("KVROUTE_GC_LOG_DIR")


def _role() -> str:
    args = " ".join(sys.argv)
    for name in ("bench", "gateway", "sim", "agent"):  # "bench gateway" is the bench
        if f" {name} " in f" {args} " or args.endswith(f"cli {name}"):
            return name
    return "python"


class _Log:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.file: Any = None
        self.start = 0.0
        self.tracked = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gen = info["generation"]
            # what a full collection walks: every tracked object not frozen (counted before
            # the pause is timed)
            self.tracked = len(gc.get_objects()) if gen == 2 else 0
            self.start = time.perf_counter()
            return
        pause_ms = (time.perf_counter() - self.start) * 1000
        if self.file is None:  # the role is known once the command line is parsed
            path = os.path.join(self.directory, f"{_role()}-{os.getpid()}.log")
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 (lives as the process)
        self.file.write(
            f"{time.time():.3f} {info['generation']} {pause_ms:.3f} {info['collected']}"
            f" {self.tracked} {gc.get_freeze_count()}\n"
        )


def _thresholds(value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in value.split(","))
    except ValueError:
        out = ()
    if not 1 <= len(out) <= 3 or min(out) < 1:
        raise SystemExit(
            f"KVROUTE_GC_GATEWAY_THRESHOLD={value!r}: expected 1 to 3 positive integers, e.g. 10000,10,10"
        )
    return out


if _DIR:
    gc.callbacks.append(_Log(_DIR))
# at start-up ``sys.argv`` holds the subcommand first: ``-m gateway.cli gateway ...`` and
# ``kvroute gateway ...`` alike (``kvroute bench gateway`` is the bench, not a gateway)
_THRESHOLD = os.environ.get("KVROUTE_GC_GATEWAY_THRESHOLD")
if _THRESHOLD and sys.argv[1:2] == ["gateway"]:
    gc.set_threshold(*_thresholds(_THRESHOLD))
