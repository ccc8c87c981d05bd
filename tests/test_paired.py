"""Paired quantile ratios (loadtest/paired.py) against what the data were built to show."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.compare import markdown
from loadtest.paired import MIN_PAIRS, MIN_TAIL, paired_ratio, versus


def _heavy_tailed(n: int, seed: int) -> list[float]:
    """TTFT-like: lognormal, a long tail (a trace's prompt lengths)."""
    rng = np.random.default_rng(seed)
    return list(rng.lognormal(mean=7.0, sigma=1.0, size=n))


def _by_index(xs: list[float | None]) -> dict[int, float | None]:
    return dict(enumerate(xs))


def test_the_same_requests_through_two_equal_routers_are_level() -> None:
    """Each request's TTFT through both, within ±5% noise of its own: 60 requests, the
    shape of trace-production's 20% cell. The point estimate may land either side of 1;
    the interval holds 1."""
    base = _heavy_tailed(60, 1)
    rng = random.Random(2)
    a = [t * rng.uniform(0.95, 1.05) for t in base]
    b = [t * rng.uniform(0.95, 1.05) for t in base]
    r = paired_ratio(_by_index(a), _by_index(b), 0.5)
    assert r is not None and r.pairs == 60
    assert r.low < 1.0 < r.high and r.verdict == "level"
    assert r.ratio == round(float(np.percentile(a, 50) / np.percentile(b, 50)), 4)


def test_a_small_cost_per_request_is_found_by_pairing() -> None:
    """5% added to every request (a per-request cost), under ±3% noise of each request's
    own, 400 requests: the paired interval excludes 1. The same TTFTs with the pairing broken
    (one system's requests shuffled, i.e. resampled apart) cannot tell, its interval several
    times wider: the spread of the TTFTs themselves is far larger than 5%."""
    base = _heavy_tailed(400, 3)
    rng = random.Random(4)
    a = [t * 1.05 * rng.uniform(0.97, 1.03) for t in base]
    b = [t * rng.uniform(0.97, 1.03) for t in base]
    r = paired_ratio(_by_index(a), _by_index(b), 0.5)
    assert r is not None and r.verdict == "higher" and 1.0 < r.low < r.ratio < r.high
    faster = paired_ratio(_by_index(b), _by_index(a), 0.5)
    assert faster is not None and faster.verdict == "lower" and faster.high < 1.0
    shuffled = b[:]
    rng.shuffle(shuffled)
    unpaired = paired_ratio(_by_index(a), _by_index(shuffled), 0.5)
    assert unpaired is not None and unpaired.verdict == "level"
    assert unpaired.high - unpaired.low > 5 * (r.high - r.low)


def test_only_requests_served_by_both_count() -> None:
    """A request that failed through either system (None) or was not in its window leaves
    the pairs; the ratio is over the rest."""
    a: dict[int, float | None] = {i: 100.0 + i for i in range(30)}
    b: dict[int, float | None] = {i: 100.0 + i for i in range(30)}
    a[3] = None
    del b[7]
    b[40] = 1.0
    r = paired_ratio(a, b, 0.5)
    assert r is not None and r.pairs == 28 and r.ratio == 1.0 and r.low == r.high == 1.0


def test_too_few_pairs_and_bad_arguments() -> None:
    xs = _by_index([1.0] * (MIN_PAIRS - 1))
    assert paired_ratio(xs, xs, 0.5) is None
    for q, level in ((0.0, 0.95), (1.0, 0.95), (0.5, 1.0)):
        with pytest.raises(ValueError):
            paired_ratio(xs, xs, q, level=level)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.floats(1.0, 1e5), min_size=MIN_PAIRS, max_size=80),
    st.floats(0.5, 2.0),
    st.sampled_from([0.5, 0.9]),
    st.integers(0, 2**31),
)
def test_scaling_every_request_scales_the_ratio_exactly(
    base: list[float], k: float, q: float, seed: int
) -> None:
    """Against a reference: ``a`` = k x ``b`` request by request makes every resampled ratio
    k, so the point and both bounds are k; the same seed gives the same interval."""
    b = _by_index(list(base))
    a = _by_index([t * k for t in base])
    r = paired_ratio(a, b, q, seed=seed, resamples=200)
    assert r is not None
    assert r.ratio == pytest.approx(k, rel=1e-3)
    if len(base) * (1 - q) < MIN_TAIL:
        assert r.low is None and r.high is None and r.verdict == "no interval"
        return
    assert r.low == pytest.approx(k, rel=1e-3) and r.high == pytest.approx(k, rel=1e-3)
    assert r == paired_ratio(a, b, q, seed=seed, resamples=200)


