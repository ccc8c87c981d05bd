"""The ``kvroute`` command: one entry point, one subcommand per working component.

Each subcommand lives in the module that owns it and exposes two functions:
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when their
subcommand runs, so ``kvroute --help`` stays fast and a subcommand's dependencies load only
when needed.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import signal
import sys
from collections.abc import Sequence

#: the signal that makes any ``kvroute`` process write its threads' stacks to stderr
STACKS_SIGNAL = signal.SIGUSR1

# name -> (module, one-line help). A component adds its line here when it works.
COMMANDS: dict[str, tuple[str, str]] = {
    "gateway": ("gateway.main", "run the cache-aware routing gateway"),
    "demo": ("loadtest.demo", "the main job: the whole system under load, kvroute vs round robin"),
    "loadtest": ("loadtest.cli", "drive load at an endpoint, or compare routers on a sim cluster"),
    "bench": ("loadtest.benchmarks", "run a benchmark and print JSON + a table"),
    "sim": ("loadtest.enginesim.cli", "run simulated vLLM/SGLang GPU workers"),
    "agent": ("worker_agent.cli", "run the worker agent beside one engine"),
    "simulate": ("loadtest.simulate", "offline cluster simulator: routing quality at scale"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="Cache-aware routing gateway for LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM ends a command the way Ctrl-C does, through its cleanup (``finally``, context
    # managers), so commands that start processes of their own (demo, bench, loadtest
    # compare) stop them instead of leaving them behind. Servers replace this handler with
    # their own graceful stop.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # ``kill -USR1 PID`` writes every thread's stack to stderr: how a process that hangs is
    # diagnosed where no debugger runs (the test harness asks a process that misses its
    # start-up deadline for it)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    # Build only the chosen subcommand's parser when one is named (fast, lazy imports).
    if argv and argv[0] in COMMANDS:
        module_name, help_text = COMMANDS[argv[0]]
        parser = argparse.ArgumentParser(prog=f"kvroute {argv[0]}", description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(parser)
        args = parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
