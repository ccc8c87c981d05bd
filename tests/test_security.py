"""R7: authentication, Redis AUTH and TLS, upstreams only from the registry, header hygiene,
validated registrations, prompts kept out of logs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import make_mocked_request

from gateway.config import ProxySettings
from gateway.contract.redis_bus import RedisBus
from gateway.contract.wire import WorkerInfo
from gateway.metrics import GatewayMetrics
from gateway.proxy import REQUEST_ID, Proxy
from loadtest.stack import ADMIN_KEY, Stack, StackConfig

MODEL = "sim-model"


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(
    url: str, body: dict[str, object], key: str, timeout: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def metric(stack: Stack, name: str, **labels: str) -> float:
    """Sum of the gateway's samples of ``name`` whose labels include ``labels``."""
    _, body = get(stack.gateway_urls[0] + "/metrics")
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if (line.startswith(name + " ") or line.startswith(name + "{"))
        and all(w in line for w in want)
    )


def wait_for(cond, timeout: float = 15.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def indexed_blocks(stack: Stack) -> int:
    status, body = get(stack.gateway_urls[0] + "/debug/index", ADMIN_KEY)
    assert status == 200
    return sum(w["blocks"] for w in json.loads(body)["workers"].values())


def exercise(stack: Stack) -> None:
    """A request through the gateway, then the worker's events must reach the index."""
    c = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="none", max_retries=0)
    c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tell me a story " * 40}], max_tokens=2
    )
    wait_for(lambda: indexed_blocks(stack) > 0, what="events through Redis into the index")
    _, metrics = get(stack.gateway_urls[0] + "/metrics")
    assert b"kvroute_redis_connected 1.0" in metrics


def test_redis_auth_end_to_end(tmp_path: Path) -> None:
    with Stack(
        StackConfig(workers=1, speedup=100, redis_password="s3cret-pw", log_dir=tmp_path)
    ) as stack:
        exercise(stack)


def test_redis_tls_and_auth_end_to_end(tmp_path: Path) -> None:
    cfg = StackConfig(
        workers=1, speedup=100, redis_password="tls-pw", redis_tls=True, log_dir=tmp_path
    )
    with Stack(cfg) as stack:
        assert stack.redis_url.startswith("rediss://")
        exercise(stack)


def test_wrong_redis_password_is_not_ready_and_says_so(tmp_path: Path) -> None:
    with Stack(
        StackConfig(workers=1, speedup=100, redis_password="right", log_dir=tmp_path)
    ) as stack:
        url = stack.redis_url.replace(":right@", ":wrong@")
        stack.start_gateway(1, redis={"url": url})
        try:
            status, body = get(stack.gateway_urls[1] + "/ready")
            assert status == 503 and b"not bootstrapped" in body
            _, metrics = get(stack.gateway_urls[1] + "/metrics")
            assert b"kvroute_redis_connected 0.0" in metrics
        finally:
            stack.gateways[1].stop()


def test_api_keys_rate_limits_and_admin_key(tmp_path: Path) -> None:
    settings = {
        "auth": {"api_keys": [{"key": "slow-key", "requests_per_s": 0.5}, {"key": "free-key"}]}
    }
    with Stack(
        StackConfig(workers=1, speedup=100, gateway_settings=settings, log_dir=tmp_path)
    ) as stack:
        base = stack.gateway_urls[0] + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="nope", max_retries=0).models.list()
        slow = openai.OpenAI(base_url=base, api_key="slow-key", max_retries=0)
        slow.completions.create(model=MODEL, prompt="a", max_tokens=1)  # the burst allows one
        with pytest.raises(openai.RateLimitError) as err:
            slow.completions.create(model=MODEL, prompt="c", max_tokens=1)
        assert int(err.value.response.headers["retry-after"]) >= 1
        free = openai.OpenAI(base_url=base, api_key="free-key", max_retries=0)
        for _ in range(4):
            free.completions.create(model=MODEL, prompt="d", max_tokens=1)
        # a client key is not an admin key, and the admin key is no client key
        assert get(stack.gateway_urls[0] + "/workers", "free-key")[0] == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key=ADMIN_KEY, max_retries=0).models.list()


