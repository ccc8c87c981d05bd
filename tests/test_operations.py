"""Operations (issue 15, target R8): what a platform team meets running kvroute for real.

Live processes on loopback (Redis, simulated workers, agents, gateways) as in production:

* a seed mismatch between an agent and the gateway is refused, counted and logged;
* an agent whose Redis is down backs off instead of spinning, reports the connection
  honestly, and the index converges again once Redis is back;
* a multi-process gateway drops a departed worker's series from /metrics;
* readiness means "can answer", not "has a healthy worker";
* SIGTERM drains: streams in flight finish, new connections are refused.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from gateway.contract.fingerprint import seed_fingerprint
from gateway.contract.redis_bus import RedisBus
from gateway.contract.wire import WorkerInfo
from loadtest.harness import ChildProcess, free_port
from loadtest.stack import ADMIN_KEY, Stack, StackConfig, port_block, wait_for

MODEL = "sim-model"


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(url: str, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels`` (None: no sample)."""
    _, body = get(url + "/metrics")
    want = [f'{k}="{v}"' for k, v in labels.items()]
    found = [
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if (line.startswith(name + " ") or line.startswith(name + "{"))
        and all(w in line for w in want)
    ]
    return sum(found) if found else None


def admin(stack: Stack, path: str) -> dict[str, object]:
    status, body = get(stack.gateway_urls[0] + path, ADMIN_KEY)
    assert status == 200, body
    return dict(json.loads(body))


# -- seed mismatch ------------------------------------------------------------------------------


def test_fingerprint_reveals_nothing_but_equality() -> None:
    fp = seed_fingerprint("s3cret-seed")
    assert fp == seed_fingerprint("s3cret-seed") != seed_fingerprint("s3cret-seee")
    assert len(fp) == 16 and "s3cret" not in fp
    int(fp, 16)


def test_agent_with_another_seed_is_refused_counted_and_logged(tmp_path: Path) -> None:
    """Through Redis: the stack's agent shares the gateway's seed; a second agent on the same
    engine with another seed is refused (never routed to), with a metric and a log line that
    say why. A registration without a fingerprint (an older agent) is accepted and counted."""
    with Stack(StackConfig(workers=1, speedup=100, log_dir=tmp_path)) as stack:
        gw = stack.gateway_urls[0]
        assert metric(gw, "kvroute_worker_rejected_total", reason="seed_mismatch") is None
        intruder_port = free_port()
        args = [
            "agent", "--engine", "vllm", "--engine-url", stack.worker_urls[0],
            "--redis", stack.redis_url, "--worker-id", "intruder", "--model", MODEL,
            "--hash-seed", "another-seed", "--metrics-port", str(intruder_port),
        ]  # fmt: skip
        intruder = stack.add_process(ChildProcess.kvroute(args, "agent-intruder", stack.log_dir))

        def refused() -> bool:
            rejected = admin(stack, "/workers")["rejected_registrations"]
            return "intruder" in rejected  # type: ignore[operator]

        assert wait_for(refused, timeout=30) is not None, intruder.tail()
        why = admin(stack, "/workers")["rejected_registrations"]["intruder"]  # type: ignore[index]
        assert "hash seed differs" in why
        assert seed_fingerprint("another-seed") in why
        assert seed_fingerprint("another-seed") != seed_fingerprint(stack.config.hash_seed)
        assert metric(gw, "kvroute_worker_rejected_total", reason="seed_mismatch") == 1.0
        ids = [w["worker_id"] for w in admin(stack, "/workers")["workers"]]  # type: ignore[union-attr,index]
        assert ids == ["worker-0"]
        (line,) = [ln for ln in stack.gateways[0].log_lines() if "refusing the registration" in ln]
        assert "intruder" in line and "hash seed differs" in line
        # the refused agent keeps heartbeating: one refusal, counted once
        agent_url = f"http://127.0.0.1:{intruder_port}"

        def renewed() -> bool:
            return (metric(agent_url, "kvroute_agent_heartbeats_total", result="ok") or 0) >= 3

        assert wait_for(renewed, timeout=20) is not None
        assert metric(gw, "kvroute_worker_rejected_total", reason="seed_mismatch") == 1.0

        # an agent older than the fingerprint: accepted, shown as unverified
        assert metric(gw, "kvroute_workers_unverified_seed") == 0.0

        async def register_old() -> None:
            bus = RedisBus(stack.redis_url)
            try:
                info = WorkerInfo("old-agent", stack.worker_urls[0], MODEL)
                assert info.seed_fingerprint == ""
                await bus.register(info, ttl=60)
            finally:
                await bus.close()

        asyncio.run(register_old())

        def accepted() -> bool:
            ids = [w["worker_id"] for w in admin(stack, "/workers")["workers"]]  # type: ignore[union-attr,index]
            return "old-agent" in ids

        assert wait_for(accepted, timeout=10) is not None
        assert wait_for(lambda: metric(gw, "kvroute_workers_unverified_seed") == 1.0, 5) is not None
        assert metric(gw, "kvroute_worker_rejected_total", reason="seed_mismatch") == 1.0


