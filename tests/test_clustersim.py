"""The offline cluster simulator: its shortcuts are exact, its bound bounds, routing-quality
properties hold on it, and it agrees with a live run of the same small scenario."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import statistics
import tempfile
import urllib.request
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.keys import BlockKeyer
from gateway.routing.policy import Decision
from gateway.routing.replication import WarmupIntent
from gateway.tokenization import Tokenizer, bundled_test_tokenizer
from loadtest.clustersim import (
    Arrival,
    ClusterConfig,
    ClusterSim,
    FingerprintKeys,
    RequestTable,
    SimResult,
    TokenKeys,
    estimate_capacity,
    pooled_bound,
    retime,
    simulate,
    summarize,
)
from loadtest.driver import DriverConfig, run_load
from loadtest.driver import summarize as driver_summarize
from loadtest.workloads import make_workload, write_synthetic_trace

CHAT = {
    "conversations": 80,
    "turns": (3, 6),
    "system_prompts": 6,
    "system_tokens": 1500,
    "user_tokens": (100, 400),
    "assistant_tokens": (20, 60),
    "think_time": 4.0,
}
#: 4 workers of 16k tokens: six 1.5k-token system prompts plus conversations do not fit
CHAT_CLUSTER = {"workers": 4, "kv_blocks": 1024, "timing": "seed-70b"}
POLICIES = ("ttft", "round_robin", "prefix", "least_load", "session", "random")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(bundled_test_tokenizer(), "deepseek-v3")


@pytest.fixture(scope="module")
def chat(tokenizer: Tokenizer) -> list[Arrival]:
    from loadtest.simulate import workload_arrivals

    return retime(workload_arrivals("chat", CHAT, mode="completion_ids", tokenizer=tokenizer), 8.0)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    write_synthetic_trace(path, requests=1500, duration_s=150.0, seed=3)
    return path


def trace_stream(path: Path, limit: int | None = None) -> list[Arrival]:
    from loadtest.simulate import trace_arrivals

    return list(trace_arrivals(path, limit=limit))


TRACE_CLUSTER = {"workers": 16, "block_size": 512, "kv_blocks": 512}


def outcome(res: SimResult) -> list[tuple[int, int, int, int]]:
    t = res.table
    return sorted(zip(t.index, t.worker, t.cached_tokens, t.output_tokens, strict=True))


# -- exactness ---------------------------------------------------------------------------------


def test_same_seed_same_run(chat: list[Arrival]) -> None:
    a = simulate(chat, ClusterConfig(**CHAT_CLUSTER, seed=7))
    b = simulate(chat, ClusterConfig(**CHAT_CLUSTER, seed=7))
    assert a.summary == b.summary
    assert list(a.table.ttft) == list(b.table.ttft) and outcome(a) == outcome(b)
    assert a.summary["ok"] == len(chat) and a.summary["failed"] == 0


def test_decode_spans_and_report_skipping_change_nothing(trace: Path) -> None:
    """The simulator's two shortcuts against a run without them: one ``EngineCore.step`` per
    engine step (as the live worker drives it) and every load report applied. Same routing
    decisions and cache hits; times equal up to float rounding (k x dt vs k additions)."""
    stream = trace_stream(trace, 1200)
    fast = simulate(stream, ClusterConfig(**TRACE_CLUSTER))
    slow_sim = ClusterSim(ClusterConfig(**TRACE_CLUSTER))
    slow_sim.fast_forward = False
    slow_sim.skip_redundant_reports = False
    slow = slow_sim.run(stream)
    assert fast.engine["spans"] > 0 and fast.engine["reports_skipped"] > 0
    assert fast.engine["reports_revived"] > 0 and slow.engine["reports_skipped"] == 0
    assert fast.engine["step_calls"] * 5 < slow.engine["step_calls"]
    assert outcome(fast) == outcome(slow)
    by_index = dict(zip(slow.table.index, slow.table.ttft, strict=True))
    assert all(
        abs(t - by_index[i]) <= 1e-6 * max(1.0, t)
        for i, t in zip(fast.table.index, fast.table.ttft, strict=True)
    )


def _views_at_decisions(sim: ClusterSim) -> list[list[Any]]:
    """Run ``sim`` recording, at every routing decision, every worker's load view."""
    loads, seen = sim.router.loads, []
    sim.before_route = lambda _: seen.append([loads.view(n) for n in sim.names])
    return seen


