"""The peer routers of ``loadtest.peers`` (bench extra, installed by scripts/setup) against
simulated vLLM workers: each launches, becomes ready by its own readiness signal and serves
chats and completions; vllm-router ``kv_aware`` routes by the engines' KV events (a prefix
cached on a worker draws its repeats there); a missing package names the bench extra."""

from __future__ import annotations

import importlib.metadata
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.tokenization import bundled_test_tokenizer
from loadtest import peers
from loadtest.harness import ChildProcess, free_port
from loadtest.peers import (
    PEERS,
    SMG_TUNING,
    PeerNotInstalled,
    Pool,
    SmgPeer,
    VllmRouterPeer,
    launch,
    peer_spec,
)

MODEL = "sim-model"
WORKERS = 3


@dataclass
class Sim:
    proc: ChildProcess
    admin: str
    pool: Pool
    log_dir: Path

    def states(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.admin + "/sim/workers", timeout=5) as r:
            return list(json.loads(r.read()))

    def finished(self) -> list[int]:
        return [int(w["stats"]["finished"]) for w in self.states()]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """One simulator process with 3 vLLM workers (own process: the routers' readiness
    checks block, and the workers must keep answering meanwhile)."""
    log_dir = tmp_path_factory.mktemp("peers")
    admin = free_port()
    proc = ChildProcess.kvroute(
        ["sim", "--workers", str(WORKERS), "--base-port", "0", "--admin-port", str(admin),
         "--model", MODEL, "--speedup", "50"],
        "sim", log_dir,
    ).start()  # fmt: skip
    try:
        proc.wait_for_log("sim ready", timeout=60)
        admin_url = f"http://127.0.0.1:{admin}"
        with urllib.request.urlopen(admin_url + "/sim/workers", timeout=5) as r:
            states = json.loads(r.read())
        pool = Pool(
            [w["http_url"] for w in states],
            MODEL,
            str(bundled_test_tokenizer()),
            16,
            [(w["events_endpoint"], w["replay_endpoint"]) for w in states],
        )
        yield Sim(proc, admin_url, pool, log_dir)
    finally:
        proc.stop()


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read()


