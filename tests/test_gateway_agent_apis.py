"""The API surface today's clients use, end to end (Redis + sim workers + agents + gateway, real
processes on loopback): the OpenAI Responses API through the ``openai`` SDK, the Anthropic
Messages API through the ``anthropic`` SDK (streaming and not, follow-up turns on the prefix
holder with the engine's cached tokens equal to the gateway's prediction), each API's own error
shape, an engine without the API named in a 501, and the admin cache reset whose clear events
empty the gateway's index."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from loadtest.stack import ADMIN_KEY, Stack, StackConfig, wait_for

MODEL = "sim-model"
SYSTEM = "You are a meticulous assistant who answers in short sentences. " * 40


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = StackConfig(workers=3, speedup=20, log_dir=tmp_path_factory.mktemp("stack"))
    with Stack(cfg) as s:
        yield s


def openai_client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="none", max_retries=0)


def anthropic_client(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.gateway_urls[0], api_key="none", max_retries=0)


def post(url: str, body: Any, token: str | None = None, path_query: str = "") -> tuple[int, Any]:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path_query, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def predicted(stack: Stack, api: str, body: dict[str, Any]) -> int:
    """The gateway's matched tokens for ``body`` now (a dry run)."""
    status, d = post(stack.gateway_urls[0] + "/debug/route?api=" + api, body, ADMIN_KEY)
    assert status == 200, d
    return int(d["matched_tokens"])


def settled(stack: Stack, api: str, body: dict[str, Any], cached: int) -> None:
    """Wait (with a deadline) until the gateway's index holds the ``cached`` tokens the engine
    holds for ``body``'s prefix: the engine's events have reached the index."""
    assert wait_for(lambda: predicted(stack, api, body) >= cached, 10.0) is not None


def blocks_cached(prompt_tokens: int, output_tokens: int) -> int:
    """Tokens a follow-up finds cached: the turn's prompt and answer in full 16-token blocks
    (the last output token is never written to the cache)."""
    return (prompt_tokens + output_tokens - 1) // 16 * 16


# -- Responses ---------------------------------------------------------------------------------


def test_responses_second_turn_lands_on_the_holder_with_the_predicted_cache_hit(
    stack: Stack,
) -> None:
    c = openai_client(stack)
    raw = c.responses.with_raw_response.create(
        model=MODEL, instructions=SYSTEM, input="Name three rivers.", max_output_tokens=8
    )
    r1 = raw.parse()
    worker = raw.headers["x-kvroute-worker"]
    assert r1.status == "completed" and r1.output_text == " the" * 8
    assert r1.usage is not None and r1.usage.output_tokens == 8
    turn2: list[Any] = [
        {"role": "user", "content": "Name three rivers."},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "And three lakes?"},
    ]
    body = {"model": MODEL, "instructions": SYSTEM, "input": turn2, "max_output_tokens": 4}
    cached = blocks_cached(r1.usage.input_tokens, 8)
    settled(stack, "responses", body, cached)
    raw2 = c.responses.with_raw_response.create(**body)  # type: ignore[call-overload]
    r2 = raw2.parse()
    assert raw2.headers["x-kvroute-worker"] == worker
    assert r2.usage is not None and r2.usage.input_tokens_details.cached_tokens == cached
    assert int(raw2.headers["x-kvroute-matched-tokens"]) == cached

    # the same turn streamed: the engine's own events, passed through
    turn3 = [
        *turn2,
        {"role": "assistant", "content": r2.output_text},
        {"role": "user", "content": "Thanks."},
    ]
    events = list(
        c.responses.create(
            model=MODEL,
            instructions=SYSTEM,
            input=turn3,
            max_output_tokens=5,
            stream=True,  # type: ignore[arg-type]
        )
    )
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == " the" * 5
    done = events[-1].response  # type: ignore[union-attr]
    assert done.usage is not None and done.usage.input_tokens_details.cached_tokens >= cached
    assert done.output_text == " the" * 5


def test_responses_bad_input_is_an_openai_error(stack: Stack) -> None:
    c = openai_client(stack)
    with pytest.raises(openai.BadRequestError) as exc:
        c.responses.create(model=MODEL, input=[{"role": 7, "content": "x"}])  # type: ignore[list-item]
    assert exc.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as exc:
        c.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    body: Any = exc.value.body
    assert body["code"] == "unsupported_parameter" and "previous_response_id" in body["message"]
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input="x")
    status, err = post(stack.gateway_urls[0] + "/v1/responses", b"{not json")
    assert status == 400 and err["error"]["code"] == "invalid_json"


# -- Messages ----------------------------------------------------------------------------------


