"""``loadtest/gclog`` and ``loadtest.gcpauses``: the collector log that a benchmark's
processes write, and its summary."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

from loadtest import gcpauses

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "loadtest" / "gclog"

PROGRAM = """
import gc
keep = [[i] for i in range(50_000)]  # tracked containers a full collection walks
gc.collect()
gc.freeze()
gc.collect()  # walks what is left: the frozen heap is out of its view
"""


def _run(env_dir: Path | None, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{HOOK}{os.pathsep}{ROOT}"}
    env.pop("KVROUTE_GC_LOG_DIR", None)
    if env_dir is not None:
        env["KVROUTE_GC_LOG_DIR"] = str(env_dir)
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, cwd=tmp_path)


def test_a_process_logs_its_collections_and_the_summary_reads_them(tmp_path: Path) -> None:
    logs = tmp_path / "gc"
    logs.mkdir()
    _run(logs, tmp_path)
    (name,) = [p.stem for p in logs.glob("*.log")]
    assert name.startswith("python-")
    row = gcpauses.summarise(logs)[name]
    assert row["gen2"]["collections"] >= 2
    assert row["full_walked_max"] >= 50_000  # the first full collection walked the lists
    assert row["frozen_max"] >= 50_000  # the second saw them frozen
    assert row["gen2"]["pause_max_ms"] > 0


def test_without_the_variable_nothing_is_written(tmp_path: Path) -> None:
    _run(None, tmp_path)
    assert not list(tmp_path.rglob("*.log"))


def test_the_summary_refuses_a_missing_directory(tmp_path: Path, capsys) -> None:
    assert gcpauses.main([str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def _thresholds(tmp_path: Path, value: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{HOOK}{os.pathsep}{ROOT}"}
    env.pop("KVROUTE_GC_LOG_DIR", None)
    env["KVROUTE_GC_GATEWAY_THRESHOLD"] = value
    program = "import gc; print(*gc.get_threshold())"
    return subprocess.run(
        [sys.executable, "-c", program, *argv],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )


def test_the_threshold_is_set_in_a_gateway_process_only(tmp_path: Path) -> None:
    default = " ".join(map(str, gc.get_threshold()))
    assert _thresholds(tmp_path, "10000", "gateway").stdout.split() == ["10000", "10", "10"]
    assert _thresholds(tmp_path, "5000,5,7", "gateway", "--config", "x").stdout.split() == [
        "5000",
        "5",
        "7",
    ]
    # the bench that starts gateways, and every other process, keep Python's thresholds
    assert _thresholds(tmp_path, "10000", "bench", "gateway").stdout.strip() == default
    assert _thresholds(tmp_path, "10000", "sim").stdout.strip() == default


def test_a_bad_threshold_is_refused_with_its_value(tmp_path: Path) -> None:
    for bad in ("lots", "0", "1,2,3,4"):
        run = _thresholds(tmp_path, bad, "gateway")
        assert run.returncode != 0
        assert f"KVROUTE_GC_GATEWAY_THRESHOLD={bad!r}" in run.stderr
    # set but empty: as if unset
    default = " ".join(map(str, gc.get_threshold()))
    run = _thresholds(tmp_path, "", "gateway")
    assert run.returncode == 0 and run.stdout.strip() == default
