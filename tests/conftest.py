"""Shared fixtures: a private redis-server per test (killable), temporary log folders."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Loads kvroute's modules from their ``.py`` source even where a compiled module
    (setup.py's mypyc build) sits beside it: ``KVROUTE_PURE_PYTHON=1`` runs the tests
    on the source, the reference the compiled core must equal (tests/test_compiled.py)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(("gateway.", "loadtest.")) or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or not spec.origin.endswith(".so"):
            return None
        source = Path(path[0]) / (fullname.rsplit(".", 1)[1] + ".py")
        if not source.exists():  # _ckeys: C, not a compiled copy of Python source
            return None
        return importlib.util.spec_from_file_location(fullname, source)


if os.environ.get("KVROUTE_PURE_PYTHON") == "1":
    sys.meta_path.insert(0, _SourceFirst())

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from loadtest.harness import RedisServer  # noqa: E402

# CI (``.ci/run`` sets the profile) runs every property test on the same examples, so a
# landing is decided by the change, not by the draw; a developer's ``scripts/test`` draws new
# ones each run, which is where a wrong property shows up (and the failing example is
# printed to pin with ``@example``).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("KVROUTE_HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["KVROUTE_HYPOTHESIS_PROFILE"])


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server on a free loopback port; tests may kill() and start() it."""
    server = RedisServer(workdir=tmp_path / "redis")
    server.workdir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    """Folder for child-process logs (kept by pytest on failure for inspection)."""
    d = tmp_path / "logs"
    d.mkdir()
    return d


#: the test files that take longest, slowest first (seconds of one pytest worker, measured
#: 2026-12-07: test_compare 165, test_soak 92, test_vllm_real 90, test_redis_cluster 85,
#: test_bench_gateway 70, test_benchmarks 52; every other file under 45)
_SLOW_FILES = (
    "test_compare.py",
    "test_soak.py",
    "test_vllm_real.py",
    "test_redis_cluster.py",
    "test_bench_gateway.py",
    "test_benchmarks.py",
    "test_operations.py",
    "test_security.py",
    "test_disaggregation.py",
    "test_faults.py",
    "test_gateway_e2e.py",
    "test_compiled.py",
    "test_tokenization.py",
    "test_chunking.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``scripts/test``: whole files per worker, handed out in collection
    order with ``--no-loadscope-reorder``) the slowest files go first, so that none of them is
    left to run alone at the end while the other worker idles. xdist's own order (files with
    more tests first) started test_soak.py (92 s, two tests) last. Within a file, and among
    the other files, the collected order stays."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(_SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