def test_messages_second_turn_lands_on_the_holder_with_the_predicted_cache_read(
    stack: Stack,
) -> None:
    c = anthropic_client(stack)
    first = [{"role": "user", "content": "Name three mountains."}]
    raw = c.messages.with_raw_response.create(
        model=MODEL,
        system=SYSTEM,
        messages=first,
        max_tokens=8,  # type: ignore[arg-type]
    )
    m1 = raw.parse()
    worker = raw.headers["x-kvroute-worker"]
    text = m1.content[0].text  # type: ignore[union-attr]
    assert m1.stop_reason == "max_tokens" and text == " the" * 8
    assert m1.usage.output_tokens == 8
    prompt = m1.usage.input_tokens + (m1.usage.cache_read_input_tokens or 0)
    turn2: list[Any] = [
        *first,
        {"role": "assistant", "content": [{"type": "text", "text": text}]},
        {"role": "user", "content": "And three seas?"},
    ]
    body = {"model": MODEL, "system": SYSTEM, "messages": turn2, "max_tokens": 4}
    cached = blocks_cached(prompt, 8)
    settled(stack, "messages", body, cached)
    raw2 = c.messages.with_raw_response.create(**body)  # type: ignore[arg-type]
    m2 = raw2.parse()
    assert raw2.headers["x-kvroute-worker"] == worker
    assert m2.usage.cache_read_input_tokens == cached
    assert int(raw2.headers["x-kvroute-matched-tokens"]) == cached

    # streamed, through the SDK's event accumulator
    with c.messages.stream(
        model=MODEL,
        system=SYSTEM,
        messages=turn2,
        max_tokens=5,  # type: ignore[arg-type]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == " the" * 5 and final.stop_reason == "max_tokens"
    assert (final.usage.cache_read_input_tokens or 0) >= cached
    events = list(c.messages.create(model=MODEL, messages=first, max_tokens=2, stream=True))  # type: ignore[arg-type]
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"


def test_messages_bad_input_is_an_anthropic_error(stack: Stack) -> None:
    c = anthropic_client(stack)
    with pytest.raises(anthropic.BadRequestError) as exc:
        c.messages.create(model=MODEL, messages=[{"role": "robot", "content": "x"}], max_tokens=2)  # type: ignore[list-item, misc]
    body: Any = exc.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "role" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as nf:
        c.messages.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index, call-overload]
    url = stack.gateway_urls[0] + "/v1/messages"
    for bad in (b"{not json", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}):
        status, err = post(url, bad)
        assert status == 400 and err["type"] == "error"
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]


# -- cache reset ---------------------------------------------------------------------------------


def test_admin_cache_reset_fans_out_and_the_index_follows(stack: Stack) -> None:
    c = openai_client(stack)
    for i in range(3):
        c.responses.create(model=MODEL, input=f"{SYSTEM} {i}", max_output_tokens=2)
    url = stack.gateway_urls[0]
    assert wait_for(lambda: sum(w["blocks"] for w in stack.index().values()) > 0, 10.0)
    assert post(url + "/reset_prefix_cache", {})[0] == 401
    assert post(url + "/flush_cache", {}, "wrong")[0] == 401
    assert post(url + "/reset_prefix_cache", {"model": "nope"}, ADMIN_KEY)[0] == 404
    status, res = post(url + "/reset_prefix_cache", {}, ADMIN_KEY, f"?model={MODEL}")
    assert status == 200 and res["success"] and res["pools"] == [MODEL], res
    assert {w["worker"] for w in res["workers"]} == {f"worker-{i}" for i in range(3)}
    assert all(
        w["success"] and w["endpoint"] == "/reset_prefix_cache" and w["status"] == 200
        for w in res["workers"]
    )
    # the engines' AllBlocksCleared -> agents' clears -> the gateway's index is empty
    assert wait_for(lambda: all(w["blocks"] == 0 for w in stack.index().values()), 10.0)
    status, res = post(url + "/flush_cache", b"", ADMIN_KEY)  # every pool, SGLang's name
    assert status == 200 and res["success"]


# -- an engine without the API --------------------------------------------------------------------


def test_sglang_pool_refuses_messages_by_name_and_flushes(tmp_path: Path) -> None:
    cfg = StackConfig(workers=1, flavor="sglang", speedup=20, log_dir=tmp_path)
    with Stack(cfg) as s:
        c = anthropic.Anthropic(base_url=s.gateway_urls[0], api_key="none", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as exc:
            c.messages.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        assert exc.value.status_code == 501
        message = exc.value.body["error"]["message"]  # type: ignore[index, call-overload]
        assert "/v1/messages" in message and MODEL in message and "sglang" in message
        r = openai.OpenAI(base_url=s.gateway_urls[0] + "/v1", api_key="none", max_retries=0)
        assert r.responses.create(model=MODEL, input="hello", max_output_tokens=2).output_text
        status, res = post(s.gateway_urls[0] + "/flush_cache", {}, ADMIN_KEY)
        assert status == 200 and res["workers"][0]["endpoint"] == "/flush_cache", res
