"""Build of the compiled modules (the rest of the package is in pyproject.toml).

- ``gateway.routing._ckeys`` computes the canonical block keys in C (gateway/routing/keys.py
  falls back to its numpy path when it is missing).
- ``gateway.tokenization._ids`` builds the tokenizer's cached id tuples untracked by the cyclic
  collector (gateway/tokenization/tokenizer.py falls back to plain tuples when it is missing).
- The routing core (shadow index, load tracker, cost model, policies, router) and the offline
  cluster simulator with its engines (``COMPILED``) are compiled from their own typed Python
  source by mypyc: the same code, faster per decision and per simulated request
  (docs/benchmarks.md, "Compiled by mypyc"). The sources stay the reference:
  ``KVROUTE_PURE_PYTHON=1`` at build time skips it, and the tests run the compiled modules'
  test files once more on the source (tests/test_compiled.py).

Both are optional here so that the package still installs where no C compiler exists;
``scripts/setup`` and the Dockerfile check that they were built and fail loudly if not.
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup

#: compiled by mypyc (tests/test_compiled.py reads this list)
COMPILED = [
    "gateway/routing/adapters.py",
    "gateway/routing/costmodel.py",
    "gateway/routing/index.py",
    "gateway/routing/load.py",
    "gateway/routing/policy.py",
    "gateway/routing/popularity.py",
    "gateway/routing/replication.py",
    "gateway/routing/router.py",
    "gateway/routing/policies/cache_aware.py",
    "gateway/routing/policies/least_load.py",
    "gateway/routing/policies/prefix.py",
    "gateway/routing/policies/random_choice.py",
    "gateway/routing/policies/round_robin.py",
    "gateway/routing/policies/session.py",
    "gateway/routing/policies/ttft.py",
    # the offline cluster simulator (Q6: 2,048 workers x 1M requests) and its engines
    "loadtest/clustersim.py",
    "loadtest/enginesim/kvcache.py",
    "loadtest/enginesim/scheduler.py",
    "loadtest/enginesim/timing.py",
]

#: sha256 of each compiled source at build time (not committed)
SOURCES = "gateway/routing/_native.sources"


def _mypyc_extensions() -> list[Extension]:
    if os.environ.get("KVROUTE_PURE_PYTHON") == "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:  # no mypy in the build environment: the pure source runs
        return []
    exts = mypycify(COMPILED, opt_level="3", group_name="gateway.routing._native")
    for ext in exts:
        ext.optional = True
    # what was compiled, so that a compiled module left older than its source is found
    # (tests/test_compiled.py): an edited source is shadowed by its compiled module until
    # the next build
    Path(SOURCES).write_text(
        "".join(f"{hashlib.sha256(Path(p).read_bytes()).hexdigest()}  {p}\n" for p in COMPILED)
    )
    return exts


setup(
    ext_modules=[
        Extension(
            "gateway.routing._ckeys",
            sources=["gateway/routing/_keys.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=True,
        ),
        Extension(
            "gateway.tokenization._ids",
            sources=["gateway/tokenization/_ids.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=True,
        ),
        *_mypyc_extensions(),
    ]
)
