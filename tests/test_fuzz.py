"""R4: adversarial input against a live gateway never yields a 5xx or a crash.

Schemathesis generates requests from the gateway's own OpenAPI description, both conforming
and deliberately malformed (wrong types, missing fields, odd encodings), for every endpoint;
hand-written cases add what a schema cannot express (raw bytes, invalid UTF-8, deep nesting,
huge bodies, hostile headers). Every answer must be a 2xx-4xx with a well-formed body, and
the gateway must still serve afterwards.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from loadtest.stack import ADMIN_KEY, Stack, StackConfig

API_KEY = "fuzz-client-key"


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = StackConfig(
        workers=2,
        speedup=200,
        max_model_len=4096,
        log_dir=tmp_path_factory.mktemp("fuzz"),
        gateway_settings={
            "auth": {"api_keys": [{"key": API_KEY}]},
            "server": {"max_body_bytes": 1_000_000},
        },
    )
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(fuzz_stack: Stack) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(fuzz_stack.gateway_urls[0] + "/openapi.yaml")


OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/generate"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("GET", "/v1/models"),
    ("POST", "/debug/route"),
    ("GET", "/workers"),
    ("GET", "/debug/index"),
    ("GET", "/ready"),
]


CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE)
    for m, p in OPERATIONS
    if m == "POST"  # GETs have no input
]


@pytest.mark.parametrize(
    ("method", "path", "mode"), CASES, ids=[f"{m}-{p}-{g.value}" for m, p, g in CASES]
)
def test_every_endpoint_answers_fuzzed_requests_without_5xx(
    api_schema: schemathesis.BaseSchema,
    fuzz_stack: Stack,
    method: str,
    path: str,
    mode: GenerationMode,
) -> None:
    op = api_schema.find_operation_by_path(method, path)
    assert op is not None
    token = ADMIN_KEY if path in ("/debug/route", "/workers", "/debug/index") else API_KEY
    base = fuzz_stack.gateway_urls[0]
    seen: list[int] = []

    @settings(
        max_examples=30,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        response = case.call(
            base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        seen.append(response.status_code)
        assert response.status_code < 500, (
            path,
            case.body,
            response.status_code,
            response.text[:300],
        )
        if response.status_code >= 400:
            err = response.json()["error"]
            assert isinstance(err["message"], str) and err["message"]
            assert isinstance(err["type"], str)

    check()
    assert seen  # hypothesis really sent requests


def _post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize(
    "body",
    [
        b"\x00\x01\x02\xff",
        b'{"model": "sim-model", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # surrogate bytes
        b'{"model": "sim-model", "messages": [{"role": "user", "content": "\\ud800"}]}',  # lone surrogate escape
        b'{"model": "sim-model", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"model": "sim-model", "messages": [{"role": "user", "content": '
        + b'"x'
        + b"y" * 900_000
        + b'"}]}',
        b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e309}',
        b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999999999999999999999}',
        json.dumps(
            {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "<\uff5cUser\uff5c>" * 500}],
            }
        ).encode(),
        json.dumps(
            {"model": "sim-model", "messages": [{"role": "tool", "content": None}]}
        ).encode(),
        json.dumps({"model": "sim-model", "prompt": [[1] * 10] * 200, "max_tokens": 1}).encode(),
    ],
)
def test_hostile_bodies_get_a_4xx_or_an_answer(fuzz_stack: Stack, body: bytes) -> None:
    url = fuzz_stack.gateway_urls[0]
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    status, data = _post(
        url + path, body, {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    )
    assert status < 500, (status, data[:300])
    if status >= 400:
        assert json.loads(data)["error"]["message"]


@pytest.mark.parametrize(
    "headers",
    [
        {"content-type": "text/plain"},
        {"content-type": "application/json; charset=latin-1"},
        {"x-request-id": "a" * 5000},
        {"x-request-id": "../../etc/passwd\r\nX-Injected: 1"[:40].replace("\r\n", " ")},
        {"authorization": "Bearer " + "k" * 8000},
        {"x-session-id": "\u00e9\u00e9".encode().decode("latin-1")},
        {"transfer-encoding": "chunked"},
    ],
)
def test_hostile_headers(fuzz_stack: Stack, headers: dict[str, str]) -> None:
    url = fuzz_stack.gateway_urls[0] + "/v1/chat/completions"
    body = json.dumps(
        {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ).encode()
    merged = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}", **headers}
    status, data = _post(url, body, merged)
    assert status < 500, (status, data[:300])


def test_still_serving_after_the_fuzzing(fuzz_stack: Stack, tmp_path: Path) -> None:
    url = fuzz_stack.gateway_urls[0]
    status, data = _post(
        url + "/v1/chat/completions",
        json.dumps(
            {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "still there?"}],
                "max_tokens": 2,
            }
        ).encode(),
        {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"},
    )
    assert status == 200 and json.loads(data)["choices"]
    assert fuzz_stack.gateways[0].alive()
    log = fuzz_stack.gateways[0].log_path.read_text()
    assert "internal error" not in log, log[-2000:]
