"""Every ``kvroute bench`` runs here at a seconds-long size, through the same dispatcher as
the command line, so none can rot: the JSON has its shape, ``ok`` is a boolean the exit code
follows, and the figures are sane (not the targets: this machine is shared and the sizes are
tiny). ``bench gateway`` has its own tests; the fault scenarios themselves run on real
stacks in test_faults.py, so here the faults benchmark's own code runs on a stand-in stack."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from loadtest import benchmarks
from loadtest.benchmarks import faults as faults_bench
from loadtest.faults import FaultResult

pytestmark = pytest.mark.timeout(120)


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """``kvroute bench NAME --json ARGS...`` in this process; returns the printed JSON."""
    parser = argparse.ArgumentParser()
    benchmarks.add_arguments(parser)
    args = parser.parse_args([argv[0], "--json", *argv[1:]])
    code = benchmarks.run(args)
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert isinstance(out["ok"], bool), out
    assert code == (0 if out["ok"] else 1)
    assert out["table"] and all(isinstance(row, dict) for row in out["table"])
    return out


def test_every_benchmark_module_is_covered() -> None:
    assert set(benchmarks._modules()) == {
        "events", "faults", "gateway", "hot", "index", "replicas", "sim", "simulate", "soak",
        "tokenize",
    }  # fmt: skip


def test_index(capsys: pytest.CaptureFixture[str]) -> None:
    r = bench(capsys, "index", "--workers", "16", "--blocks", "20000", "--queries", "45")
    assert r["tokens"] == 8192 and r["followup_tokens"] == 300
    assert 20_000 <= r["entries"] <= 30_000 and r["distinct_keys"] > 0
    # P1: token ids -> worker, keys included; a follow-up hashes only its new blocks
    assert 0 < r["route_p50_us"] <= r["route_p99_us"]
    # lazy keys: only part of the 512 blocks keyed before a decision, the rest reported
    assert 1 <= r["blocks_keyed_before_decision_mean"] < 512
    assert r["keys_rest_p50_us"] > 0 and r["keys_rest_followup_p50_us"] >= 0
    assert set(r["route_by_prompt_p50_us"]) == {"resent", "new_conversation", "novel"}
    # the old path (eager keys) in the same run
    assert 0 < r["keys_p50_us"] < r["route_eager_p50_us"] <= r["route_eager_p99_us"]
    assert 0 < r["decide_p50_us"] < r["route_eager_p50_us"]
    # the same decisions replayed back to back (warm caches), cold and follow-up
    assert r["decide_back_to_back_p50_us"] > 0 and r["decide_back_to_back_followup_p50_us"] > 0
    assert r["lazy_vs_eager_p50"] > 0 and r["lazy_vs_eager_followup_p50"] > 0
    assert 0 < r["keys_followup_p50_us"] < r["keys_p50_us"]
    assert 0 < r["route_followup_p50_us"] <= r["route_followup_p99_us"]
    assert r["followups_reuse_keys"] and r["sane"]
    # anti-entropy's check of the fullest worker, and the per-key digest beside it (sane
    # requires both digests equal)
    assert r["antientropy_blocks"] > 20_000 / 16
    assert r["antientropy_check_ms"] > 0 and r["antientropy_check_per_key_ms"] > 0
    assert r["baseline_ids_to_array_p50_us"] > 0 and r["baseline_dict_walk_p50_us"] > 0
    # both key functions timed on the cold prompts (their keys checked equal: sane)
    assert r["keys_function"] == "native"
    assert set(r["keys_by_path_p50_us"]) == set(r["keys_by_path_vs_ids_to_array"])
    assert set(r["keys_by_path_p50_us"]) == {"native", "numpy"}
    assert all(v > 0 for v in r["keys_by_path_p50_us"].values())
    # P2, P3: decoded entries applied; keys as the consumer creates them are counted
    assert r["apply_events_per_s"] > 0 and r["index_apply_events_per_s"] > 0
    assert 40 < r["bytes_per_entry"] < 400
    assert set(r["targets"]) == {
        "route_p50_us", "route_p99_us", "route_followup_p50_us", "apply_events_per_s",
        "bytes_per_entry",
    }  # fmt: skip
    assert r["ok"] == (r["sane"] and all(r["targets"].values()))


def test_index_routes_on_the_numpy_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """``--keys numpy``: the fallback key function routes, with the same decisions."""
    r = bench(capsys, "index", "--workers", "8", "--blocks", "5000", "--queries", "12",
              "--keys", "numpy")  # fmt: skip
    assert r["keys_function"] == "numpy" and r["sane"]


def test_index_native_keys_need_the_compiled_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from loadtest.benchmarks import index as index_bench

    monkeypatch.setattr(index_bench, "native_available", lambda: False)
    parser = argparse.ArgumentParser()
    benchmarks.add_arguments(parser)
    args = parser.parse_args(["index", "--json", "--keys", "native", "--blocks", "100"])
    with pytest.raises(SystemExit, match="not built"):
        benchmarks.run(args)


def test_index_policy_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    r = bench(capsys, "index", "--workers", "8", "--blocks", "4000", "--tokens", "1024",
              "--queries", "6", "--set", "policy_params.step_ties=1")  # fmt: skip
    assert r["policy"] == "ttft" and r["policy_params"] == {"step_ties": 1}
    with pytest.raises(SystemExit):
        bench(capsys, "index", "--blocks", "4000", "--set", "step_ties=1")


def test_events(capsys: pytest.CaptureFixture[str]) -> None:
    r = bench(capsys, "events", "--blocks", "6000", "--duration", "1", "--rate", "5000",
              "--capacity", "2000")  # fmt: skip
    # the index holds exactly the engine's blocks: compared by digest, not by count
    assert r["index_blocks"] == r["engine_blocks"] == 2000
    assert r["index_digest"] == r["engine_digest"] and r["index_equals_engine"]
    assert r["index_missing_blocks"] == r["index_extra_blocks"] == 0
    assert r["e2e_blocks_per_s"] > 0 and r["e2e_block_events"] >= 6000
    assert r["lag_entries"] > 0 and 0 < r["lag_p50_ms"] <= r["lag_p99_ms"]
    assert r["redis_bytes_per_block"] > 0
    assert r["ok"] == all(r["targets"].values())


def test_sim(capsys: pytest.CaptureFixture[str]) -> None:
    r = bench(capsys, "sim", "--workers", "2", "--requests", "30", "--concurrency", "6",
              "--core-requests", "200")  # fmt: skip
    assert r["all_answered"] and r["ok"]
    assert r["req_per_s"] > 0 and r["cpu_ms_per_req"] > 0 and r["core_us_per_req"] > 0


def test_simulate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace_dir = tmp_path / "not" / "yet"  # created on demand
    r = bench(capsys, "simulate", "--workers", "4", "--requests", "200", "--trace-dir",
              str(trace_dir), "--no-progress")  # fmt: skip
    assert r["requests"] == 200 and r["workers"] == 4
    assert [p.suffix for p in trace_dir.iterdir()] == [".jsonl"]  # the trace, nothing else
    assert r["ttft"]["requests_per_s"] > 0 and r["round_robin"]["requests_per_s"] > 0
    assert r["cost_vs_baseline"] > 0 and r["ok_basis"].startswith("projection")
    assert r["ok"] == (r["projected_full_s"] <= r["q6_budget_s"])


def test_hot_rejects_a_malformed_policy_parameter() -> None:
    """``--policy-param`` must be NAME=VALUE: a clear error before any simulation runs."""
    parser = argparse.ArgumentParser()
    benchmarks.add_arguments(parser)
    args = parser.parse_args(["hot", "--json", "--policy-param", "step_ties"])
    with pytest.raises(SystemExit, match="--policy-param: expected PARAM=VALUE, got 'step_ties'"):
        benchmarks.run(args)


@pytest.mark.parametrize("stream", ["steady", "sudden"])
def test_hot(capsys: pytest.CaptureFixture[str], stream: str) -> None:
    r = bench(capsys, "hot", "--workers", "2", "--loads", "0.5", "--duration", "4",
              "--capacity", "10", "--prefix-tokens", "3000", "--question-tokens", "40",
              "--background-prefix", "200", "--groups", "4", "--stream", stream,
              "--systems", "kvroute,kvroute-spill,round_robin")  # fmt: skip
    rows = {row["system"]: row for row in r["rows"]}
    assert set(rows) == {"kvroute", "kvroute-spill", "round_robin"} and r["stream"] == stream
    assert r["capacity_rps"] == {"2": 20.0}
    for row in rows.values():
        assert row["requests"] > 20 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["hit_rate"] < 1 and row["max_mean_requests"] >= 1
    assert rows["round_robin"]["p50_vs_rr"] == 1.0 and rows["round_robin"]["warmups"] == 0
    # (kvroute's onset takes both workers cold, as round robin does: no warm-up needed here)
    assert rows["kvroute-spill"]["warmups"] == 0 and rows["kvroute"]["warmups"] >= 0
    assert r["ok"] == all(
        row["p50_vs_rr"] <= 1 and row["p99_vs_rr"] <= 1 for row in [rows["kvroute"]]
    )


def test_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    """Q4 offline on the replicas preset's stream, seconds long: the loss is the baseline's
    hit rate minus each count's, per seed; ok follows the bounds (2 points at 4 replicas)."""
    r = bench(capsys, "replicas", "--replicas", "1,2,4", "--loads", "0.3", "--duration", "6",
              "--seeds", "2")  # fmt: skip
    assert r["preset"] == "replicas-4" and r["seeds"] == 2 and r["load_1_rps"] > 0
    assert r["judged_on_shared"] and r["placement_lag_s"] == 0.002
    unshared = {row["replicas"]: row for row in r["rows"] if row["shared"] is False}
    rows = {row["replicas"]: row for row in r["rows"] if row["shared"] is not False}
    assert set(rows) == {1, 2, 4} and set(unshared) == {2, 4} and rows[1]["shared"] is None
    base = rows[1]
    assert base["points_lost"] == 0 and base["points_lost_per_seed"] == [0, 0]
    for n, row in rows.items():
        assert row["requests"] > 20 and 0 < row["hit_rate"] < 1
        for q in ("p50", "p99"):  # the mean is the seeds' own figures'
            seeds = row[f"ttft_{q}_ms_per_seed"]
            assert len(seeds) == 2 and row[f"ttft_{q}_ms"] == pytest.approx(sum(seeds) / 2, abs=0.1)
        assert row["points_lost"] == pytest.approx(
            (base["hit_rate"] - row["hit_rate"]) * 100, abs=0.02
        )
        assert (
            sum(row["routed_per_replica"]) >= row["requests"]
            and len(row["routed_per_replica"]) == n
        )
        assert max(row["routed_per_replica"]) - min(row["routed_per_replica"]) <= 1
    assert (rows[1]["bound_points"], rows[2]["bound_points"], rows[4]["bound_points"]) == (
        None,
        None,
        2.0,
    )
    assert r["ok"] == (rows[4]["points_lost"] <= 2.0)
    for n, row in unshared.items():  # the same requests, decisions not shared
        assert (
            row["requests"] == rows[n]["requests"]
            and row["bound_points"] == rows[n]["bound_points"]
        )
        assert row["points_lost"] == pytest.approx(
            (base["hit_rate"] - row["hit_rate"]) * 100, abs=0.02
        )


