"""Pure parts of the Responses/Messages support: the input conversions (as vLLM converts),
request validation, session keys, each API's usage and stream end, error shapes."""

from __future__ import annotations

import json

import pytest

from gateway.apis import APIS
from gateway.errors import ApiError, stream_error
from gateway.proxy import _SseFilter, parse_usage
from gateway.requests import parse_body
from gateway.session import SessionKeys
from gateway.tokenization import TokenizationError
from gateway.tokenization.anthropic_input import anthropic_messages, anthropic_tools
from gateway.tokenization.responses_input import responses_messages, responses_tools


def test_responses_input_converts_as_vllm() -> None:
    assert responses_messages("Be brief.", "Hi") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
    ]
    out = responses_messages(None, items)
    assert out[0] is items[0]  # passed to the chat pipeline as it is
    assert out[1] == {
        "role": "assistant",
        "reasoning": "think",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ],
    }
    assert out[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert out[3] == {"role": "assistant", "content": "A"}
    assert responses_tools([{"type": "function", "name": "f", "parameters": {}}]) == [
        {"type": "function", "function": {"name": "f", "parameters": {}}}
    ]
    for bad in (7, [], [{"type": "web_search_call"}], [{"type": "function_call"}]):
        with pytest.raises(TokenizationError):
            responses_messages(None, bad)
    with pytest.raises(TokenizationError):
        responses_tools([{"type": "web_search"}])


def test_anthropic_messages_convert_as_vllm() -> None:
    msgs = [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "id": "t1", "content": "42"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    assert anthropic_messages(system, msgs) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
            "content": "Let me look.",
        },
        # the tool result comes out as a tool message; the user message left empty is dropped
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert anthropic_tools([{"name": "f", "input_schema": {"properties": {}}}]) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": None,
                "parameters": {"properties": {}, "type": "object"},
            },
        }
    ]
    for bad in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": []}]):
        with pytest.raises(TokenizationError):
            anthropic_messages(None, bad)


def test_parse_bodies_of_both_apis() -> None:
    r = parse_body(
        json.dumps({"model": "m", "input": "hi", "max_output_tokens": 7, "stream": True}).encode(),
        "responses",
    )
    assert r.messages == [{"role": "user", "content": "hi"}] and r.max_tokens == 7 and r.stream
    m = parse_body(
        json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
        ).encode(),
        "messages",
    )
    assert m.messages == [{"role": "user", "content": "x"}] and m.max_tokens == 3
    cases: list[tuple[dict[str, object], str, str]] = [
        ({"model": "m"}, "responses", "missing_field"),
        ({"input": "x", "previous_response_id": "r"}, "responses", "unsupported_parameter"),
        ({"input": "x", "background": True}, "responses", "unsupported_parameter"),
        ({"input": "x", "max_output_tokens": 0}, "responses", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages", "missing_field"),
        ({"messages": [], "max_tokens": 1}, "messages", "invalid_prompt"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "messages",
            "invalid_value",
        ),
    ]
    for body, kind, code in cases:
        with pytest.raises(ApiError) as exc:
            parse_body(json.dumps(body).encode(), kind)  # type: ignore[arg-type]
        assert exc.value.status == 400 and exc.value.code == code, (body, exc.value)


def test_error_shapes() -> None:
    err = ApiError(404, "no such model", "NotFoundError", code="model_not_found")
    assert json.loads(err.body("anthropic")) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no such model"},
    }
    assert json.loads(err.body())["error"]["code"] == "model_not_found"
    assert stream_error("anthropic", "x").startswith(b"event: error\ndata: ")
    assert stream_error("responses", "x").startswith(b"event: error\ndata: ")
    assert stream_error("openai", "x").endswith(b"data: [DONE]\n\n")
    unsupported = APIS["messages"].unsupported("pool-a", {"sglang"})
    assert unsupported.status == 501 and "pool-a" in unsupported.message
    assert "sglang" in unsupported.message and APIS["messages"].served_by(None)
    assert not APIS["messages"].served_by("sglang") and APIS["responses"].served_by("sglang")


def test_session_keys_headers_first_then_body_fields() -> None:
    keys = SessionKeys.of(["", "x-session-affinity", "x-session-id"], ["user", "metadata.user_id"])
    assert keys.key({"x-session-id": "b", "x-session-affinity": "a"}, {"user": "u"}) == "a"
    assert keys.key({}, {"user": "u"}) == "u"
    assert keys.key({}, {"metadata": {"user_id": "m"}}) == "m"
    assert keys.key({}, {"metadata": "nope", "user": 7}) is None


def test_usage_of_each_api() -> None:
    chat = parse_usage({"usage": {"prompt_tokens": 10, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 8}}})  # fmt: skip
    responses = parse_usage(
        {"type": "response.completed", "response": {"usage": {
            "input_tokens": 10, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 8}}}}
    )  # fmt: skip
    anthropic = parse_usage(
        {"type": "message_delta", "usage": {"input_tokens": 2, "output_tokens": 2,
                                            "cache_read_input_tokens": 8}}
    )  # fmt: skip
    start = parse_usage({"type": "message_start", "message": {"usage": {
        "input_tokens": 2, "output_tokens": 0, "cache_read_input_tokens": 8}}})  # fmt: skip
    assert chat == responses == anthropic
    assert start is not None and (start.prompt_tokens, start.cached_tokens) == (10, 8)


def test_sse_filter_ends_each_apis_stream() -> None:
    r = _SseFilter(strip_usage=False)
    data = json.dumps({"type": "response.completed", "response": {"usage": {
        "input_tokens": 4, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 0}}}})  # fmt: skip
    body = b"event: response.created\ndata: {}\n\nevent: response.completed\ndata: " + data.encode()
    assert r.feed(body + b"\n\n") == body + b"\n\n"
    assert r.done and r.final and parse_usage(r.usage) is not None
    m = _SseFilter(strip_usage=False)
    m.feed(b'event: message_stop\ndata: {"type": "message_stop"}\n\n')
    assert m.done and not m.final  # vLLM's data: [DONE] follows
    m.feed(b"data: [DONE]\n\n")
    assert m.final