def test_reports_left_aside_change_no_view(trace: Path) -> None:
    """A sample that repeats an untouched engine's last report is not queued (``_sample``'s
    ghost); one touched before it would have arrived is queued after all (``_revive``).
    Every decision sees exactly the load views of a run that applies every report."""
    stream = trace_stream(trace, 1500)
    cfg = ClusterConfig(**{**TRACE_CLUSTER, "workers": 32})
    fast_sim, slow_sim = ClusterSim(cfg), ClusterSim(cfg)
    slow_sim.skip_redundant_reports = False
    fast_views, slow_views = _views_at_decisions(fast_sim), _views_at_decisions(slow_sim)
    fast, slow = fast_sim.run(stream), slow_sim.run(stream)
    assert fast.engine["reports_revived"] > 0 and fast.engine["reports_skipped"] > 0
    assert len(fast_views) == len(slow_views) == len(stream)
    assert fast_views == slow_views
    assert outcome(fast) == outcome(slow)


def test_gc_thresholds_hold_during_a_run_only_and_change_nothing(trace: Path) -> None:
    """``gc_thresholds`` and ``malloc_pad`` are in force while ``run`` runs (seen from its
    progress callback), the caller's collector and glibc's default pad are back afterwards,
    also when the run fails, and the run is the one made with both left alone."""
    import loadtest.clustersim as clustersim

    pads: list[int] = []

    def watched(sim: ClusterSim) -> ClusterSim:
        real_pad = sim.pad_heap
        sim.pad_heap = lambda n: pads.append(n) or real_pad(n)
        return sim

    stream = trace_stream(trace, 300)
    caller = gc.get_threshold()
    seen: list[tuple[int, ...]] = []
    tuned = watched(ClusterSim(ClusterConfig(**TRACE_CLUSTER)))
    res = tuned.run(stream, lambda n: seen.append(gc.get_threshold()), progress_every=100)
    assert seen and set(seen) == {tuned.gc_thresholds} != {caller}
    assert gc.get_threshold() == caller
    assert pads == [tuned.malloc_pad, clustersim._GLIBC_PAD] and tuned.malloc_pad
    plain_sim = watched(ClusterSim(ClusterConfig(**TRACE_CLUSTER)))
    plain_sim.gc_thresholds = plain_sim.malloc_pad = None
    plain = plain_sim.run(stream, lambda n: seen.append(gc.get_threshold()), progress_every=100)
    assert seen[-1] == caller
    assert outcome(res) == outcome(plain) and list(res.table.ttft) == list(plain.table.ttft)
    backwards = [stream[1], dataclasses.replace(stream[0], at=stream[1].at - 1.0)]
    with pytest.raises(ValueError, match="out of order"):
        watched(ClusterSim(ClusterConfig(**TRACE_CLUSTER))).run(backwards)
    assert gc.get_threshold() == caller
    assert pads == [tuned.malloc_pad, clustersim._GLIBC_PAD] * 2


def _reference_prompt(rec: dict[str, Any], block_tokens: int) -> bytes:
    """A trace record's prompt, block by block: token ``hash id + 2`` per position."""
    out, left = b"", rec["input_length"]
    for h in rec["hash_ids"]:
        if left <= 0:
            break
        take = min(left, block_tokens)
        out += (h + 2).to_bytes(4, "little") * take
        left -= take
    return out


_record = st.fixed_dictionaries(
    {
        "timestamp": st.integers(0, 10**6),
        "input_length": st.integers(-2, 40),
        "output_length": st.integers(0, 9),
        "hash_ids": st.lists(st.integers(0, 2**31 - 3), max_size=6),
    }
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_record, max_size=8), st.integers(1, 9))
def test_trace_prompts_are_the_hash_ids_repeated(records: list[dict[str, Any]], bt: int) -> None:
    """Each record's prompt is its hash ids' blocks cut to ``input_length`` (no hash ids or
    no input: no request), its index the record's position, output at least one token."""
    from loadtest.simulate import trace_arrivals

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.jsonl"
        path.write_text(
            "".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["timestamp"]))
        )
        got = list(trace_arrivals(path, block_tokens=bt))
        want = [
            (i, r["timestamp"] / 1000.0, _reference_prompt(r, bt), max(1, r["output_length"]))
            for i, r in enumerate(sorted(records, key=lambda r: r["timestamp"]))
            if _reference_prompt(r, bt)
        ]
        assert [(a.index, a.at, a.tokens, a.max_tokens) for a in got] == want