def test_replicas_draws_rerun_each_seed_with_other_tie_breaks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--draws: each workload seed runs once per draw, the first draw being the run without
    it, the others the same requests with the routers' other random streams."""
    args = ["replicas", "--replicas", "1,2", "--loads", "0.6", "--duration", "6",
            "--share", "on", "--seeds", "2"]  # fmt: skip
    one = bench(capsys, *args)
    r = bench(capsys, *args, "--draws", "3")
    assert r["draws"] == 3 and one["draws"] == 1
    for row, before in zip(r["rows"], one["rows"], strict=True):
        p50s = row["ttft_p50_ms_per_seed"]
        assert len(p50s) == 6 and len(row["points_lost_per_seed"]) == 6
        # seed-major: each seed's first draw is that seed's run without --draws
        assert [p50s[0], p50s[3]] == before["ttft_p50_ms_per_seed"]
        assert row["ttft_p50_ms"] == pytest.approx(sum(p50s) / 6, abs=0.1)
        assert row["ttft_p50_ms_median_run"] == pytest.approx(statistics.median(p50s), abs=0.1)
    base = r["rows"][0]
    assert base["points_lost_per_seed"] == [0] * 6  # paired run by run with the baseline
    # the draws are other random streams: the same requests, not all routed alike
    row = r["rows"][1]
    runs = set(zip(row["ttft_p50_ms_per_seed"], row["ttft_p99_ms_per_seed"], strict=True))
    assert len(runs) > 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--replicas", "0,4"], "--replicas"),
        (["--replicas", "4,4"], "--replicas"),
        (["--loads", "x"], "--loads"),
        (["--event-lag", "-1"], "--event-lag"),
        (["--capacity", "0"], "--capacity"),
        (["--placement-lag", "-1"], "--placement-lag"),
        (["--draws", "0"], "--draws"),
        (["--policy", "nosuch"], "unknown routing policy"),
    ],
)
def test_replicas_refuses_bad_arguments(argv: list[str], says: str) -> None:
    parser = argparse.ArgumentParser()
    benchmarks.add_arguments(parser)
    with pytest.raises(SystemExit, match=says):
        benchmarks.run(parser.parse_args(["replicas", "--json", "--duration", "2", *argv]))


