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
            assert p["fd_growth"] <= 0.05, (name, p)  # the floor rose by at most 2 or 5%
    assert r["ok"], r
    assert (tmp_path / "soak.png").exists()


def test_descriptor_floor_sees_a_leak_and_not_concurrency() -> None:
    """Connections in flight swing the descriptor count; only a rising floor is a leak."""
    swings = [40.0 + (9 if i % 3 == 0 else 0) + (6 if i > 40 else 0) * (i % 2) for i in range(60)]
    assert soak._floor_growth(swings, 10) == 0.0  # higher peaks late, same floor
    leak = [40.0 + i // 4 + (9 if i % 3 == 0 else 0) for i in range(60)]
    assert soak._floor_growth(leak, 10) >= 8.0  # one more descriptor every 4 samples
    assert soak._floor_growth([40.0], 0) == 0.0
