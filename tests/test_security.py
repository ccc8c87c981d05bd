"""R7: authentication, Redis AUTH and TLS, upstreams only from the registry, header hygiene,
validated registrations, prompts kept out of logs."""

from __future__ import annotations

import asyncio
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