def test_a_trace_hash_id_out_of_range_is_refused(tmp_path: Path) -> None:
    from loadtest.simulate import trace_arrivals

    path = tmp_path / "t.jsonl"
    rec = {"timestamp": 0, "input_length": 30, "output_length": 1, "hash_ids": [1, 2**31 - 2]}
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"record 0: hash id 2147483646 out of range"):
        list(trace_arrivals(path, block_tokens=16))
    rec["hash_ids"] = [1, -1, 3]  # the first bad id is named
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"hash id -1 out of range"):
        list(trace_arrivals(path, block_tokens=16))
    rec["hash_ids"] = [1, 2**64 - 1]  # beyond int64
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=rf"hash id {2**64 - 1} out of range"):
        list(trace_arrivals(path, block_tokens=16))
    rec["input_length"] = 16  # ids past the prompt are not read
    path.write_text(json.dumps(rec) + "\n")
    assert len(next(trace_arrivals(path, block_tokens=16)).tokens) == 64


def test_summary_is_the_load_driver_format(chat: list[Arrival]) -> None:
    res = simulate(chat, ClusterConfig(**CHAT_CLUSTER, policy="round_robin"))
    records = res.table.to_records(ClusterConfig(**CHAT_CLUSTER).worker_names())
    expected = driver_summarize(records, res.duration, res.config.slo_ttft_ms)
    got = summarize(res.table, res.config.worker_names(), res.duration, res.config.slo_ttft_ms)
    added = {"predicted_tokens", "index_precision"}  # the simulator's own (Q8)
    assert {k: v for k, v in got.items() if k not in added} == expected
    assert added <= got.keys()


def test_index_precision_is_the_live_comparisons(chat: list[Arrival]) -> None:
    """Predicted = each decision's matched tokens, agreed = min(predicted, cached) per
    request: the live ``index_precision`` (loadtest/compare.py), here from the simulator."""
    table = RequestTable()
    for i, (pred, cached) in enumerate([(100, 100), (50, 20), (0, 30), (10, 0)]):
        for col, v in (("index", i), ("worker", 0), ("arrival", 0.0), ("ttft", 0.1),
                       ("e2e", 0.2), ("prompt_tokens", 200), ("cached_tokens", cached),
                       ("output_tokens", 2), ("predicted_tokens", pred)):  # fmt: skip
            getattr(table, col).append(v)
    got = summarize(table, ["w0"], 1.0, 1000.0)
    assert got["predicted_tokens"] == 160 and got["index_precision"] == round(120 / 160, 4)
    table.predicted_tokens = type(table.predicted_tokens)("q", [0] * 4)
    assert summarize(table, ["w0"], 1.0, 1000.0)["index_precision"] is None

    sim = ClusterSim(ClusterConfig(**CHAT_CLUSTER))
    matched: list[int] = []
    sim.after_route = lambda _, d: matched.append(d.matched_tokens)
    res = sim.run(chat)
    assert res.summary["ok"] == len(chat) == len(matched)
    assert res.summary["predicted_tokens"] == sum(matched) > 0
    assert 0.98 <= res.summary["index_precision"] <= 1.0


def test_keys_chain_like_the_deployment_keys(trace: Path) -> None:
    """Exact keys are BlockKeyer's; fingerprint keys have the chain property and follow the
    trace's hash ids (equal ids <=> equal prefix)."""
    tokens = list(range(1000, 1100))
    exact = TokenKeys("seed", 16)
    data = Arrival(0, 0.0, b"".join(t.to_bytes(4, "little") for t in tokens), 1).tokens
    assert exact.keys(data) == BlockKeyer("seed", 16).keys(tokens)
    fk = FingerprintKeys("seed", 512)
    stream = trace_stream(trace, 400)
    recs = [json.loads(line) for line in trace.read_text().splitlines()[:400]]
    for a, rec in zip(stream, recs, strict=True):
        assert a.prompt_tokens == rec["input_length"]
        keys = fk.keys(a.tokens)
        assert len(keys) == rec["input_length"] // 512
        if keys:
            assert fk.keys(a.tokens[512 * 4 :], keys[0]) == keys[1:]
    seen: dict[tuple[int, ...], int] = {}
    for a, rec in zip(stream, recs, strict=True):
        for n, key in enumerate(fk.keys(a.tokens), 1):
            assert seen.setdefault(tuple(rec["hash_ids"][:n]), key) == key
    assert len(set(seen.values())) == len(seen)