# -- an agent while Redis is down ---------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def complete(url: str, prompt: str) -> int:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_agent_backs_off_while_redis_is_down_and_resyncs_after(tmp_path: Path) -> None:
    """Redis killed: the agent's CPU and its bus attempts stay small (backoff
    with jitter, not a busy loop; snapshots fall due every second here, which is what used to
    spin), its connected gauge says 0 the whole time, and after Redis comes back (empty) the
    gauge says 1 and the gateway's index equals the agent's mirror again (key digests),
    events buffered during the outage included."""
    cfg = StackConfig(
        workers=1, speedup=100, log_dir=tmp_path,
        agent_args=["--set", "publish.snapshot_interval=1"],
    )  # fmt: skip
    with Stack(cfg) as stack:
        gw, agent = stack.gateway_urls[0], f"http://127.0.0.1:{stack.agent_ports[0]}"
        pid = stack.agents[0].pid
        assert pid is not None
        for i in range(3):
            assert complete(gw, f"warm-up {i} " * 40) == 200
        assert wait_for(lambda: not stack.diverged(), 10) is not None
        assert metric(agent, "kvroute_agent_redis_connected") == 1.0

        assert stack.redis is not None
        stack.redis.kill()
        # the agent notices within a heartbeat or a publish, whichever comes first
        assert wait_for(lambda: metric(agent, "kvroute_agent_redis_connected") == 0.0, 5)

        # an idle engine: nothing to publish but heartbeats and snapshots falling due
        errors0 = metric(agent, "kvroute_agent_publish_errors_total") or 0.0
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        gauge: list[float | None] = []

        def window_over() -> bool:  # samples the gauge until the 5 s window is over
            gauge.append(metric(agent, "kvroute_agent_redis_connected"))
            return time.monotonic() - t0 >= 5.0

        assert wait_for(window_over, timeout=10, step=0.25) is not None
        cpu1, t1 = cpu_seconds(pid), time.monotonic()
        errors1 = metric(agent, "kvroute_agent_publish_errors_total") or 0.0
        window = t1 - t0
        cpu_share = (cpu1 - cpu0) / window
        error_rate = (errors1 - errors0) / window
        print(f"Redis down {window:.1f}s: agent {cpu_share:.3f} core, {error_rate:.2f} errors/s")
        assert len(gauge) >= 10 and set(gauge) == {0.0}, gauge
        assert cpu_share < 0.2, f"agent used {cpu_share:.2f} of a core while Redis was down"
        assert error_rate < 5, f"{error_rate:.1f} failed bus operations/s while Redis was down"

        for i in range(10):  # the engine keeps storing blocks: the agent buffers its events
            assert complete(gw, f"during the outage {i} " * 30) == 200
        assert wait_for(lambda: (metric(agent, "kvroute_agent_buffer_depth") or 0) > 0, 5)
        assert metric(agent, "kvroute_agent_redis_connected") == 0.0

        stack.redis.start()  # empty: no persistence
        assert wait_for(lambda: metric(agent, "kvroute_agent_redis_connected") == 1.0, 10)
        assert wait_for(lambda: not stack.diverged(), 15) is not None, stack.diverged()
        assert metric(agent, "kvroute_agent_buffer_depth") == 0.0