def test_tokenize(capsys: pytest.CaptureFixture[str]) -> None:
    r = bench(capsys, "tokenize", "--tokens", "1500", "--repeats", "2", "--idle-ms", "5")
    assert r["ids_identical"] and r["incremental"]
    assert r["piece_cpu_ms_back_to_back"] > 0 and r["piece_cpu_ms_after_idle"] > 0
    assert r["piece_after_idle_ratio"] > 0
    assert not r["p4_applies"]  # P4 names an 8,000-token conversation
    assert r["ok"] and 0 < r["tokenize_followup_ratio"] < 1


def test_soak(capsys: pytest.CaptureFixture[str]) -> None:
    r = bench(capsys, "soak", "--minutes", "0.2", "--rate", "4", "--workers", "2",
              "--kv-blocks", "128", "--sample", "1")  # fmt: skip
    assert r["requests"] > 20 and r["failed"] == 0, r["errors"]
    assert r["samples"] >= 5 and 0 < r["index_blocks_max"] <= r["index_capacity_blocks"]
    assert {"gateway", "redis", "sim", "agent-0", "agent-1"} <= set(r["processes"])
    assert isinstance(r["worst_growth"], float) and isinstance(r["hit_rate"], float)


def test_faults_benchmark_reports_every_scenario(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class FakeStack:
        def __init__(self, cfg: Any) -> None:
            self.cfg = cfg

        def __enter__(self) -> FakeStack:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    seen: list[tuple[str, dict[str, Any]]] = []

    def fake_fault(name: str, stack: FakeStack, **params: Any) -> FaultResult:
        seen.append((name, params))
        ok = name != "stuck_worker"
        return FaultResult(name, "injected", requests=10, failed=0 if ok else 1, ok=ok)

    monkeypatch.setattr(faults_bench, "Stack", FakeStack)
    monkeypatch.setattr(faults_bench, "run_fault", fake_fault)
    r = bench(capsys, "faults", "--faults", "redis_outage,bad_events", "--redis-outage", "2")
    assert seen == [("redis_outage", {"outage_s": 2.0}), ("bad_events", {})]
    assert r["ok"] and r["failed_requests"] == 0 and len(r["faults"]) == 2
    assert [row["fault"] for row in r["table"]] == ["redis_outage", "bad_events"]
    r = bench(capsys, "faults", "--faults", "stuck_worker")
    assert not r["ok"] and r["failed_requests"] == 1


def test_events_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    """Simulated agents on a 3-shard Redis Cluster, and on one redis-server as the baseline."""
    r = bench(capsys, "events", "--workers", "8", "--cluster", "3", "--blocks", "2000",
              "--rate", "2000", "--duration", "1", "--idle", "0.3", "--capacity", "800")  # fmt: skip
    assert r["mode"] == "fleet" and len(r["runs"]) == 2
    cluster, single = r["runs"]
    assert cluster["redis"] == "cluster of 3 primaries" and len(cluster["redis_cpu_seconds"]) == 3
    for run in r["runs"]:
        assert run["index_equals_mirrors"] and run["workers"] == 8
        assert run["blocks_per_s"] > 0 and run["burst_blocks"] >= 2000
        assert run["lag_entries"] > 0 and 0 < run["lag_p50_ms"] <= run["lag_p99_ms"]
        assert run["bytes_per_block"] > 0 and run["consumer_cpu_us_per_block_burst"] > 0
    assert single["redis"] == "one redis-server"
    assert r["ratios_cluster_over_one_node"]["blocks_per_s"] > 0
    assert r["ok"] == all(r["targets"].values())