def stream_chat(url: str, messages: list[dict[str, str]], max_tokens: int = 4) -> str:
    """A streamed chat through ``url``; the text of its deltas (ends with [DONE])."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    status, raw = post(url + "/v1/chat/completions", body)
    assert status == 200
    events = [e[5:].strip() for e in raw.decode().split("\n\n") if e.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


SERVED = [
    "smg-cache_aware",
    "smg-round_robin",
    "vllm-router-kv_aware",
    "vllm-router-round_robin",
    "sglang-router-cache_aware-historical",
]


@pytest.mark.parametrize("system", SERVED)
def test_peer_becomes_ready_and_serves(system: str, sim: Sim) -> None:
    before = sum(sim.finished())
    with launch(system, sim.pool, sim.log_dir) as peer:
        assert peer.ready()  # its own readiness signal: every worker known
        assert stream_chat(peer.url, [{"role": "user", "content": f"Hi from {system}"}]) == (
            " the" * 4
        )
        status, raw = post(
            peer.url + "/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 3}
        )
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == " the" * 3
    assert not peer.alive()
    assert sum(sim.finished()) == before + 2  # both went to the sim workers


@pytest.mark.parametrize("system", [s for s in SMG_TUNING if s != "smg-cache_aware"])
def test_every_smg_setting_tried_for_its_best_starts(system: str, sim: Sim) -> None:
    """The settings ``--tune-smg`` tries are valid command lines for smg 1.13."""
    with launch(system, sim.pool, sim.log_dir) as peer:
        assert stream_chat(peer.url, [{"role": "user", "content": "hello"}], 2) == " the" * 2


def test_vllm_router_kv_aware_sends_a_prefix_to_the_worker_that_caches_it(sim: Sim) -> None:
    """Worker i is given prefix i directly (not through the router); once the router has
    that worker's KV events, every request with prefix i goes to worker i, and the router
    credits the cached prefix tokens. A load-only or round-robin router would not."""
    peer = launch(
        "vllm-router-kv_aware", sim.pool, sim.log_dir, extra_args=["--log-level", "debug"]
    )
    with peer:
        prefixes = [f"Context {i}: " + " ".join(f"fact{i}-{k}" for k in range(300))
                    for i in range(WORKERS)]  # fmt: skip
        for i, prefix in enumerate(prefixes):
            url = sim.pool.worker_urls[i]
            post(url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                 "messages": [{"role": "system", "content": prefix},
                              {"role": "user", "content": "warm up"}]})  # fmt: skip
        # the router must have seen every worker's events up to its last batch
        last = [int(w["next_seq"]) - 1 for w in sim.states()]
        deadline = time.monotonic() + 20
        while not all(_seen_seq(peer.proc, u) >= s for u, s in zip(sim.pool.worker_urls, last,
                                                                   strict=True)):  # fmt: skip
            assert time.monotonic() < deadline, peer.tail()
            time.sleep(0.05)
        for round_ in range(2):
            for i, prefix in enumerate(prefixes):
                before = sim.finished()
                msgs = [{"role": "system", "content": prefix},
                        {"role": "user", "content": f"question {round_}"}]  # fmt: skip
                stream_chat(peer.url, msgs, 2)
                after = sim.finished()
                served = [b - a for a, b in zip(before, after, strict=True)]
                assert served == [int(k == i) for k in range(WORKERS)], (i, served)
        decisions = _decisions(peer.proc)
        assert len(decisions) >= 2 * WORKERS
        assert all(credited > 500 for _, credited in decisions[-2 * WORKERS :]), decisions


def _log(proc: ChildProcess) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.log_path.read_text(errors="replace"))


def _seen_seq(proc: ChildProcess, worker_url: str) -> int:
    pat = re.compile(
        rf"(?:live|replay) sequence advanced source={re.escape(worker_url)} rank=0 seq=(\d+)"
    )
    return max((int(m) for m in pat.findall(_log(proc))), default=-1)


def _decisions(proc: ChildProcess) -> list[tuple[str, int]]:
    pat = re.compile(r'KV prefix decision .*worker="([^"]+)".*credited_prefix_tokens=(\d+)')
    return [(w, int(c)) for w, c in pat.findall(_log(proc))]


def test_command_lines(tmp_path: Path) -> None:
    pool = Pool(["http://127.0.0.1:1", "http://127.0.0.1:2"], MODEL, "/t/tokenizer.json", 16,
                [("tcp://127.0.0.1:11", "tcp://127.0.0.1:21"),
                 ("tcp://127.0.0.1:12", None)])  # fmt: skip
    smg = launch("smg-cache_aware", pool, tmp_path)
    assert isinstance(smg, SmgPeer)
    a = smg.args
    assert a[1:4] == ["-m", "smg", "launch"]  # not the `smg` script sglang-router also installs
    for flag, value in (("--host", "127.0.0.1"), ("--prometheus-host", "127.0.0.1"),
                        ("--policy", "cache_aware"), ("--tokenizer-path", "/t/tokenizer.json"),
                        ("--shutdown-grace-period-secs", "2"),
                        ("--worker-startup-check-interval", "1"), ("--log-level", "warn")):  # fmt: skip
        assert a[a.index(flag) + 1] == value
    assert {"--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1"} <= set(a)
    assert smg.port != smg.metrics_port
    assert "--tokenizer-path" not in launch("smg-cache_aware-notok", pool, tmp_path).args
    a = launch("smg-cache_aware-affinity", pool, tmp_path).args
    assert a[a.index("--cache-threshold") + 1] == "0.1"

    vr = launch("vllm-router-kv_aware", pool, tmp_path, extra_args=["--router-temperature", "0"])
    assert isinstance(vr, VllmRouterPeer)
    a = vr.args
    assert a[a.index("--policy") + 1] == "kv_aware" and a[-2:] == ["--router-temperature", "0"]
    pairs = [a[i + 1] for i, x in enumerate(a) if x == "--kv-event-source"]
    assert pairs == [
        "http://127.0.0.1:1=tcp://127.0.0.1:11",
        "http://127.0.0.1:2=tcp://127.0.0.1:12",
    ]
    assert [a[i + 1] for i, x in enumerate(a) if x == "--kv-event-replay-source"] == [
        "http://127.0.0.1:1=tcp://127.0.0.1:21"
    ]
    for flag, value in (("--kv-event-block-size", "16"), ("--kv-event-model", MODEL),
                        ("--worker-startup-check-interval", "1"), ("--log-level", "warning")):  # fmt: skip
        assert a[a.index(flag) + 1] == value
    assert "--kv-event-source" not in launch("vllm-router-round_robin", pool, tmp_path).args
    with pytest.raises(ValueError, match="unknown peer"):
        peer_spec("smg-nonsense")
    assert PEERS["sglang-router-cache_aware-historical"].historical
    assert "42-45 ms" in PEERS["sglang-router-cache_aware-historical"].note


def test_a_missing_or_old_peer_names_the_bench_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = Pool(["http://127.0.0.1:1"], MODEL, "", 16)
    real = importlib.metadata.version

    def missing(name: str) -> str:
        if name == "smg":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(peers.importlib.metadata, "version", missing)
    with pytest.raises(PeerNotInstalled, match=r"smg package is not installed.*kvroute\[bench\]"):
        launch("smg-cache_aware", pool, tmp_path)
    monkeypatch.setattr(peers.importlib.metadata, "version", lambda name: "0.1.9")
    with pytest.raises(PeerNotInstalled, match=r"0\.1\.9 is installed, 0\.1\.17 or newer"):
        launch("vllm-router-kv_aware", pool, tmp_path)