def test_publisher_backoff_is_capped_exponential_with_jitter() -> None:
    """Delays double from backoff_min up to backoff_max, each drawn from [d/2, d]; one
    success resets them and says connected."""
    from gateway.contract.bus import MemoryBus
    from worker_agent.metrics import AgentMetrics
    from worker_agent.publisher import Publisher, PublisherSettings

    m = AgentMetrics()
    pub = Publisher(MemoryBus(), "w", 1, dict, m, PublisherSettings(backoff_min=0.1, backoff_max=2))
    assert m.value("redis_connected") == 0  # nothing has reached the bus yet
    # each delay is bounded from both sides of the call (the clock is read inside it), so a
    # pause of this process between the readings cannot fail the check
    delays = []
    for _ in range(12):
        before = time.monotonic()
        pub.bus_failed(ConnectionError("down"))
        delays.append((pub._retry_at - time.monotonic(), pub._retry_at - before))
        assert not pub.may_use_bus() and m.value("redis_connected") == 0
    caps = [min(2.0, 0.1 * 2**i) for i in range(12)]
    for (shortest, longest), cap in zip(delays, caps, strict=True):
        assert shortest <= cap and longest >= cap / 2, (shortest, longest, cap)
    assert len({round(d, 2) for _, d in delays[6:]}) > 1, "capped delays are jittered"
    pub.bus_ok()
    assert pub.may_use_bus() and m.value("redis_connected") == 1
    pub.bus_failed(ConnectionError("down again"))
    assert pub._retry_at - time.monotonic() <= 0.1  # the backoff restarted from backoff_min


# -- a worker leaves a multi-process gateway ----------------------------------------------------

PER_WORKER = ("kvroute_worker_healthy", "kvroute_circuit_state", "kvroute_index_blocks")


def worker_series(url: str, worker: str) -> set[str]:
    """Names of the per-worker series one /metrics scrape shows for ``worker``."""
    _, body = get(url + "/metrics")
    return {
        line.split("{", 1)[0]
        for line in body.decode().splitlines()
        if not line.startswith("#") and f'worker="{worker}"' in line
    }


def test_departed_worker_series_leave_every_process(tmp_path: Path) -> None:
    """Two gateway processes on one port (multiprocess metrics): once a worker deregisters,
    no scrape (whichever process answers it) shows a series of it any more."""
    cfg = StackConfig(workers=2, speedup=100, gateway_processes=2, log_dir=tmp_path)
    with Stack(cfg) as stack:
        gw = stack.gateway_urls[0]
        assert len(set(stack.gateway_pids())) == 2
        for i in range(4):
            assert complete(gw, f"spread me {i} " * 30) == 200
        leaving = stack.worker_id(1)
        # each scrape is a new connection: the kernel spreads them over both processes
        for _ in range(8):
            assert set(PER_WORKER) <= worker_series(gw, leaving)
        stack.agents[1].stop()  # SIGTERM: the agent deregisters the worker

        def gone_everywhere() -> bool:
            # 16 scrapes in a row without it: all on one process has probability 2**-15
            return all(not worker_series(gw, leaving) for _ in range(16))

        assert wait_for(gone_everywhere, timeout=15) is not None, worker_series(gw, leaving)
        assert set(PER_WORKER) <= worker_series(gw, stack.worker_id(0))


# -- readiness ---------------------------------------------------------------------------------


