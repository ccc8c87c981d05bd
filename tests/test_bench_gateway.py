"""``kvroute bench gateway`` (P5, P6): the helpers on their own, and the whole benchmark at a
seconds-long size through the same dispatcher as the command line, so it cannot rot. The
figures are checked for shape and sanity, not against the targets (this machine is shared)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from loadtest import benchmarks
from loadtest.benchmarks import _stall
from loadtest.benchmarks import gateway as gw
from loadtest.harness import HarnessError

pytestmark = pytest.mark.timeout(180)


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _args(**over: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gw.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    return args


# -- helpers -------------------------------------------------------------------------------------


def test_pct_interpolates() -> None:
    xs = [float(i) for i in range(101)]
    random.Random(0).shuffle(xs)
    assert gw._pct(xs, 0.5) == 50.0
    assert gw._pct(xs, 0.99) == pytest.approx(99.0)
    assert gw._pct([1.0, 2.0], 0.5) == 1.5
    assert math.isnan(gw._pct([], 0.5))


def test_p5_checks_against_smg() -> None:
    smg = {"added_p50_ms": 0.8, "added_p99_ms": 2.0}
    assert gw._p5_checks({"added_p50_ms": 0.7, "added_p99_ms": 3.9}, smg) == {
        "p50_le_1ms": True,
        "p50_le_smg": True,
        "p99_le_2x_smg": True,
    }
    assert gw._p5_checks({"added_p50_ms": 0.9, "added_p99_ms": 4.1}, smg) == {
        "p50_le_1ms": True,
        "p50_le_smg": False,
        "p99_le_2x_smg": False,
    }
    # smg missing: only the checks that need it fail
    assert gw._p5_checks({"added_p50_ms": 0.5, "added_p99_ms": 1.0}, None) == {
        "p50_le_1ms": True,
        "p50_le_smg": False,
        "p99_le_2x_smg": False,
    }
    assert not any(gw._p5_checks({}, smg).values())


def test_twins_have_one_shape_and_different_words() -> None:
    args = _args(conversations=5, user_tokens=20, direct_every=2)
    twins, solos = gw._make_conversations(args, ["http://w0", "http://w1"], "s", 1000)
    assert len(twins) == 3 and len(solos) == 2  # one in --direct-every has a direct twin
    assert all(p.direct is None for p in solos)
    assert [p.fixed_worker for p in twins] == ["http://w0", "http://w1", "http://w0"]
    for p in twins:
        a, b = p.routed.messages, p.direct.messages if p.direct else []
        assert [m["role"] for m in a] == [m["role"] for m in b] == ["system", "user"]
        assert [len(m["content"].split()) for m in a] == [len(m["content"].split()) for m in b]
        assert a[0]["content"] != b[0]["content"] and a[1]["content"] != b[1]["content"]
        assert 800 <= len(a[0]["content"].split()) <= 1000
    # a shared head, then each conversation its own history
    convs = [c for p in twins + solos for c in (p.routed, p.direct) if c is not None]
    assert len({" ".join(c.messages[0]["content"].split()[:200]) for c in convs}) == 1
    assert len({c.messages[0]["content"] for c in convs}) == len(convs) == 8
    # every conversation a twin with --direct-every 1
    twins, solos = gw._make_conversations(_args(conversations=4, direct_every=1), ["w"], "s", 99)
    assert len(twins) == 4 and not solos
    # a new turn: the reply and a new user message appended, nothing resent as is
    conv = convs[0]
    before = [dict(m) for m in conv.messages]
    gw._next_turn(conv, " the the", args.user_tokens)
    assert conv.messages[:2] == before
    assert conv.messages[2] == {"role": "assistant", "content": " the the"}
    assert conv.messages[3]["role"] == "user" and len(conv.messages[3]["content"].split()) == 20
    body = json.loads(gw._body("m", conv, 8))
    assert body["stream"] is True and body["model"] == "m" and body["messages"] == conv.messages


def test_completion_mode_sends_one_shared_prefix_and_a_new_question_each_time() -> None:
    """--mode completion: Q3's requests. Every conversation (twins too) has the same
    prefix; a turn replaces the question, so the prompt stays the same length; the body is a
    /v1/completions body."""
    args = _args(mode="completion", conversations=4, direct_every=2, prompt_tokens=300,
                 user_tokens=20)  # fmt: skip
    twins, solos = gw._make_conversations(args, ["http://w0"], "s", 99)
    convs = [c for p in twins + solos for c in (p.routed, p.direct) if c is not None]
    assert len(convs) == 6 and len({c.prefix for c in convs}) == 1
    prefix = convs[0].prefix
    assert prefix is not None and len(prefix.split()) == 300
    assert len({c.messages[-1]["content"] for c in convs}) == 6  # each its own question
    conv = convs[0]
    first = json.loads(gw._body("m", conv, 8))
    gw._next_turn(conv, " the the", args.user_tokens)
    second = json.loads(gw._body("m", conv, 8))
    assert "messages" not in first and first["stream"] is True and first["model"] == "m"
    for body in (first, second):
        assert body["prompt"].startswith(prefix) and len(body["prompt"].split()) == 320
    assert first["prompt"] != second["prompt"] and len(conv.messages) == 1


def test_cold_mode_sends_a_new_text_of_the_whole_size_every_time() -> None:
    """--mode cold: Q5's cold path. No prefix is shared, by twins or by turns: every request
    is a fresh --prompt-tokens-word text, so neither the gateway nor the engine has seen any
    of it."""
    args = _args(mode="cold", conversations=4, direct_every=2, prompt_tokens=300,
                 user_tokens=20)  # fmt: skip
    twins, solos = gw._make_conversations(args, ["http://w0"], "s", 99)
    convs = [c for p in twins + solos for c in (p.routed, p.direct) if c is not None]
    assert len(convs) == 6 and {c.prefix for c in convs} == {""}
    prompts = [json.loads(gw._body("m", c, 8))["prompt"] for c in convs]
    conv = convs[0]
    gw._next_turn(conv, " the the", args.user_tokens)
    prompts.append(json.loads(gw._body("m", conv, 8))["prompt"])
    assert all(len(p.split()) == 300 for p in prompts)
    heads = {" ".join(p.split()[:8]) for p in prompts}
    assert len(heads) == len(prompts)  # no two share even their first words


def test_chats_grow_through_the_prompt_size() -> None:
    args = _args()  # the full size: 100 req/s, 48 conversations, 21 s per phase
    runner = gw.P5Runner(args, ["http://w"], "m", session=None)  # type: ignore[arg-type]
    turns = args.rate * (args.duration + args.warmup) / args.conversations
    end = runner.start_words + turns * (args.user_tokens + args.max_tokens + 8)
    assert 0.8 * args.prompt_tokens < runner.start_words < args.prompt_tokens < end
    assert end < 1.2 * args.prompt_tokens


def test_missing_and_failing_peers_are_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    class FakeProc:
        pid = 4242

    class FakeStack:
        def __init__(self) -> None:
            self.gateway_urls = ["http://gw"]
            self.gateways = [FakeProc()]
            self.log_dir = tmp_path

        def gateway_pids(self, g: int) -> list[int]:
            return [4242]

        def add_process(self, proc: Any) -> Any:
            return proc

    class DeadPeer:
        proc = FakeProc()
        url = "http://peer"

        def wait_ready(self) -> float:
            raise HarnessError("exited")

        def stop(self) -> None:
            pass

    def fake_launch(name: str, pool: Any, log_dir: Any) -> Any:
        if name == gw.SMG:
            raise gw.PeerNotInstalled("smg: the smg package is not installed")
        return DeadPeer()

    monkeypatch.setattr(gw, "pool_from_stack", lambda stack: None)
    monkeypatch.setattr(gw, "launch", fake_launch)
    routers, missing, failed = gw._start_routers(
        FakeStack(),  # type: ignore[arg-type]
        [gw.KVROUTE, gw.SMG, gw.VLLM_ROUTER],
    )
    assert list(routers) == [gw.KVROUTE] and routers[gw.KVROUTE].pid == 4242
    assert set(missing) == {gw.SMG} and "not installed" in missing[gw.SMG]
    assert set(failed) == {gw.VLLM_ROUTER} and "exited" in failed[gw.VLLM_ROUTER]


def test_unknown_system_is_refused() -> None:
    with pytest.raises(SystemExit):
        gw._systems(_args(systems="kvroute,nope"))


# -- the benchmark at a seconds-long size --------------------------------------------------------


def test_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    systems = [gw.KVROUTE, gw.SMG, gw.VLLM_ROUTER]
    parser = argparse.ArgumentParser()
    benchmarks.add_arguments(parser)
    args = parser.parse_args(
        [
            "gateway", "--json", "--duration", "3", "--rate", "20", "--warmup", "0.5",
            "--rounds", "1", "--conversations", "8", "--throughput-seconds", "1",
            "--concurrency", "4", "--tokenize-repeats", "0", "--systems", ",".join(systems),
            "--stall-seconds", "0",
        ]
    )  # fmt: skip
    code = benchmarks.run(args)
    r: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert isinstance(r["ok"], bool) and code == (0 if r["ok"] else 1)
    assert r["ok"] == (r["sane"] and all(r["targets"].values()))
    assert set(r["targets"]) == {"p50_le_1ms", "p50_le_smg", "p99_le_2x_smg"}
    assert r["config"]["rate"] == 20 and r["config"]["prompt_tokens"] == 8000

    # every system either measured or named as missing
    assert set(r["systems"]) | set(r["missing"]) | set(r["failed"]) == set(systems)
    assert gw.KVROUTE in r["systems"]
    for pkg, name in (("smg", gw.SMG), ("vllm-router", gw.VLLM_ROUTER)):
        if _installed(pkg):
            assert name in r["systems"], r["failed"]
        else:
            assert name in r["missing"]
            assert r["systems"].get(name) is None
    if gw.SMG not in r["systems"]:
        assert r["targets"]["p50_le_smg"] is False and "smg" in r["targets_note"]

    for name, s in r["systems"].items():
        assert s["errors"] == 0, s["error_examples"]
        assert s["pairs"] >= 15, s  # ~30 twin arrivals in 3 s (10/s), after the warm-up
        # one arrival in 2 a twin pair (routed + direct), the others routed alone
        assert s["routed_requests"] == s["slots"] - s["slots_skipped"]
        assert 0.3 * s["routed_requests"] < s["direct_requests"] < 0.7 * s["routed_requests"]
        assert s["routed_alone_ttft_p50_ms"] > 0
        for key in ("added_p50_ms", "added_p99_ms", "added_dist_p50_ms", "added_dist_p99_ms"):
            assert isinstance(s[key], float) and math.isfinite(s[key]), (name, key, s[key])
        assert 0 < s["direct_ttft_p50_ms"] <= s["direct_ttft_p99_ms"]
        assert 0 < s["routed_ttft_p50_ms"] <= s["routed_ttft_p99_ms"]
        assert s["added_p50_ms"] <= s["added_p99_ms"]
        # new turns of ~8,000-token chats, each with its own previous turn cached
        assert 7000 < s["prompt_tokens_mean"] < 9000
        assert s["prompt_tokens_max"] > s["prompt_tokens_min"]
        assert s["cached_fraction_routed"] > 0.9 and s["cached_fraction_direct"] > 0.9
        assert s["in_flight_max"] >= 2  # routed and direct overlap
        assert s["requests_per_cpu_s"] > 0 and s["router_cpu_s"] > 0
        assert set(s["checks"]) == set(r["targets"]) and s["ok"] == all(s["checks"].values())
        assert s["direct_to"].startswith("the one worker")
    kv = r["systems"][gw.KVROUTE]
    assert r["added_latency_p50_ms"] == kv["added_p50_ms"]
    assert r["targets"] == kv["checks"]
    # kvroute's own counters: its KV events read, and its new turns routed on their
    # conversation's known ids (all but each conversation's first turn)
    # (a blocking read that times out while the workers are idle returns nothing, so the
    # mean can dip below one entry per read with nothing wrong: 0.994 in one CI run; the
    # pacing that batches entries is tested in tests/test_consumer.py)
    assert kv["event_reads_per_request"] > 0 and kv["entries_per_event_read"] > 0
    assert kv["overlapped_fraction"] > 0.5

    p6 = r["p6"]
    assert set(p6["runs"]) == {*r["systems"], "direct"}
    for name, run in p6["runs"].items():
        assert run["rps"] > 0 and run["errors"] == 0, (name, run)
        if name != "direct":
            assert run["rps_per_cpu_s"] > 0
    assert isinstance(p6["ok"], bool)

    rows = {row["system"]: row for row in r["table"]}
    assert set(rows) == set(systems)


def run_kvroute(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """``bench gateway`` through kvroute alone at a smoke size (one round, four
    conversations, 10 req/s, P6 and the side phases off) plus ``argv``; its JSON."""
    parser = argparse.ArgumentParser()
    benchmarks.add_arguments(parser)
    args = parser.parse_args(
        [
            "gateway", "--json", "--rate", "10", "--warmup", "0.3", "--rounds", "1",
            "--conversations", "4", "--throughput-seconds", "0", "--tokenize-repeats", "0",
            "--systems", gw.KVROUTE, "--stall-seconds", "0", *argv,
        ]
    )  # fmt: skip
    benchmarks.run(args)
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_smoke_completion_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """--mode completion through kvroute: twin pairs on /v1/completions, every request a
    new question after the shared prefix, which the engine has cached for both twins."""
    r = run_kvroute(
        capsys, "--mode", "completion", "--prompt-tokens", "2000", "--user-tokens", "50",
        "--duration", "2",
    )  # fmt: skip
    assert r["config"]["mode"] == "completion"
    assert "P5's bounds applied to completions" in r["targets_note"]
    s = r["systems"][gw.KVROUTE]
    assert s["errors"] == 0 and s["pairs"] >= 5, s
    # the 2,000-word prefix and a 50-word question: the same size every time
    assert 2000 < s["prompt_tokens_min"] <= s["prompt_tokens_max"] < 2100
    assert s["cached_fraction_routed"] > 0.9 and s["cached_fraction_direct"] > 0.9
    assert math.isfinite(s["added_p50_ms"])


@pytest.mark.parametrize("overlap", [True, False])
def test_smoke_cold_mode_with_a_pool_setting(
    capsys: pytest.CaptureFixture[str], overlap: bool
) -> None:
    """--mode cold through kvroute: every request a new text, nothing cached by the engine;
    ``--pool-set`` reaches the gateway's pool: with ``tokenize_overlap_cold`` on, the cold
    prompts are routed on their first piece (overlapped), with it off none is."""
    r = run_kvroute(
        capsys, "--mode", "cold", "--prompt-tokens", "1500", "--duration", "1.5",
        "--pool-set", f"tokenize_overlap_cold={str(overlap).lower()}",
    )  # fmt: skip
    assert r["config"]["mode"] == "cold"
    assert r["config"]["pool_set"] == [f"tokenize_overlap_cold={str(overlap).lower()}"]
    s = r["systems"][gw.KVROUTE]
    assert s["errors"] == 0 and s["pairs"] >= 4, s
    assert s["prompt_tokens_min"] == s["prompt_tokens_max"] == 1500
    assert s["cached_fraction_routed"] == 0 and s["cached_fraction_direct"] == 0
    assert s["prepare_mean_ms"] > 0, s  # every request's preparation on the loop, read back
    if overlap:  # and each one's hold for its exact ids observed
        assert s["overlapped_fraction"] > 0.9, s
        assert 0 <= s["overlap_held_fraction"] <= 1 and s["overlap_wait_mean_ms"] >= 0, s
    else:
        assert s["overlapped_fraction"] == 0, s
        assert s["overlap_held_fraction"] is None and s["overlap_wait_mean_ms"] is None, s


def test_smoke_cold_mode_under_a_shared_head(capsys: pytest.CaptureFixture[str]) -> None:
    """--mode cold --shared-words: new texts after one head every request shares, as a
    production trace's prompts. The head's blocks are on the worker after the first request,
    so the gateway encodes pieces past them until the index's match stops, and routes the
    prompt on those ids while the rest is encoded: nearly every request is overlapped."""
    r = run_kvroute(
        capsys, "--mode", "cold", "--prompt-tokens", "1500", "--shared-words", "400",
        "--duration", "1.5",
    )  # fmt: skip
    assert r["config"]["shared_words"] == 400
    s = r["systems"][gw.KVROUTE]
    assert s["errors"] == 0 and s["pairs"] >= 4, s
    assert s["prompt_tokens_min"] == s["prompt_tokens_max"] == 1900
    # the shared head is cached by the engine, a small part of each prompt
    assert 0.1 < s["cached_fraction_routed"] < 0.3, s
    assert s["overlapped_fraction"] > 0.8, s


@pytest.mark.parametrize("overlap", [True, False])
def test_smoke_rag_mode(capsys: pytest.CaptureFixture[str], overlap: bool) -> None:
    """--mode rag: every request a new chat under one system prompt, its message a new
    document. The system prompt is on the worker after the first request, so the gateway
    renders each chat, encodes pieces of the document until the index's match stops, and
    routes on those ids while the rest is encoded: nearly every request is overlapped. With
    ``tokenize_overlap_chats`` off (and in the code before) none is."""
    r = run_kvroute(
        capsys, "--mode", "rag", "--prompt-tokens", "1500", "--shared-words", "400",
        "--duration", "1.5", "--pool-set", f"tokenize_overlap_chats={str(overlap).lower()}",
    )  # fmt: skip
    assert r["config"]["mode"] == "rag" and r["config"]["shared_words"] == 400
    assert "P5's bounds applied to new chats" in r["targets_note"]
    s = r["systems"][gw.KVROUTE]
    assert s["errors"] == 0 and s["pairs"] >= 4, s
    # the system prompt and the document, in the chat template's frame
    assert 1900 < s["prompt_tokens_min"] <= s["prompt_tokens_max"] < 1950, s
    assert 0.1 < s["cached_fraction_routed"] < 0.3, s  # the system prompt, cached
    if overlap:
        assert s["overlapped_fraction"] > 0.8, s
    else:
        assert s["overlapped_fraction"] == 0, s


def test_shared_words_are_for_cold_and_rag_modes_only() -> None:
    parser = argparse.ArgumentParser()
    benchmarks.add_arguments(parser)
    for argv in (["--shared-words", "10"], ["--mode", "cold", "--shared-words", "-1"]):
        args = parser.parse_args(["gateway", *argv])
        with pytest.raises(SystemExit, match="--shared-words"):
            benchmarks.run(args)


@pytest.mark.parametrize(
    ("pair", "error"),
    [
        ("tokenize_overlap_cold", "--pool-set: expected PARAM=VALUE"),
        ("tokenize_overlap_cld=false", "--pool-set: unknown pool setting.s. tokenize_overlap_cld"),
    ],
)
def test_a_malformed_pool_setting_is_refused_before_anything_starts(pair: str, error: str) -> None:
    parser = argparse.ArgumentParser()
    benchmarks.add_arguments(parser)
    args = parser.parse_args(["gateway", "--pool-set", pair])
    with pytest.raises(SystemExit, match=error):
        benchmarks.run(args)


def test_smoke_stall_and_gateway_processes(capsys: pytest.CaptureFixture[str]) -> None:
    """kvroute alone with two processes on its port: P6 names the requests each served, and
    the stall phases (offload on, off, quiet) measure short chats paired with direct twins
    while cold long chats arrive."""
    parser = argparse.ArgumentParser()
    benchmarks.add_arguments(parser)
    args = parser.parse_args(
        [
            "gateway", "--json", "--duration", "1", "--rate", "20", "--warmup", "0.3",
            "--rounds", "1", "--conversations", "6", "--throughput-seconds", "1.5",
            "--concurrency", "16", "--tokenize-repeats", "0", "--systems", gw.KVROUTE,
            "--gateway-processes", "2", "--stall-seconds", "1.5", "--stall-rounds", "1",
            "--stall-short-rate", "20", "--stall-long-rate", "3", "--stall-long-words", "3000",
        ]
    )  # fmt: skip
    benchmarks.run(args)
    r: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert r["config"]["gateway_processes"] == 2
    assert "2 processes" in r["systems"][gw.KVROUTE]["note"]
    run = r["p6"]["runs"][gw.KVROUTE]
    assert run["errors"] == 0 and run["rps_per_cpu_s"] > 0
    per = run["requests_per_process"]
    # the kernel spreads connections, not requests, over the port's processes: 16 client
    # connections all land on one of two processes once in 2**15 runs (8 did once in 128)
    assert len(per) == 2 and all(n > 0 for n in per.values()), per  # both took a share
    assert sum(per.values()) >= run["rps"]  # ~1.5 s of requests, every one counted once

    stall = r["stall"]
    assert set(stall["phases"]) == {"quiet", "offload", "no_offload"}
    for name, ph in stall["phases"].items():
        assert ph["errors"] == 0, (name, ph["error_examples"])
        assert ph["short_requests"] >= 10, (name, ph)
        assert (
            ph["direct_ttft_p50_ms"] > 0 and 0 < ph["short_ttft_p50_ms"] <= ph["short_ttft_p99_ms"]
        )
        assert isinstance(ph["added_p99_ms"], float)
        assert (ph["long_requests"] > 0) == (name != "quiet"), (name, ph)
    assert stall["added_p99_offload_vs_no_offload"] > 0
    new = stall["new_conversation"]
    # a new conversation under a known system prompt: a fraction of the cold chat's CPU, and
    # little more than the same kind of chat under a short prompt (re-encoding the known
    # prompt would add about the whole cold chat)
    assert new["new_conversation_cpu_ms"] < 0.5 * new["cold_chat_cpu_ms"], new
    assert 0 < new["short_system_cpu_ms"] < new["cold_chat_cpu_ms"], new
    assert new["known_prompt_extra_ms"] < 0.25 * new["cold_chat_cpu_ms"], new
    assert new["pays_only_new_text"] == (
        new["known_prompt_extra_ms"] <= _stall.KNOWN_PROMPT_SHARE * new["cold_chat_cpu_ms"]
    ), new
    rows = {row["system"] for row in r["table"]}
    assert {f"kvroute stall: {p}" for p in stall["phases"]} <= rows


def test_a_phase_runs_with_the_clients_heap_frozen_and_leaves_it_as_it_was() -> None:
    """The client's own full collections must not pause the phase it measures; after the
    phase nothing stays frozen (a cycle dropped during the phase is collected then)."""
    import gc
    import weakref

    class Node:
        def __init__(self) -> None:
            self.me = self

    before = gc.get_freeze_count()
    orphan = Node()  # alive when the phase starts (frozen), dropped during it
    gone = weakref.ref(orphan)
    with gw._client_heap_frozen():
        assert gc.get_freeze_count() > before
        del orphan
        gc.collect()
        assert gone() is not None  # frozen: the phase's collections do not walk it
    assert gc.get_freeze_count() == before
    assert gone() is None  # ... and after the phase it is collected
