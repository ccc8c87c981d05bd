"""Request validation never fails with anything but a 4xx ``ApiError`` (fuzzed bodies)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.enginesim.api import (
    ApiError,
    GenRequest,
    check_prompt,
    decode_body,
    parse_chat,
    parse_completion,
    parse_generate,
)
from loadtest.enginesim.kvcache import pack_tokens

scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
KEYS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "stream",
        "stream_options", "n", "model", "temperature", "top_p", "tools", "chat_template_kwargs",
        "text", "input_ids", "sampling_params", "rid", "echo", "ignore_eos"]  # fmt: skip
bodies = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6)


def outcome(fn: Any, *args: Any) -> GenRequest | None:
    try:
        return fn(*args)  # type: ignore[no-any-return]
    except ApiError as exc:
        assert 400 <= exc.status < 500 and exc.body()["error"]["code"] == exc.status
        return None


@settings(max_examples=300, deadline=None)
@given(body=bodies)
def test_parsers_only_raise_api_errors(body: dict[str, Any]) -> None:
    for fn, args in (
        (parse_completion, (body, {"m"}, 16)),
        (parse_chat, (body, {"m"}, 16)),
        (parse_generate, (body,)),
    ):
        g = outcome(fn, *args)
        if g is not None:
            assert g.max_tokens >= 1
            if g.prompt_tokens is not None:
                outcome(check_prompt, g.prompt_tokens, g.max_tokens, 100, 50)


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=40) | json_values.map(msgspec.json.encode))
def test_decode_body_only_raises_api_errors(raw: bytes) -> None:
    try:
        assert isinstance(decode_body(raw), dict)
    except ApiError as exc:
        assert exc.status == 400


def test_token_ids_are_packed_and_checked() -> None:
    g = parse_completion({"prompt": [1, 2, 2**31 - 1]}, set(), 16)
    assert g.prompt_tokens == pack_tokens([1, 2, 2**31 - 1])
    for bad in ([2**31], [-1], [1.0], [1, "1"], [1, [2]], [2**64]):
        assert outcome(parse_completion, {"prompt": bad}, set(), 16) is None
