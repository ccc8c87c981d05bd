"""Prefill/decode disaggregation end to end (Redis + prefill and decode sim workers, each in a
process of its own + agents + gateway, real processes on loopback), in both engines'
protocols, and the request bodies on their own.

For every request the gateway's predicted prefix hit on the prefill worker it chose
(``x-kvroute-prefill-matched-tokens``) is compared with what that engine reused (its prefix
cache counters), and the decode worker's with the decode engine's reported reuse."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from chat_helpers import MODEL, converged, text

from gateway.config import CircuitSettings
from gateway.contract.wire import WorkerInfo
from gateway.disagg import sglang_pair_body, vllm_decode_body, vllm_prefill_body
from gateway.registry import Registry
from gateway.routing.policy import make_policy
from gateway.routing.router import Router
from loadtest.stack import Stack, StackConfig, wait_for

PREFILL = ["worker-0", "worker-1"]
DECODE = ["worker-2", "worker-3"]
PRECISION = (
    "kvroute_predicted_matched_tokens_total",
    "kvroute_checked_predicted_tokens_total",
    "kvroute_agreed_cached_tokens_total",
)


def prefill_hits(stack: Stack) -> dict[str, int]:
    return {f"worker-{s['worker']}": s["stats"]["cache_hits"] for s in stack.sim_state()}


def pd_stack(tmp_path: Path, flavor: str) -> Stack:
    return Stack(
        StackConfig(workers=4, prefill_workers=2, flavor=flavor, speedup=50, log_dir=tmp_path)
    )


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_pairs_are_routed_by_cache_and_each_half_predicted(tmp_path: Path, flavor: str) -> None:
    with pd_stack(tmp_path, flavor) as stack:
        roles = {w["worker_id"]: w["role"] for w in stack.workers()}
        assert roles == dict.fromkeys(PREFILL, "prefill") | dict.fromkeys(DECODE, "decode")
        client = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="x", max_retries=0)
        rng = random.Random(5)
        chats = [[{"role": "system", "content": text(rng, 300)}] for _ in range(3)]
        rows = []
        for turn in range(3):
            for c, msgs in enumerate(chats):
                msgs.append({"role": "user", "content": text(rng, 40)})
                assert wait_for(lambda: converged(stack), 15) is not None, stack.diverged()
                before = prefill_hits(stack)
                stream = (turn + c) % 2 == 1
                r = client.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=msgs,  # type: ignore[arg-type]
                    max_tokens=6,
                    stream=stream,
                    **({"stream_options": {"include_usage": True}} if stream else {}),
                )
                if stream:
                    chunks = list(r.parse())
                    reply = "".join(
                        ch.choices[0].delta.content or "" for ch in chunks if ch.choices
                    )
                    usage = chunks[-1].usage
                else:
                    comp = r.parse()
                    reply, usage = comp.choices[0].message.content or "", comp.usage
                assert reply and usage is not None and usage.completion_tokens == 6
                pw, dw = r.headers["x-kvroute-prefill-worker"], r.headers["x-kvroute-worker"]
                assert pw in PREFILL and dw in DECODE
                after = prefill_hits(stack)
                details = usage.prompt_tokens_details
                rows.append(
                    (
                        int(r.headers["x-kvroute-prefill-matched-tokens"]),
                        after[pw] - before[pw],
                        int(r.headers["x-kvroute-matched-tokens"]),
                        (details.cached_tokens or 0) if details else 0,
                        usage.prompt_tokens,
                    )
                )
                msgs.append({"role": "assistant", "content": reply})
        # precision counts both halves: each worker's prediction against its own report
        predicted = stack.metric_sum("kvroute_predicted_matched_tokens_total")
        assert predicted == sum(r[0] + r[2] for r in rows) > 0
        # every request reported its usage, so every prediction was checked
        checked = lambda: stack.metric_sum("kvroute_checked_predicted_tokens_total")  # noqa: E731
        assert wait_for(lambda: checked() == predicted, 10) is not None, (checked(), predicted)
        # SGLang's prefill half may end its answer after the decode half has answered the
        # client; the gateway reads it to the end (its usage) off the client's path
        agreed = lambda: stack.metric_sum("kvroute_agreed_cached_tokens_total")  # noqa: E731
        assert wait_for(lambda: agreed() == predicted, 10) is not None, (
            agreed(),
            predicted,
            {
                w: [stack.metric_sum(n, label=f'worker="{w}"') for n in PRECISION]
                for w in PREFILL + DECODE
            },
            rows,
        )
    # the prefill engine reused exactly what the gateway predicted for it, and so did the
    # decode engine (it caches what it received: a conversation's next turn finds it there)
    assert [r[0] for r in rows] == [r[1] for r in rows], rows
    assert [r[2] for r in rows] == [r[3] for r in rows], rows
    follow_ups = rows[3:]
    assert sum(r[0] for r in follow_ups) > 0.5 * sum(r[4] for r in follow_ups), rows


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_a_hot_prefix_is_warmed_on_a_second_prefill_worker(tmp_path: Path, flavor: str) -> None:
    """A prefix in steady demand warrants a second prefill holder: the warm-up must reach it
    in the engine's protocol (an SGLang prefill engine refuses a request without a bootstrap
    room) and leave the prefix cached there, so pairs then spill onto it without a cold
    prefill."""
    cfg = StackConfig(
        workers=4,
        prefill_workers=2,
        flavor=flavor,
        speedup=20,
        log_dir=tmp_path,
        policy_params={"min_requests": 2, "replication": 200.0},
    )
    rng = random.Random(11)
    prefix = [rng.randrange(1000, 20_000) for _ in range(1024)]
    with Stack(cfg) as stack:
        client = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="x", max_retries=0)
        served: list[tuple[str, int]] = []

        def one() -> bool:
            tail = [rng.randrange(1000, 20_000) for _ in range(24)]
            r = client.completions.with_raw_response.create(
                model=MODEL, prompt=prefix + tail, max_tokens=2
            )
            assert r.parse().choices[0].text is not None
            served.append(
                (
                    r.headers["x-kvroute-prefill-worker"],
                    int(r.headers["x-kvroute-prefill-matched-tokens"]),
                )
            )
            return stack.metric_sum("kvroute_warmups_sent_total") > 0

        assert wait_for(one, 30, step=0.0) is not None, served
        first = served[0][0]
        (warmed,) = set(PREFILL) - {first}
        served.clear()

        def spilled() -> bool:
            one()
            return any(w == warmed for w, _ in served)

        assert wait_for(spilled, 30, step=0.0) is not None, served
        assert stack.metric_sum("kvroute_warmups_sent_total") == 1
        assert stack.metric_sum("kvroute_warmups_failed_total") == 0
    # on the warmed worker every pair found the prefix cached: no cold prefill there
    assert all(matched >= 1024 - 16 for w, matched in served if w == warmed), served


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_a_prefill_lost_between_the_halves_is_retried(tmp_path: Path, flavor: str) -> None:
    """Both prefill engines answer their next request and then lose its KV (as an engine
    that died right after answering): the decode half fails before the client's first
    byte and the gateway retries the pair; the client sees one answer."""
    with pd_stack(tmp_path, flavor) as stack:
        for i in (0, 1):
            stack.fault(i, "drop_transfers", count=1)
        client = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="x", max_retries=0)
        for stream in (False, True):
            r = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": text(random.Random(stream), 50)}],
                max_tokens=4,
                stream=stream,
            )
            body = list(r.parse()) if stream else r.parse()
            assert body
        lost = sum(s["pd"]["transfers_dropped"] for s in stack.sim_state()[:2])
        assert lost == 2  # both losses happened, and both requests were still answered
        retries = stack.metric_sum("kvroute_retries_total")
        assert retries >= 2


def test_a_dead_prefill_worker_is_routed_around(tmp_path: Path) -> None:
    with pd_stack(tmp_path, "vllm") as stack:
        stack.kill_worker(0)
        client = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="x", max_retries=0)
        seen = set()
        for i in range(6):
            r = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": text(random.Random(i), 50)}],
                max_tokens=3,
            )
            assert r.parse().choices[0].message.content
            seen.add(r.headers["x-kvroute-prefill-worker"])
        assert seen == {"worker-1"}


def test_a_cancelled_request_cancels_both_halves(tmp_path: Path) -> None:
    """SGLang sends both halves at once: a client gone mid-stream aborts the decode half,
    and the prefill half is not left running."""
    with pd_stack(tmp_path, "sglang") as stack:
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello " * 50}],
                "max_tokens": 5000,
                "stream": True,
            }
        ).encode()
        port = int(stack.gateway_urls[0].rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                + body
            )  # fmt: skip
            assert b"data:" in sock.recv(65536)  # the decode half is streaming

        def settled() -> bool:
            states = stack.sim_state()
            return all(s["running"] == 0 and s["waiting"] == 0 for s in states) and (
                sum(s["stats"]["aborted"] for s in states[2:]) == 1
            )

        assert wait_for(settled, 15) is not None, stack.sim_state()


def test_request_bodies_of_each_protocol() -> None:
    body = json.dumps(
        {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True,
         "stream_options": {"include_usage": True}}
    ).encode()  # fmt: skip
    pre = json.loads(vllm_prefill_body(body))
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"]["do_remote_decode"] is True
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}
    dec = json.loads(vllm_decode_body(body, params))
    assert dec["kv_transfer_params"] == params and dec["max_tokens"] == 50 and dec["stream"]
    chat = json.dumps({"messages": [], "max_completion_tokens": 9}).encode()
    assert json.loads(vllm_prefill_body(chat))["max_completion_tokens"] == 1
    pair = json.loads(sglang_pair_body(b'{"bootstrap_room": 1, "text": "t"}', "10.0.0.1", 8998, 7))
    assert pair == {"bootstrap_room": 7, "text": "t", "bootstrap_host": "10.0.0.1",
                    "bootstrap_port": 8998}  # fmt: skip


def test_roles_decide_the_router_and_an_unknown_role_is_refused() -> None:
    router, decode = Router(make_policy("round_robin"), 16), Router(make_policy("round_robin"), 16)
    pool: Any = SimpleNamespace(
        settings=SimpleNamespace(model=MODEL, aliases=[]),
        router=router,
        decode_router=decode,
        router_for=lambda role: decode if role == "decode" else router,
    )
    reg = Registry([pool], CircuitSettings(), [])
    infos = {
        "p": WorkerInfo("p", "http://127.0.0.1:1", MODEL, role="prefill"),
        "d": WorkerInfo("d", "http://127.0.0.1:2", MODEL, role="decode"),
        "x": WorkerInfo("x", "http://127.0.0.1:3", MODEL, role="verify"),
    }
    added, _ = reg.sync(infos)
    assert sorted(added) == ["d", "p"]
    assert router.workers() == ["p"] and decode.workers() == ["d"]
    assert "unknown role" in reg.rejected["x"]
    # a worker that changes role moves to the other router
    reg.sync({**infos, "d": WorkerInfo("d", "http://127.0.0.1:2", MODEL, role="prefill")})
    assert sorted(router.workers()) == ["d", "p"] and decode.workers() == []


def test_bad_roles_are_refused_at_start() -> None:
    from loadtest.enginesim.config import PdConfig
    from worker_agent.config import AgentConfig

    with pytest.raises(ValueError, match="role must be one of"):
        AgentConfig(worker_id="w", model="m", role="verify").validate()
    with pytest.raises(ValueError, match=r"pd\.role"):
        PdConfig(role="verify")  # type: ignore[arg-type]


async def test_a_prefill_answer_still_arriving_is_read_to_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's prefill half may end its answer (with that worker's usage) after the decode
    half has answered the client: the proxy lets it finish off the client's path instead of
    cancelling it unread, gives up after ``_PREFILL_GRACE_S``, and cancels it on close."""
    import asyncio

    from gateway import proxy as proxy_module
    from gateway.config import ProxySettings
    from gateway.metrics import GatewayMetrics

    proxy = proxy_module.Proxy(ProxySettings(), registry=None, metrics=GatewayMetrics())  # type: ignore[arg-type]
    release, read = asyncio.Event(), []

    async def prefill_answer() -> None:
        await release.wait()
        read.append("usage")

    arriving = asyncio.create_task(prefill_answer())
    proxy._finish_prefill(arriving)
    assert not arriving.done() and arriving in proxy._prefills
    release.set()
    await arriving
    assert read == ["usage"] and not proxy._prefills

    monkeypatch.setattr(proxy_module, "_PREFILL_GRACE_S", 0.05)
    hung = asyncio.create_task(asyncio.Event().wait())
    proxy._finish_prefill(hung)
    await asyncio.wait({hung})  # ends when the grace timer cancels it
    assert hung.cancelled() and not proxy._prefills

    stuck = asyncio.create_task(asyncio.Event().wait())
    monkeypatch.setattr(proxy_module, "_PREFILL_GRACE_S", 60.0)
    proxy._finish_prefill(stuck)
    await proxy.close()
    assert stuck.cancelled() and not proxy._prefills
