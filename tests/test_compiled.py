"""The routing core and the cluster simulator run compiled (setup.py's mypyc build) from
their current source, and the compiled modules equal their source: the same decisions on a
simulated cluster, and their own tests pass on the source too (``KVROUTE_PURE_PYTHON=1``,
tests/conftest.py)."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PURE = os.environ.get("KVROUTE_PURE_PYTHON") == "1"
#: the core's own test files, run once more on the source
CORE_TESTS = [
    "tests/test_index.py",
    "tests/test_policy.py",
    "tests/test_policy_lora.py",
    "tests/test_replication.py",
    "tests/test_routing_scale.py",
    "tests/test_lazy_keys.py",
    "tests/test_clustersim.py",
    "tests/test_enginesim_kvcache.py",
    "tests/test_enginesim_scheduler.py",
]


def compiled_modules() -> list[str]:
    """setup.py's ``COMPILED`` list, as module names."""
    paths = re.findall(r'"((?:gateway|loadtest)/[\w/]+)\.py"', (ROOT / "setup.py").read_text())
    assert len(paths) >= 10, "setup.py's COMPILED list not found"
    return [p.replace("/", ".") for p in paths]


def test_the_routing_core_is_compiled_from_its_current_source() -> None:
    manifest = ROOT / "gateway/routing/_native.sources"  # written by setup.py's build
    built = set(manifest.read_text().splitlines()) if manifest.exists() else set()
    for name in compiled_modules():
        module = importlib.import_module(name)
        assert module.__spec__ is not None and module.__spec__.origin is not None
        origin = Path(module.__spec__.origin)  # a compiled module's __file__ is mangled
        if PURE:
            assert origin.suffix == ".py", f"{name} compiled under KVROUTE_PURE_PYTHON=1"
            continue
        assert origin.suffix == ".so", f"{name} is not compiled: run scripts/setup"
        source = name.replace(".", "/") + ".py"
        digest = hashlib.sha256((ROOT / source).read_bytes()).hexdigest()
        assert f"{digest}  {source}" in built, (
            f"{name}'s compiled module is not of its current source: it shadows the edit "
            "until rebuilt; run scripts/setup"
        )


# A small cluster simulation under several policies; prints every decision and TTFT. The
# conftest import is what loads the source when KVROUTE_PURE_PYTHON=1.
DIGEST = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/tests")
import conftest  # noqa: F401
from pathlib import Path
import gateway.routing.policy as policy
from loadtest.clustersim import ClusterConfig, simulate
from loadtest.simulate import trace_arrivals
from loadtest.workloads import write_synthetic_trace
path = Path(sys.argv[2])
write_synthetic_trace(path, requests=600, duration_s=40.0, seed=5)
arrivals = list(trace_arrivals(path))
out = {"policy_module": policy.__spec__.origin, "runs": {}}
for name in ("ttft", "prefix", "least_load", "session"):
    cfg = ClusterConfig(workers=12, block_size=512, kv_blocks=256, policy=name, seed=3)
    t = simulate(arrivals, cfg).table
    out["runs"][name] = sorted(
        zip(t.index, t.worker, t.cached_tokens, t.output_tokens, t.ttft, strict=True)
    )
print(json.dumps(out))
"""


def _digest(tmp_path: Path, pure: bool) -> dict[str, object]:
    env = {**os.environ, "KVROUTE_PURE_PYTHON": "1" if pure else "0"}
    trace = tmp_path / ("pure.jsonl" if pure else "compiled.jsonl")
    proc = subprocess.run(
        [sys.executable, "-c", DIGEST, str(ROOT), str(trace)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_compiled_and_source_route_a_cluster_alike(tmp_path: Path) -> None:
    pure, compiled = _digest(tmp_path, pure=True), _digest(tmp_path, pure=False)
    assert str(pure["policy_module"]).endswith(".py")
    assert PURE or str(compiled["policy_module"]).endswith(".so")
    runs = pure["runs"]
    assert isinstance(runs, dict) and all(len(r) == 600 for r in runs.values())
    assert len({w for r in runs.values() for _, w, *_ in r}) > 1
    assert compiled["runs"] == runs


def test_the_core_tests_pass_on_the_source() -> None:
    if PURE:  # this run is the source's already
        return
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            # the `alone` tests bound wall-clock times (the simulator against a live run), not
            # what the core computes; scripts/test runs them, compiled, with the machine idle
            "-m",
            "not alone",
            "tests/test_compiled.py::test_the_routing_core_is_compiled_from_its_current_source",
            *CORE_TESTS,
        ],
        cwd=ROOT,
        env={**os.environ, "KVROUTE_PURE_PYTHON": "1"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail
    assert re.search(r"\d+ passed", tail) and "failed" not in tail, tail