# -- routing quality -----------------------------------------------------------------------------


def test_pooled_bound_is_at_least_every_policy(chat: list[Arrival]) -> None:
    bound = pooled_bound(chat, ClusterConfig(**CHAT_CLUSTER))
    assert (bound.config.workers, bound.config.kv_blocks) == (1, 4 * 1024)
    rates = {p: simulate(chat, ClusterConfig(**CHAT_CLUSTER, policy=p)).hit_rate for p in POLICIES}
    assert all(bound.hit_rate >= r for r in rates.values()), (bound.hit_rate, rates)
    assert rates["round_robin"] < rates["ttft"] - 0.15  # shared system prompts: affinity pays
    assert rates["ttft"] >= 0.95 * bound.hit_rate


def test_ttft_spreads_a_hot_prefix_that_prefix_piles_up(tokenizer: Tokenizer) -> None:
    """Q3's scenario scaled down: one 6,000-token prefix on every request, 4 workers, 6 req/s
    per worker. Longest-prefix sends everything to the holder; ttft spreads it."""
    from loadtest.simulate import workload_arrivals

    hot = {
        "groups": 1,
        "prompts_per_group": 400,
        "prefix_tokens": 6000,
        "question_tokens": 200,
        "output_tokens": 32,
    }
    stream = retime(
        workload_arrivals("shared_prefix", hot, mode="completion_ids", tokenizer=tokenizer), 24.0
    )
    cluster = {"workers": 4, "kv_blocks": 2048, "timing": "seed-70b"}
    ttft = simulate(stream, ClusterConfig(**cluster)).summary
    prefix = simulate(stream, ClusterConfig(**cluster, policy="prefix")).summary
    bound = pooled_bound(stream, ClusterConfig(**cluster)).hit_rate
    assert ttft["max_mean_requests"] <= 1.3
    assert prefix["max_mean_requests"] >= 3.9
    assert ttft["hit_rate"] >= 0.95 * bound
    assert ttft["ttft_p99_ms"] < prefix["ttft_p99_ms"]


def test_capacity_is_the_knee_of_p99_ttft(chat: list[Arrival]) -> None:
    cfg = ClusterConfig(**CHAT_CLUSTER)
    cap = estimate_capacity(lambda r: retime(chat, r), cfg, reference=chat, rel_tol=0.05)
    assert cap.rate > 0 and cap.limit_ms == pytest.approx(3 * cap.reference_ms, rel=1e-3)
    passed = [p.rate for p in cap.probes if p.ok]
    failed = [p.rate for p in cap.probes if not p.ok]
    assert max(passed) == cap.rate and min(failed) <= cap.rate * 1.06
    rr = estimate_capacity(
        lambda r: retime(chat, r),
        ClusterConfig(**CHAT_CLUSTER, policy="round_robin"),
        reference=chat,
    )
    assert rr.rate < cap.rate


def test_reference_numbers_for_the_live_comparison() -> None:
    """What ``kvroute loadtest compare`` gets: capacity and the bound at every load level."""
    from loadtest.compare import CompareConfig
    from loadtest.simulate import for_comparison

    small = {**CHAT, "conversations": 30}
    cfg = CompareConfig(workload="chat", params=small, workers=2, kv_blocks=1024, timing="seed-70b",
                        duration=30.0, loads=[0.3, 0.9], mode="completion_ids")  # fmt: skip
    ref = for_comparison(cfg)
    assert ref["capacity_rps"] > 0 and ref["capacity"]["probes"]
    assert set(ref["bound_by_load"]) == {"0.3", "0.9"}
    assert ref["bound_hit_rate"] == max(ref["bound_by_load"].values())
    for load, bound in ref["bound_by_load"].items():
        assert bound >= ref["policy_hit_rate_by_load"][load]
    given = for_comparison(CompareConfig(**{**vars(cfg), "capacity_rps": 5.0}))
    assert given["capacity_rps"] == 5.0 and given["capacity"] is None