def test_ready_with_every_worker_down_and_the_request_gets_the_gateways_503(
    tmp_path: Path,
) -> None:
    """With no healthy worker the gateway stays ready (in its Service) and answers requests
    with its own OpenAI-shaped 503; a gateway started while every worker is down becomes ready
    too (a cold start does not wait for the engines)."""
    with Stack(StackConfig(workers=1, speedup=100, log_dir=tmp_path)) as stack:
        gw = stack.gateway_urls[0]
        stack.fault(0, "kill")
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()

        def answered_503() -> bool:
            req = urllib.request.Request(
                gw + "/v1/completions", data=body, headers={"content-type": "application/json"}
            )
            try:
                urllib.request.urlopen(req, timeout=10).close()
            except urllib.error.HTTPError as exc:
                if exc.code == 503:
                    err = json.loads(exc.read())["error"]
                    return bool(err["code"] == "no_healthy_worker" and exc.headers["Retry-After"])
            return False

        assert wait_for(answered_503, timeout=10) is not None
        assert metric(gw, "kvroute_pool_healthy_workers") == 0.0
        # the 503s are the error SLO's numerator
        assert (metric(gw, "kvroute_responses_total", code="5xx") or 0) >= 1
        status, ready = get(gw + "/ready")
        assert status == 200, ready
        assert json.loads(ready)["detail"] == "ready (0 of 1 workers healthy)"
        # a new gateway, started with every worker down
        stack.start_gateway(1)
        assert wait_for(lambda: get(stack.gateway_urls[1] + "/ready")[0] == 200, 15) is not None
        assert wait_for(lambda: get(stack.gateway_urls[1] + "/health")[0] == 200, 1) is not None


# -- errors the engine returns count as errors ---------------------------------------------------


def test_engine_errors_count_in_the_request_error_metric(tmp_path: Path) -> None:
    """An error the engine answers (here the simulator's 400 for ``echo``) reaches the client
    as it is and counts in kvroute_request_errors_total (code engine_error); every API
    response counts in kvroute_responses_total by status class (the SLO's denominator)."""
    with Stack(StackConfig(workers=1, speedup=100, log_dir=tmp_path)) as stack:
        gw = stack.gateway_urls[0]
        assert complete(gw, "fine " * 20) == 200
        body = json.dumps({"model": MODEL, "prompt": "x " * 20, "max_tokens": 1, "echo": True})
        req = urllib.request.Request(
            gw + "/v1/completions", data=body.encode(), headers={"content-type": "application/json"}
        )
        try:
            urllib.request.urlopen(req, timeout=30).close()
            raise AssertionError("the simulator accepted echo")
        except urllib.error.HTTPError as exc:
            assert exc.code == 400
            assert "echo" in json.loads(exc.read())["error"]["message"]
        errors = metric(gw, "kvroute_request_errors_total", status="400", code="engine_error")
        assert errors == 1.0
        assert metric(gw, "kvroute_responses_total", pool=MODEL, code="4xx") == 1.0
        assert metric(gw, "kvroute_responses_total", pool=MODEL, code="2xx") == 1.0
        get(gw + "/metrics")  # scrapes and probes are not traffic
        get(gw + "/ready")
        assert metric(gw, "kvroute_responses_total") == 2.0


# -- /metrics on a port of its own ---------------------------------------------------------------


def test_metrics_port_serves_metrics_apart_from_the_api(tmp_path: Path) -> None:
    """server.metrics_port: /metrics (which takes no key) answers there and no longer on the
    API port, which keeps requiring its key."""
    port = free_port()
    settings = {"server": {"metrics_port": port}, "auth": {"api_keys": [{"key": "k1"}]}}
    with Stack(
        StackConfig(workers=1, speedup=100, gateway_settings=settings, log_dir=tmp_path)
    ) as stack:
        gw = stack.gateway_urls[0]
        status, body = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and b"kvroute_redis_connected 1.0" in body
        assert get(gw + "/metrics")[0] == 404
        assert get(gw + "/v1/models")[0] == 401
        assert get(gw + "/v1/models", "k1")[0] == 200
        assert get(gw + "/ready")[0] == 200


# -- graceful drain on SIGTERM --------------------------------------------------------------------


