"""``kvroute simulate --from-log``: a captured request log replayed in the cluster simulator.

The live test captures a log from a real stack (gateway + sim workers + agents + Redis) and
replays it under the same policy. Which decisions must agree: with the same index state and
the same random source, the chosen worker of every request. The ``prefix`` policy (longest
cached prefix, load ignored, cold picks and ties at random) decides from the index alone, so
with a seeded pool (``pools.N.seed`` = the replay's ``--seed``) and requests sent one after
another (speculative inserts make each prompt's keys visible to the next decision in both
worlds) every decision must be the same. The ``ttft`` policy also weighs load, which the
simulated engines' timing makes differ from the live ones, so it is compared, not matched.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_helpers import WORDS

from gateway.config import RequestLogSettings
from gateway.proxy import Usage
from gateway.request_log import RequestLog
from gateway.routing.policy import Decision
from loadtest import simulate
from loadtest.clustersim import ClusterConfig
from loadtest.clustersim import simulate as run_sim
from loadtest.replay import (
    LogFormatError,
    block_tokens,
    read_log,
    simulated_decisions,
    successors,
)
from loadtest.stack import Stack, StackConfig, wait_for


def write_log(
    path: Path,
    rows: list[tuple[list[int], int, str]],
    pool: str = "m",
    sessions: list[str | None] | None = None,
    output: int = 3,
) -> None:
    """Records through the real writer: (keys, prompt tokens, chosen worker), each with
    ``output`` generated tokens and its session (``sessions``, default none)."""
    rl = RequestLog(RequestLogSettings(path=str(path)), "seed")
    rl.open()
    for i, (keys, prompt, worker) in enumerate(rows):
        d = Decision(worker, "round_robin", "turn", 0, None)
        session = sessions[i] if sessions is not None else None
        usage = Usage(prompt, 0, output)
        rl.record(pool, 16, keys, prompt, d, ["w-a", "w-b"], 0.0, usage, 200, session)
        time.sleep(0.002)  # distinct arrival times
    rl.close()


def sim_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    return p.parse_args([*argv, "--no-progress"])


def test_replayed_prompts_share_blocks_exactly_where_their_key_chains_do(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_log(path, [([1, 2, 3], 50, "w-a"), ([1, 2, 4], 60, "w-b"), ([9], 20, "w-a")])
    log = read_log([str(path)])
    assert (log.pool, log.block_size, log.names, len(log)) == ("m", 16, ["w-a", "w-b"], 3)
    a, b, c = log.arrivals()
    assert (a.prompt_tokens, b.prompt_tokens, c.prompt_tokens) == (50, 60, 20)
    assert a.tokens[: 2 * 64] == b.tokens[: 2 * 64] and a.tokens[: 3 * 64] != b.tokens[: 3 * 64]
    assert a.tokens[3 * 64 :] != b.tokens[3 * 64 : 3 * 64 + 8]  # tails are the request's own
    assert a.workers == frozenset({"w-a", "w-b"}) and a.at == 0.0 < b.at < c.at
    # distinct 64-bit keys give distinct blocks
    keys = np.array([2**63 + 5, 5, 2**62 + 5], dtype=np.uint64)
    toks = block_tokens(keys, 48, 16, 0)
    assert len({toks[i * 64 : (i + 1) * 64] for i in range(3)}) == 3


def test_a_turn_that_sends_the_answer_back_is_its_predecessors_successor(tmp_path: Path) -> None:
    """Sessions link turns; without one, a chain that extends a new last key does, and a
    prompt ending inside a prefix others hold (key 1 below) gets no successor."""
    path = tmp_path / "r.jsonl"
    rows = [
        ([1, 2], 40, "w-a"),  # 0: session a, turn 1
        ([1, 7], 40, "w-a"),  # 1: session b, turn 1
        ([1, 7, 8, 9], 70, "w-b"),  # 2: session b, turn 2
        ([1, 2, 3, 4], 70, "w-b"),  # 3: session a, turn 2
        ([1, 2, 3, 4], 70, "w-b"),  # 4: session c: the same chain, another session
        ([1, 5], 40, "w-a"),  # 5: no session, a new last key
        ([1], 20, "w-a"),  # 6: no session, ends inside everyone's first block
        ([1, 5, 6], 60, "w-b"),  # 7: no session, extends 5 (and 6's key 1)
        ([1, 2, 3, 4, 10], 90, "w-a"),  # 8: session a, turn 3
    ]
    sessions = ["a", "b", "b", "a", "c", None, None, None, "a"]
    write_log(path, rows, sessions=sessions)
    log = read_log([str(path)])
    assert successors(log.rows) == [3, 2, -1, 8, -1, 7, -1, -1, -1]


def test_a_follow_up_turn_reuses_the_answer_its_predecessor_generated(tmp_path: Path) -> None:
    """Turn 1 (40 prompt tokens, 30 generated) leaves 69 tokens of KV: blocks 0-3 full. Turn
    2 sent the answer back (keys 3 and 4 hold it): 64 of its tokens are cached, as live.
    Without the answer's tokens the replayed engine would have cached blocks nobody asks for
    and turn 2 would find 32."""
    path = tmp_path / "r.jsonl"
    write_log(
        path,
        [([1, 2], 40, "w-a"), ([1, 2, 3, 4, 5], 90, "w-a")],
        sessions=["s", "s"],
        output=30,
    )
    log = read_log([str(path)])
    first, second = log.arrivals()
    assert first.tokens == second.tokens[: 40 * 4] and first.output == second.tokens[160:280]
    assert second.output is None  # no turn sent its answer back
    # 20 s apart (the log's are 2 ms: turn 1 would still be decoding)
    res = run_sim(log.arrivals(0.05), ClusterConfig(names=["w-a"], policy="round_robin"))
    cached = dict(zip(res.table.index, res.table.cached_tokens, strict=True))
    assert cached == {0: 0, 1: 64}
    # a scripted reply (the engine did not write it): the engine's own tokens, 32 cached
    own = run_sim(log.arrivals(0.05, answers="scripted"), ClusterConfig(names=["w-a"]))
    assert list(own.table.cached_tokens) == [0, 32]
    with pytest.raises(ValueError, match="answers must be one of"):
        next(log.arrivals(answers="made-up"))  # type: ignore[arg-type]
    # --warmup 10: turn 1 (at 0 s) is served, not counted
    window = simulate.measured_from(res, 10.0)
    assert list(window.table.index) == [1] and window.summary["requests"] == 1
    assert window.summary["hit_rate"] == round(64 / 90, 4)
    out = tmp_path / "window.json"
    args = sim_args("--from-log", str(path), "--rate", "0.05", "--policy", "round_robin",
                    "--warmup", "10", "--bound", "--out", str(out))  # fmt: skip
    assert simulate.run(args) == 0
    report = json.loads(out.read_text())
    assert report["results"][0]["summary"]["requests"] == 1
    assert report["bound"]["summary"]["requests"] == 1


def test_draws_rerun_a_policy_with_the_next_seeds_random_streams(tmp_path: Path) -> None:
    """--draws 3: draw 0 is the --seed run, draw d the run with --seed + d (same requests);
    the table shows the means."""
    path = tmp_path / "r.jsonl"
    write_log(path, [([7, 10 + i % 4], 40, ("w-a", "w-b")[i % 2]) for i in range(40)])

    def report(*extra: str) -> dict[str, Any]:
        out = tmp_path / "out.json"
        args = sim_args("--from-log", str(path), "--policy", "random", "--rate", "2",
                        "--out", str(out), *extra)  # fmt: skip
        assert simulate.run(args) == 0
        entry: dict[str, Any] = json.loads(out.read_text())["results"][0]
        return entry

    drawn = report("--seed", "5", "--draws", "3")
    over = drawn["over_draws"]
    assert over["draws"] == 3 and len(over["per_draw"]) == 3
    for d in range(3):
        alone = report("--seed", str(5 + d))["summary"]
        assert over["per_draw"][d] == {k: alone[k] for k in over["per_draw"][d]}
    spread = [x["max_mean_requests"] for x in over["per_draw"]]
    assert len(set(spread)) > 1  # random placements: the draws differ
    assert over["max_mean_requests"]["mean"] == round(sum(spread) / 3, 4)
    assert (over["max_mean_requests"]["min"], over["max_mean_requests"]["max"]) == (
        min(spread),
        max(spread),
    )
    assert drawn["summary"]["max_mean_requests"] == spread[0]
    with pytest.raises(SystemExit, match="--draws must be at least 1"):
        report("--draws", "0")


def test_bad_lines_name_file_and_line_and_a_truncated_tail_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_log(path, [([1, 2], 40, "w-a"), ([1, 3], 40, "w-b")])
    good = path.read_text()
    path.write_text(good + good.splitlines()[0][:37])  # the writer died mid-line
    log = read_log([str(path)])
    assert len(log) == 2 and log.stats.truncated == 1
    lines = good.splitlines()
    path.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.raises(LogFormatError, match=r"r\.jsonl:2: not a request log record"):
        read_log([str(path)])
    log = read_log([str(path)], skip_bad=True)
    assert len(log) == 2 and log.stats.bad == 1 and log.stats.bad_lines == [f"{path}:2"]
    bad = json.loads(lines[0]) | {"keys": ["00"]}
    path.write_text(json.dumps(bad) + "\n" + lines[1] + "\n")
    with pytest.raises(LogFormatError, match=r":1: .*16 hex digits"):
        read_log([str(path)])
    with pytest.raises(LogFormatError, match="no such request log"):
        read_log([str(tmp_path / "none*.jsonl")])


def test_several_pools_need_a_choice(tmp_path: Path) -> None:
    write_log(tmp_path / "a.jsonl", [([1], 20, "w-a")], pool="p1")
    write_log(tmp_path / "b.jsonl", [([1], 20, "w-a"), ([2], 20, "w-b")], pool="p2")
    with pytest.raises(LogFormatError, match=r"several pools.*p1 \(1\), p2 \(2\)"):
        read_log([str(tmp_path / "*.jsonl")])
    log = read_log([str(tmp_path / "*.jsonl")], pool="p2")
    assert len(log) == 2 and log.stats.other_pools == {"p1": 1}


def test_round_robin_replays_to_the_logged_decisions(tmp_path: Path) -> None:
    """A log written as round robin decided (sorted candidates in turn) replays exactly."""
    path = tmp_path / "rr.jsonl"
    write_log(path, [([i, i + 1], 40, ("w-a", "w-b")[i % 2]) for i in range(10)])
    log = read_log([str(path)])
    res = run_sim(log.arrivals(), ClusterConfig(names=log.names, policy="round_robin"))
    assert simulated_decisions(res, len(log)) == [r.worker for r in log.rows]


def _post(url: str, path: str, body: dict[str, Any], session: str | None = None) -> Any:
    headers = {"content-type": "application/json"}
    if session is not None:
        headers["x-session-id"] = session
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _complete(url: str, prompt: str) -> dict[str, Any]:
    out: dict[str, Any] = _post(
        url, "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 4}
    )
    return out


def _logged_stack(tmp_path: Path, workers: int) -> tuple[StackConfig, Path]:
    """Sim workers under the seeded ``prefix`` policy, the gateway writing its request log."""
    log_path = tmp_path / "requests.jsonl"
    cfg = StackConfig(
        workers=workers,
        speedup=20,
        policy="prefix",
        pool_settings={"seed": 7},
        gateway_settings={"request_log": {"path": str(log_path)}},
        log_dir=tmp_path / "stack",
    )
    return cfg, log_path


def test_a_log_captured_live_replays_to_the_same_decisions_and_compares_policies(
    tmp_path: Path,
) -> None:
    cfg, log_path = _logged_stack(tmp_path, 3)
    rng = random.Random(3)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(4)]
    sent = 24
    with Stack(cfg) as stack:
        url = stack.gateway_urls[0]
        for i in range(sent):
            suffix = " ".join(rng.choice(WORDS) for _ in range(15))
            _complete(url, f"{prefixes[rng.randrange(4)]} question {i}: {suffix}")
        assert wait_for(lambda: len(log_path.read_text().splitlines()) >= sent, 10.0) is not None
    log = read_log([str(log_path)])
    assert len(log) == sent and log.names == ["worker-0", "worker-1", "worker-2"]
    assert log.policies == {"prefix": sent}
    assert all(r.output_tokens == 4 for r in log.rows)
    live = [r.worker for r in log.rows]
    assert len(set(live)) > 1  # the groups spread over workers (a trivial log proves nothing)
    reasons = [json.loads(x)["reason"] for x in log_path.read_text().splitlines()]
    assert reasons.count("cache") >= sent - 4  # all but each group's first hit the index

    res = run_sim(log.arrivals(), ClusterConfig(names=log.names, policy="prefix", seed=7))
    assert simulated_decisions(res, len(log)) == live

    out = tmp_path / "report.json"
    args = sim_args("--from-log", str(log_path), "--compare", "prefix,round_robin",
                    "--seed", "7", "--out", str(out), "--plot", str(tmp_path / "plots"))  # fmt: skip
    assert simulate.run(args) == 0
    report = json.loads(out.read_text())
    assert report["workload"]["kind"] == "request_log"
    by = {r["policy"]: r for r in report["results"]}
    assert by["prefix"]["same_worker_as_live"]["rate"] == 1.0
    assert by["round_robin"]["same_worker_as_live"]["rate"] < 1.0
    assert by["prefix"]["summary"]["hit_rate"] > by["round_robin"]["summary"]["hit_rate"]
    assert (tmp_path / "plots" / "ttft_cdf.png").exists()


def _chat(url: str, session: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "sim-model", "messages": messages, "max_tokens": 40}
    out: dict[str, Any] = _post(url, "/v1/chat/completions", body, session)
    return out


def test_a_chat_captured_live_replays_with_the_cache_hits_of_its_answers(tmp_path: Path) -> None:
    """Multi-turn chats, each turn sending the previous answer back: live, the engine
    reuses the blocks it wrote while decoding that answer. The replay (same policy, seed and
    engine speed) must find the same cached tokens for every request, answers included."""
    cfg, log_path = _logged_stack(tmp_path, 2)
    rng = random.Random(5)
    systems = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(2)]
    chats = {f"c{i}": [{"role": "system", "content": systems[i % 2]}] for i in range(4)}
    with Stack(cfg) as stack:
        url = stack.gateway_urls[0]
        for _ in range(3):
            for session, messages in chats.items():
                text = " ".join(rng.choice(WORDS) for _ in range(25))
                messages.append({"role": "user", "content": text})
                answer = _chat(url, session, messages)["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": answer})
        assert wait_for(lambda: len(log_path.read_text().splitlines()) >= 12, 10.0) is not None
    log = read_log([str(log_path)])
    assert len(log) == 12 and len({r.worker for r in log.rows}) == 2
    assert successors(log.rows) == [*range(4, 12), *[-1] * 4]  # each turn's next turn
    live = sorted((json.loads(x) for x in log_path.read_text().splitlines()), key=lambda x: x["t"])
    # live, turns reused their previous answer: more cached than the previous prompt's blocks
    for r, nxt in zip(live[:8], live[4:], strict=True):
        assert nxt["cached_tokens"] >= r["prompt_tokens"] + 16

    res = run_sim(log.arrivals(), ClusterConfig(names=log.names, policy="prefix", seed=7,
                                                speedup=20))  # fmt: skip
    assert simulated_decisions(res, len(log)) == [r.worker for r in log.rows]
    cached = dict(zip(res.table.index, res.table.cached_tokens, strict=True))
    assert [cached[i] for i in range(len(log))] == [x["cached_tokens"] for x in live]


def test_the_gateway_keeps_serving_when_the_log_cannot_be_written(tmp_path: Path) -> None:
    """/dev/full: the file opens, every write fails (a full disk). Requests still succeed
    and the drops are counted."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    cfg = StackConfig(
        workers=2,
        speedup=20,
        gateway_settings={"request_log": {"path": "/dev/full"}},
        log_dir=tmp_path,
    )
    with Stack(cfg) as stack:
        url = stack.gateway_urls[0]
        for i in range(5):
            out = _complete(url, f"hello {i} " + " ".join(WORDS))
            assert out["choices"]

        def dropped() -> bool:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
                text = resp.read().decode()
            return any(
                line.startswith('kvroute_request_log_dropped_total{cause="write_error"}')
                and float(line.split()[-1]) >= 1
                for line in text.splitlines()
            )

        assert wait_for(dropped, 10.0) is not None
        assert _complete(url, "still serving")["choices"]