# -- command line and benchmark --------------------------------------------------------------------


def test_simulate_command_and_benchmark(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loadtest import simulate as cli
    from loadtest.benchmarks import simulate as bench

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    gen = tmp_path / "gen.jsonl"
    args = p.parse_args(["--gen-trace", str(gen), "--requests", "300", "--duration-s", "60", "--workers", "4",
                         "--compare-policies", "ttft,round_robin", "--bound", "--json"])  # fmt: skip
    assert cli.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(gen.read_text().splitlines()) == 300
    assert [r["policy"] for r in out["results"]] == ["ttft", "round_robin"]
    assert out["results"][0]["summary"]["requests"] == 300
    assert 0 < out["bound_hit_rate"] <= 1 and out["cluster"]["block_size"] == 512

    # gateway replicas: the same stream once per count, the hit rate lost against the first
    args = p.parse_args(["--trace", str(gen), "--workers", "4", "--replicas", "1,3", "--json"])
    assert cli.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    one, three = out["results"]
    assert (one["replicas"], three["replicas"]) == (1, 3)
    assert three["sim"]["routed_per_replica"] == [100, 100, 100]
    lost = (one["summary"]["hit_rate"] - three["summary"]["hit_rate"]) * 100
    assert one["hit_points_lost"] == 0 and three["hit_points_lost"] == pytest.approx(lost, abs=0.01)
    unshared = p.parse_args(["--trace", str(gen), "--workers", "4", "--replicas", "1,3",
                             "--no-share-placements", "--json"])  # fmt: skip
    assert cli.run(unshared) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["config"]["share_placements"] for r in out["results"]] == [False, False]
    assert three["config"]["share_placements"] is True
    for bad in ("0", "2,2", "x"):
        with pytest.raises(SystemExit, match="--replicas"):
            cli.run(p.parse_args(["--trace", str(gen), "--replicas", bad]))

    bp = argparse.ArgumentParser()
    bp.add_argument("--json", action="store_true")
    bench.add_arguments(bp)
    res = bench.run(
        bp.parse_args(["--workers", "4", "--requests", "200", "--trace", str(trace), "--json"])
    )
    assert res["requests_per_s"] > 0 and res["round_robin"]["requests_per_s"] > 0
    assert res["projected_full_s"] == pytest.approx(res["us_per_request"], rel=1e-3)

    # policies with parameters, an A/B on one stream: the parameter reaches the policy
    ab = bench.run(bp.parse_args(["--workers", "4", "--requests", "200", "--trace", str(trace),
                                  "--policy", "ttft:tie_ms=1000", "--baseline", "ttft",
                                  "--json"]))  # fmt: skip
    shown = ("hit_rate", "ttft_p50_ms", "max_mean_load")
    # a 1 s near-tie window spreads by load alone: not the default's placement
    assert [ab["ttft:tie_ms=1000"][k] for k in shown] != [ab["ttft"][k] for k in shown]
    assert ab["ttft:tie_ms=1000"]["policy"] == "ttft:tie_ms=1000"
    for bad, says in (("ttft:nope=1", "nope"), ("ttft:replication", "PARAM=VALUE"),
                      ("nosuch", "unknown routing policy")):  # fmt: skip
        with pytest.raises(SystemExit, match=says):
            bench.run(bp.parse_args(["--workers", "4", "--requests", "200", "--trace",
                                     str(trace), "--policy", bad, "--json"]))  # fmt: skip


# -- agreement with a live run -----------------------------------------------------------------------

LIVE_CHAT = {
    "conversations": 60,
    "turns": (3, 6),
    "system_prompts": 4,
    "system_tokens": 1500,
    "user_tokens": (300, 800),
    "assistant_tokens": (4, 12),
    "think_time": 2.0,
}
LIVE_RATE = 15.0  # req/s offered to 3 workers: ~270 requests in ~18 s
LIVE_CLUSTER = {
    "workers": 3,
    "kv_blocks": 600,
    "block_size": 16,
    "timing": "seed-70b",
    "speedup": 10.0,
}


