"""R6 (short version for CI): under steady load, memory and descriptors stay flat after the
warm-up and the shadow index stays within the workers' KV capacity."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest.benchmarks import soak


def test_short_soak_is_flat(tmp_path: Path) -> None:
    args = argparse.Namespace(
        minutes=1.5,
        rate=5.0,
        workers=2,
        kv_blocks=128,
        sample=2.0,
        warmup=0.5,
        limit=0.05,
        out_dir=str(tmp_path),
    )
    r = soak.run(args)
    assert r["failed"] == 0 and r["requests"] > 200, r
    assert r["samples"] >= 30
    assert r["index_blocks_max"] <= r["index_capacity_blocks"], r
    for name, p in r["processes"].items():
        if name != "sim":  # the simulator is a test tool, reported only
            assert p["rss_growth"] <= 0.05, (name, p)
            assert p["fd_growth"] * p["fds_end"] <= max(2.0, 0.05 * p["fds_end"]), (name, p)
    assert r["ok"], r
    assert (tmp_path / "soak.png").exists()