def stream_tokens(url: str, max_tokens: int, first: threading.Event, out: list[str]) -> None:
    """Stream a completion, appending each SSE data line to ``out`` (``first`` set on the
    first one); an ``error`` entry if the stream breaks."""
    body = {"model": MODEL, "prompt": "drain " * 20, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                if line.startswith(b"data:"):
                    out.append(line.decode().strip())
                    first.set()
    except (OSError, http.client.HTTPException) as exc:
        out.append(f"error: {exc!r}")
    finally:
        first.set()


def refuses_connections(url: str) -> bool:
    port = urllib.parse.urlsplit(url).port
    assert port is not None
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_drains_streams_in_flight_and_refuses_new_connections(tmp_path: Path) -> None:
    """SIGTERM with a stream under way: the gateway stops accepting connections at once, the
    stream runs to its end ([DONE], every token), then the process exits 0. With a drain
    bound shorter than the stream (shutdown_grace 1 s), the stream is cut and the process
    exits within the bound."""
    with Stack(StackConfig(workers=1, speedup=1, log_dir=tmp_path)) as stack:
        stack.fault(0, "slow", factor=4)  # ~30 ms a token: 120 tokens take ~3.5 s
        stack.start_gateway(1, server={"shutdown_grace": 1})
        for g, max_tokens in ((0, 120), (1, 400)):
            url, gateway = stack.gateway_urls[g], stack.gateways[g]
            first, out = threading.Event(), list[str]()
            t = threading.Thread(target=stream_tokens, args=(url, max_tokens, first, out))
            t.start()
            assert first.wait(30) and not out[0].startswith("error"), out
            signalled = time.monotonic()
            gateway.signal(signal.SIGTERM)
            assert wait_for(lambda url=url: refuses_connections(url), 5) is not None
            refused_while_streaming = t.is_alive()
            t.join(60)
            assert gateway.proc is not None
            rc = gateway.proc.wait(30)
            exited_after = time.monotonic() - signalled
            assert rc == 0, gateway.tail()
            if g == 0:  # drained: every token, then [DONE], after the listener had closed
                assert refused_while_streaming, "the stream ended before the listener closed"
                assert out[-1] == "data: [DONE]", out[-3:]
                assert len(out) == max_tokens + 1, len(out)
                assert any("draining" in ln for ln in gateway.log_lines())
            else:  # cut at the bound: no [DONE], exit soon after the 1 s grace
                assert "data: [DONE]" not in out and len(out) < max_tokens, len(out)
                assert exited_after < 10, exited_after


# -- the registry's refusals (no I/O) --------------------------------------------------------------


def test_registry_refuses_by_reason_counts_once_and_drops_a_worker_that_turns_bad() -> None:
    """A worker already routed to whose agent comes back with another seed is removed; each
    refusal is reported once per change (not per heartbeat); a refusal whose registration
    lapses is forgotten (bounded); no fingerprint is accepted but listed as unverified."""
    from types import SimpleNamespace

    from gateway.config import CircuitSettings
    from gateway.registry import Registry
    from gateway.routing.policy import make_policy
    from gateway.routing.router import Router

    router = Router(make_policy("round_robin"), 16)
    pool = SimpleNamespace(
        settings=SimpleNamespace(model="m", aliases=[]),
        router=router,
        decode_router=router,
        router_for=lambda role: router,
    )
    reasons: list[str] = []
    ours = seed_fingerprint("seed")
    reg = Registry(
        [pool],  # type: ignore[list-item]
        CircuitSettings(),
        ["127.0.0.0/8"],
        seed_fingerprint=ours,
        on_reject=reasons.append,
    )

    def info(wid: str, fp: str = ours, model: str = "m", host: str = "127.0.0.1") -> WorkerInfo:
        return WorkerInfo(wid, f"http://{host}:9000", model, seed_fingerprint=fp)

    added, _ = reg.sync({"w0": info("w0"), "old": info("old", fp="")})
    assert sorted(added) == ["old", "w0"] and reg.unverified == {"old"}
    _, removed = reg.sync({"w0": info("w0", fp=seed_fingerprint("other")), "old": info("old")})
    assert removed == ["w0"] and "w0" not in reg.workers and reasons == ["seed_mismatch"]
    assert "hash seed differs" in reg.rejected["w0"] and reg.unverified == set()
    for _ in range(3):  # heartbeats of the same bad registration: not counted again
        reg.sync({"w0": info("w0", fp=seed_fingerprint("other")), "old": info("old")})
    assert reasons == ["seed_mismatch"]
    reg.sync({"w0": info("w0", model="nope"), "x": info("x", host="203.0.113.9")})
    assert reasons == ["seed_mismatch", "unknown_model", "upstream_not_allowed"]
    reg.sync({})
    assert reg.rejected == {} and reg.workers == {}


def test_metrics_port_must_differ_from_the_api_port() -> None:
    import pytest

    from gateway.config import GatewayConfig, PoolSettings, ServerSettings
    from gateway.contract.settings import ConfigError

    pools = [PoolSettings(model="m", tokenizer="/t")]
    cfg = GatewayConfig(pools=pools, redis=GatewayConfig().redis, server=ServerSettings())
    cfg.redis.url = "redis://127.0.0.1:6379/0"
    cfg.server.metrics_port = cfg.server.port
    with pytest.raises(ConfigError, match="metrics_port"):
        cfg.validate()
    cfg.server.metrics_port = cfg.server.port + 1
    cfg.validate()


# -- an engine with another tokenizer --------------------------------------------------------------


def test_worker_whose_engine_tokenizes_otherwise_is_refused(tmp_path: Path) -> None:
    """A second engine loaded another tokenizer (here the same one lower-casing its input, as
    a different revision would differ): its /tokenize ids for the probe text differ from the
    gateway's, so the worker is refused for this agent run, counted and logged, while the
    stack's own worker (same tokenizer files) passes the same check and keeps serving."""
    from gateway.tokenization import bundled_test_tokenizer

    spec = json.loads(bundled_test_tokenizer().read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    other = tmp_path / "other-tokenizer.json"
    other.write_text(json.dumps(spec))
    with Stack(StackConfig(workers=1, speedup=100, log_dir=tmp_path / "stack")) as stack:
        gw = stack.gateway_urls[0]
        base, admin_port = port_block(3), free_port()
        sim = stack.add_process(
            ChildProcess.kvroute(
                ["sim", "--base-port", str(base), "--admin-port", str(admin_port),
                 "--model", MODEL, "--tokenizer", str(other), "--speedup", "100"],
                "sim-other-tokenizer", stack.log_dir,
            )
        )  # fmt: skip
        sim.wait_for_log("sim ready", timeout=60)
        stack.add_process(
            ChildProcess.kvroute(
                ["agent", "--engine", "vllm", "--engine-url", f"http://127.0.0.1:{base}",
                 "--redis", stack.redis_url, "--worker-id", "other-tokenizer", "--model", MODEL,
                 "--hash-seed", stack.config.hash_seed, "--block-size", "16"],
                "agent-other-tokenizer", stack.log_dir,
            )
        )  # fmt: skip

        def refused() -> bool:
            rejected = admin(stack, "/workers")["rejected_registrations"]
            return "other-tokenizer" in rejected  # type: ignore[operator]

        assert wait_for(refused, timeout=30) is not None, stack.gateways[0].tail()
        why = admin(stack, "/workers")["rejected_registrations"]["other-tokenizer"]  # type: ignore[index]
        assert "tokenizes a probe text" in why
        assert metric(gw, "kvroute_worker_rejected_total", reason="tokenizer_mismatch") == 1.0
        ids = [w["worker_id"] for w in admin(stack, "/workers")["workers"]]  # type: ignore[union-attr,index]
        assert ids == ["worker-0"]
        # the stack's worker passed the check (it ran: neither refused nor left unverified)
        lines = stack.gateways[0].log_lines()
        assert not any("worker-0" in ln and ("refus" in ln or "verified" in ln) for ln in lines)
        for i in range(6):  # nothing is routed to the refused worker
            assert complete(gw, f"after the refusal {i} " * 10) == 200
        assert metric(gw, "kvroute_requests_total", worker="other-tokenizer") is None


async def test_engine_without_tokenize_is_unverified_not_refused(tmp_path: Path) -> None:
    """An engine that has no /tokenize (SGLang) or does not answer: inconclusive (None)."""
    import aiohttp
    from aiohttp import web

    from gateway.tokencheck import check_engine_tokenizer
    from gateway.tokenization import Tokenizer, bundled_test_tokenizer

    tok = Tokenizer.load(bundled_test_tokenizer())
    app = web.Application()
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            missing = await check_engine_tokenizer(session, f"http://127.0.0.1:{port}", "m", tok)
            assert missing.ok is None and "404" in missing.detail
            dead = await check_engine_tokenizer(
                session, f"http://127.0.0.1:{free_port()}", "m", tok
            )
            assert dead.ok is None and dead.detail.startswith("/tokenize failed")
    finally:
        await runner.cleanup()
        tok.close()