def test_token_rate_limit_through_the_gateway(tmp_path: Path) -> None:
    """A key over its token rate gets an OpenAI-shaped 429 from the gateway (the request never
    reaches a worker) while another key is served; the limit is a rate, not a ban."""
    keys = [
        # 100 tokens/s, bursts of 200; a request costs prompt + max_tokens up front
        {"key": "metered-key", "name": "metered", "tokens_per_s": 100.0},
        {"key": "other-key", "name": "other"},
    ]
    settings = {"auth": {"api_keys": keys}}
    with Stack(
        StackConfig(workers=1, speedup=100, gateway_settings=settings, log_dir=tmp_path)
    ) as stack:
        url = stack.gateway_urls[0] + "/v1/completions"

        def ask(key: str, prompt_tokens: int, max_tokens: int) -> tuple[int, dict[str, str], bytes]:
            # token ids: exactly ``prompt_tokens`` prompt tokens, no tokenizer in between
            ids = [1000 + i for i in range(prompt_tokens)]
            return post(url, {"model": MODEL, "prompt": ids, "max_tokens": max_tokens}, key)

        status, headers, _ = ask("metered-key", 140, 10)  # 150 of the 200-token burst
        assert status == 200 and headers["x-kvroute-worker"] == "worker-0"
        served = metric(stack, "kvroute_requests_total")
        status, headers, data = ask("metered-key", 140, 10)  # ~50 left: over the token rate
        assert status == 429, data[:300]
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded", err
        assert "tokens" in err["message"], err  # the token bucket, not the request bucket
        assert int(headers["Retry-After"]) >= 1 and "x-kvroute-worker" not in headers
        assert metric(stack, "kvroute_rejected_total", cause="rate_limit") == 1
        assert metric(stack, "kvroute_requests_total") == served  # no worker saw it
        # the same request under another key is served meanwhile
        status, headers, _ = ask("other-key", 140, 10)
        assert status == 200 and headers["x-kvroute-worker"] == "worker-0"
        # the metered key still affords a small request (tokens are metered, not requests)
        assert ask("metered-key", 20, 5)[0] == 200
        # ... and the large one again once the bucket has refilled (100 tokens/s)
        deadline = time.monotonic() + 10.0
        while (status := ask("metered-key", 140, 10)[0]) == 429:
            assert time.monotonic() < deadline, "the token bucket never refilled"
            time.sleep(0.1)
        assert status == 200


def test_higher_priority_tier_is_admitted_first(tmp_path: Path) -> None:
    """With the concurrency limit full, a high-tier request queued after a low-tier one is
    admitted before it (first-come-first-served would admit the low one first)."""
    keys = [
        {"key": "blocker-key", "name": "blocker"},
        {"key": "low-key", "name": "low", "priority": 0},
        {"key": "high-key", "name": "high", "priority": 10},
    ]
    settings = {
        "auth": {"api_keys": keys},
        "limits": {"max_concurrency": 1, "queue_size": 8, "queue_timeout": 60.0},
    }
    # speed-up 1: 40 output tokens take ~0.25 s, so requests served one after the other
    # finish well apart
    with Stack(
        StackConfig(workers=1, speedup=1, gateway_settings=settings, log_dir=tmp_path)
    ) as stack:
        url = stack.gateway_urls[0] + "/v1/completions"
        body = {"model": MODEL, "prompt": "a story " * 20, "max_tokens": 40, "ignore_eos": True}

        def ask(key: str) -> tuple[int, float]:
            status, _, data = post(url, body, key)
            assert status == 200, data[:300]
            return status, time.monotonic()

        ask("low-key")  # warm: everything answers
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            stack.fault(0, "pause")  # the worker takes requests and makes no progress
            try:
                blocker = pool.submit(ask, "blocker-key")
                wait_for(
                    lambda: metric(stack, "kvroute_inflight_requests") == 1,
                    what="the blocker to hold the only slot",
                )
                low = pool.submit(ask, "low-key")
                wait_for(
                    lambda: metric(stack, "kvroute_queued_requests") == 1,
                    what="the low-tier request to queue",
                )
                high = pool.submit(ask, "high-key")
                wait_for(
                    lambda: metric(stack, "kvroute_queued_requests") == 2,
                    what="the high-tier request to queue",
                )
            finally:
                stack.fault(0, "resume")
            t_blocker, t_low, t_high = (f.result(timeout=60)[1] for f in (blocker, low, high))
        # one slot: each request ran alone, in admission order
        assert t_blocker < t_high < t_low, (t_blocker, t_high, t_low)
        assert metric(stack, "kvroute_queued_requests") == 0


