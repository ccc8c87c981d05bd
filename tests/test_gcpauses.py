"""``loadtest/gclog`` and ``loadtest.gcpauses``: the collector log that a benchmark's
processes write, and its summary."""

from __future__ import annotations

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
