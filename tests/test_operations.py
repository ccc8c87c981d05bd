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
import json
import urllib.error
import urllib.request
from pathlib import Path

from gateway.contract.fingerprint import seed_fingerprint
from gateway.contract.redis_bus import RedisBus
from gateway.contract.wire import WorkerInfo
from loadtest.harness import ChildProcess, free_port
from loadtest.stack import ADMIN_KEY, Stack, StackConfig, wait_for

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