def test_clients_cannot_choose_the_upstream(tmp_path: Path) -> None:
    with Stack(StackConfig(workers=2, speedup=100, log_dir=tmp_path)) as stack:
        c = openai.OpenAI(
            base_url=stack.gateway_urls[0] + "/v1",
            api_key="none",
            max_retries=0,
            default_headers={
                "x-kvroute-worker": "http://203.0.113.7:80",
                "x-forwarded-host": "evil.example",
                "forwarded": "host=evil",
            },
        )
        r = c.completions.with_raw_response.create(
            model=MODEL,
            prompt="hi",
            max_tokens=1,
            extra_body={"worker_url": "http://203.0.113.7", "base_url": "http://evil"},
        )
        assert r.headers["x-kvroute-worker"] in {"worker-0", "worker-1"}


def test_hop_by_hop_and_spoofable_headers_are_not_forwarded() -> None:
    request = make_mocked_request(
        "POST",
        "/v1/chat/completions",
        headers={
            "Connection": "keep-alive, x-secret",
            "Keep-Alive": "timeout=5",
            "Transfer-Encoding": "chunked",
            "Upgrade": "h2c",
            "Proxy-Authorization": "Basic eA==",
            "Authorization": "Bearer client-key",
            "Cookie": "session=1",
            "X-Forwarded-For": "1.2.3.4",
            "Host": "evil.example",
            "X-Secret": "x",
            "User-Agent": "pytest",
            "Accept": "text/event-stream",
            "traceparent": "00-abc-def-01",
        },
    )
    request[REQUEST_ID] = "rid-1"
    proxy = Proxy(
        ProxySettings(upstream_api_key="upstream-key"), registry=None, metrics=GatewayMetrics()
    )  # type: ignore[arg-type]
    sent = {k.lower(): v for k, v in proxy._upstream_headers(request).items()}
    assert sent == {
        "user-agent": "pytest",
        "accept": "text/event-stream",
        "traceparent": "00-abc-def-01",
        "content-type": "application/json",
        "x-request-id": "rid-1",
        "authorization": "Bearer upstream-key",
    }


def test_registrations_outside_the_allow_list_are_refused(tmp_path: Path) -> None:
    settings = {"security": {"allowed_upstreams": ["127.0.0.0/8"]}}
    with Stack(
        StackConfig(workers=1, speedup=100, gateway_settings=settings, log_dir=tmp_path)
    ) as stack:

        async def register(info: WorkerInfo) -> None:
            bus = RedisBus(stack.redis_url)
            try:
                await bus.register(info, ttl=60)
            finally:
                await bus.close()

        for wid, url in (
            ("evil-1", "http://203.0.113.9:8000"),
            ("evil-2", "file:///etc/passwd"),
            ("evil-3", "http://user:pw@127.0.0.1:1"),
        ):
            asyncio.run(register(WorkerInfo(worker_id=wid, url=url, model=MODEL)))

        def refused() -> bool:
            _, body = get(stack.gateway_urls[0] + "/workers", ADMIN_KEY)
            return {"evil-1", "evil-2", "evil-3"} <= set(json.loads(body)["rejected_registrations"])

        wait_for(refused, what="bad registrations to be refused")
        _, body = get(stack.gateway_urls[0] + "/workers", ADMIN_KEY)
        assert [w["worker_id"] for w in json.loads(body)["workers"]] == ["worker-0"]
        c = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="none", max_retries=0)
        for i in range(6):
            r = c.completions.with_raw_response.create(model=MODEL, prompt=f"p{i}", max_tokens=1)
            assert r.headers["x-kvroute-worker"] == "worker-0"


@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompts_are_logged_only_when_asked(tmp_path: Path, log_prompts: bool) -> None:
    settings = {"log": {"log_prompts": log_prompts, "level": "debug"}}
    with Stack(
        StackConfig(workers=1, speedup=100, gateway_settings=settings, log_dir=tmp_path)
    ) as stack:
        marker = "zebra-7731-confidential"
        c = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="none", max_retries=0)
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": marker}], max_tokens=1
        )
        stack.gateways[0].stop()
        log = stack.gateways[0].log_path.read_text()
        assert (marker in log) == log_prompts