def test_an_extreme_quantile_gets_no_interval_from_a_few_requests_past_it() -> None:
    """A p99 of 60 requests is their largest or so: resampling cannot say how it varies, so
    only the ratio is given; from 500 requests (5 past the p99) the interval is back."""
    for n, has_interval in ((60, False), (499, False), (500, True)):
        base = _heavy_tailed(n, 6)
        rng = random.Random(7)
        a = _by_index([t * rng.uniform(0.9, 1.1) for t in base])
        r = paired_ratio(a, _by_index(base), 0.99)
        assert r is not None and r.pairs == n
        assert (r.low is not None) is has_interval
        assert (r.verdict != "no interval") is has_interval


def test_versus_pairs_kvroute_with_each_system_per_load_and_markdown_shows_it() -> None:
    base = _heavy_tailed(600, 5)

    def row(system: str, load: float, scale: float) -> dict[str, object]:
        pairs = [[i, round(t * scale, 2)] for i, t in enumerate(base)]
        return {"system": system, "load": load, "ttft_by_request_ms": pairs}

    results = [
        row("kvroute", 0.3, 1.0),
        row("kvroute", 0.6, 1.0),
        row("smg-round_robin", 0.3, 1.25),
        row("smg-round_robin", 0.6, 0.8),
        {"system": "smg-cache_aware", "load": 0.3, "error": "did not start"},
        row("vllm-router-kv_aware", 0.9, 1.0),  # no kvroute row at 0.9: nothing to pair
    ]
    rows = versus(results)
    assert [(r["load"], r["system"]) for r in rows] == [
        (0.3, "smg-round_robin"),
        (0.6, "smg-round_robin"),
    ]
    assert rows[0]["p50"]["verdict"] == "lower" and rows[0]["p50"]["ratio"] == 0.8
    assert rows[1]["p99"]["verdict"] == "higher" and rows[1]["p99"]["ratio"] == 1.25
    assert rows[0]["pairs"] == 600
    md = markdown({"workload": {}, "results": [], "versus": rows})
    assert "paired bootstrap" in md
    assert "| 0.3  | smg-round_robin | 600      | 0.800 [0.800, 0.800] **lower**" in md


def test_a_short_window_shows_its_p99_ratio_without_an_interval() -> None:
    base = _heavy_tailed(60, 8)
    results = [
        {"system": s, "load": 0.2, "ttft_by_request_ms": [[i, t * k] for i, t in enumerate(base)]}
        for s, k in (("kvroute", 1.0), ("vllm-router-kv_aware", 1.0))
    ]
    rows = versus(results)
    assert rows[0]["p50"]["verdict"] == "level" and rows[0]["p99"]["verdict"] == "no interval"
    md = markdown({"workload": {}, "results": [], "versus": rows})
    assert "| 1.000 [1.000, 1.000] level | 1.000 (too few requests past it for an interval) |" in md


def test_a_long_window_is_resampled_in_batches_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batching the resamplings (memory bounded) changes nothing: the same seed draws the
    same requests whether 2,000 resamplings are made at once or 7 at a time."""
    import loadtest.paired as paired

    base = _heavy_tailed(300, 9)
    rng = random.Random(10)
    a = _by_index([t * rng.uniform(0.9, 1.1) for t in base])
    b = _by_index(base)
    whole = paired_ratio(a, b, 0.5)
    monkeypatch.setattr(paired, "_CELLS", 7 * 300)
    assert paired_ratio(a, b, 0.5) == whole and whole is not None and whole.low is not None