def _engine_ttft(urls: list[str]) -> tuple[float, float]:
    """(sum of TTFT seconds, count) over the workers' own TTFT histograms."""
    total = count = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("vllm:time_to_first_token_seconds_sum"):
                    total += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:time_to_first_token_seconds_count"):
                    count += float(line.rsplit(" ", 1)[1])
    return total, count


@pytest.mark.slow
@pytest.mark.alone
def test_agrees_with_a_live_run(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """The same scenario live (Redis + 3 sim workers + agents + gateway, real processes,
    ``completion_ids`` prompts so both see identical tokens) and in the simulator.

    Measured on this shared 2-core machine (3 runs, live vs simulator): hit rate 0.664-0.679
    vs 0.671; engines' mean TTFT 20.9-22.7 vs 20.6 ms; p50 in engine time 13.7-17.4 vs
    13.8 ms. Tolerances:

    * hit rate within 0.05 absolute of the simulator's mean over 5 seeds: the routing is the
      same code, but live timing jitter changes some tie-breaks under eviction (the
      simulator's own seed-to-seed spread is about +-0.02);
    * TTFT in engine time, since the simulator has no network and no process CPU: the
      engines' own mean TTFT (their histograms) and the client's p50 minus the mean client
      overhead (client mean - engine mean, 12-23 ms here) each within 0.8-1.75x the
      simulator's. Live engine steps end late by their event loop's lag and slow down
      further when other processes take the CPU (a heavier variant of this scenario reached
      2x while other test suites ran), hence the band's width above 1.
    """
    from loadtest.simulate import items_arrivals
    from loadtest.stack import Stack, StackConfig

    items = list(make_workload("chat", seed=1, **LIVE_CHAT).items())
    stream = retime(items_arrivals(items, mode="completion_ids", tokenizer=tokenizer), LIVE_RATE)
    for it, a in zip(items, stream, strict=True):
        it.at = a.at
    c = LIVE_CLUSTER
    sims = [simulate(stream, ClusterConfig(**c, seed=s)).summary for s in range(5)]  # type: ignore[arg-type]
    sim_hit = statistics.mean(s["hit_rate"] for s in sims)
    sim_mean = statistics.mean(s["ttft_mean_ms"] for s in sims)
    sim_p50 = statistics.mean(s["ttft_p50_ms"] for s in sims)

    cfg = StackConfig(workers=3, speedup=c["speedup"], timing=str(c["timing"]), kv_blocks=int(c["kv_blocks"]),
                      block_size=int(c["block_size"]), log_dir=tmp_path / "stack")  # fmt: skip
    with Stack(cfg) as stack:
        before = _engine_ttft(stack.worker_urls)
        dcfg = DriverConfig(
            base_url=stack.gateway_urls[0], model=cfg.model, mode="completion_ids", progress=False
        )
        live = asyncio.run(run_load(items, dcfg)).summary
        after = _engine_ttft(stack.worker_urls)
    assert live["failed"] == 0 and live["ok"] == len(items)
    engine_mean = (after[0] - before[0]) / (after[1] - before[1]) * 1000.0
    overhead = live["ttft_mean_ms"] - engine_mean
    live_p50 = live["ttft_p50_ms"] - overhead
    report = f"live hit {live['hit_rate']} vs {sim_hit:.4f}; engine mean {engine_mean:.1f} vs {sim_mean:.1f} ms; p50 {live_p50:.1f} vs {sim_p50:.1f} ms (overhead {overhead:.1f})"
    print(report)
    assert abs(live["hit_rate"] - sim_hit) <= 0.05, report
    assert 0.8 <= engine_mean / sim_mean <= 1.75, report
    assert 0.8 <= live_p50 / sim_p50 <= 1.75, report


def test_a_warm_up_is_reported_to_the_hook_as_it_is_sent() -> None:
    """``on_warmup`` sees each warm-up the simulator sends (``presettrace`` prints them), and
    the warm-up is still sent: counted, and loading its worker."""
    sim = ClusterSim(ClusterConfig(**TRACE_CLUSTER))
    seen: list[tuple[WarmupIntent, float]] = []
    sim.on_warmup = lambda intent, t: seen.append((intent, t))
    intent = WarmupIntent(sim.names[3], key=7, blocks=2, tokens=1024, at=1.5)
    sim._warm(sim.router, intent, bytes(4 * 2048), 1.5)
    assert seen == [(intent, 1.5)]
    assert sim._stats["warmups"] == 1 and sim._stats["warmup_tokens"] == 1024
    assert sim.router.loads.view(sim.names[3]).queued_prefill_tokens == 1024


# -- gateway replicas (Q4) ---------------------------------------------------------------------


def test_replicas_share_the_stream_and_every_index_sees_every_event(chat: list[Arrival]) -> None:
    """Arrivals reach the replicas in turn; each replica's index is fed by every worker's
    events, so after the run (speculation expired) all hold the same blocks per worker; each
    replica accounted for its own requests only, and none is left in flight."""
    sim = ClusterSim(ClusterConfig(**CHAT_CLUSTER, replicas=3))
    res = sim.run(chat)
    routed = res.engine["routed_per_replica"]
    assert sum(routed) == len(chat) and max(routed) - min(routed) <= 1
    assert res.summary["ok"] == len(chat)
    for ix in sim.indexes:
        ix.expire(1e9)
    held = [{w: ix.worker_keys(w) for w in sim.names} for ix in sim.indexes]
    assert sum(map(len, held[0].values())) > 0
    assert held[1] == held[0] and held[2] == held[0]
    for router in sim.routers:
        assert all(router.loads.view(w).idle for w in sim.names)
    one = simulate(chat, ClusterConfig(**CHAT_CLUSTER))
    assert one.engine["routed_per_replica"] == [len(chat)]


def _decisions(replicas: int, arrivals: list[Arrival], **config: Any) -> list[Decision]:
    sim = ClusterSim(ClusterConfig(**CHAT_CLUSTER, replicas=replicas, **config))
    seen: list[Decision] = []
    sim.after_route = lambda a, d: seen.append(d)
    sim.run(arrivals)
    return seen


def test_a_replica_does_not_see_another_replicas_decisions() -> None:
    """Two requests with one 2,000-token prompt, 1 ms apart (before any KV event): one
    gateway predicts the second a hit on the first's worker (its speculative insert); with two
    replicas the second reaches the other replica, which knows nothing of the first."""
    prompt = array("I", range(2, 2002)).tobytes()
    arrivals = [Arrival(0, 0.0, prompt, 8), Arrival(1, 0.001, prompt, 8)]
    one = _decisions(1, arrivals)
    two = _decisions(2, arrivals, share_placements=False)
    assert one[0].matched_tokens == two[0].matched_tokens == 0
    assert one[1].worker == one[0].worker and one[1].matched_tokens >= 1984
    assert two[1].matched_tokens == 0
    # shared decisions: the first replica's insert reaches the second 5 ms later, in time
    # for a request 10 ms after the first (not for one 1 ms after it)
    later = [arrivals[0], Arrival(1, 0.010, prompt, 8)]
    shared = _decisions(2, later, share_placements=True, placement_lag=0.005)
    assert shared[1].worker == shared[0].worker and shared[1].matched_tokens >= 1984
    early = _decisions(2, arrivals, share_placements=True, placement_lag=0.005)
    assert early[1].matched_tokens == 0


def test_replicas_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="replicas"):
        ClusterConfig(replicas=0)


def test_replicas_sharing_load_count_each_others_requests_in_flight() -> None:
    """With ``share_load`` a replica's request counts in the other's load view from
    ``placement_lag`` after its start to its end; without it, it does not."""
    prompt = array("I", range(2, 2002)).tobytes()
    arrivals = [Arrival(0, 0.0, prompt, 8), Arrival(1, 0.010, prompt, 8)]
    seen: dict[bool, int] = {}
    for share_load in (True, False):
        sim = ClusterSim(
            ClusterConfig(**CHAT_CLUSTER, replicas=2, placement_lag=0.005, share_load=share_load)
        )

        def look(a: Arrival, sim: ClusterSim = sim, share_load: bool = share_load) -> None:
            if a.index == 1:  # replica 1, before routing: what it knows of replica 0's request
                seen[share_load] = sim.routers[1].loads.inflight_total()

        sim.before_route = look
        res = sim.run(arrivals)
        assert len(res.ttfts_ms()) == 2
        assert sim.routers[1].loads.inflight_total() == 0  # every request ended everywhere
    assert seen == {True: 1, False: 0}
