"""Request validation for the simulated engines' HTTP APIs (OpenAI and SGLang native).

Pure functions from a decoded JSON body to a ``GenRequest``; anything wrong raises
``ApiError`` carrying the status and an OpenAI-style error body, as vLLM returns them
(``{"error": {"message", "type", "param", "code"}}``). Unknown fields are ignored, as the
engines do; fields the simulator reads are type-checked.
"""

from __future__ import annotations

import http
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

__all__ = [
    "ApiError",
    "GenRequest",
    "check_model",
    "check_prompt",
    "decode_body",
    "error_body",
    "parse_chat",
    "parse_completion",
    "parse_generate",
    "parse_token_ids",
]

MAX_TOKEN_ID = 2**31


class ApiError(Exception):
    """A client error (4xx) with the body the engines would send."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: ``type`` is the status phrase as a class name."""
    try:
        phrase = http.HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        phrase = "Unknown"
    kind = phrase if phrase.endswith("Error") else phrase + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class GenRequest:
    """One generation request, whatever endpoint it came from."""

    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    prompt_tokens: bytes | None = None  # token ids given by the client, uint32 LE
    prompt_text: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    request_id: str | None = None


def decode_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in a request body (invalid JSON or UTF-8 -> 400)."""
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    return body


# -- endpoints -------------------------------------------------------------------------------


def parse_completion(body: dict[str, Any], models: set[str], default_max_tokens: int) -> GenRequest:
    """``/v1/completions``: prompt as text or token ids (or a batch of exactly one)."""
    check_model(body, models)
    _check_common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
        if len(prompt) != 1:
            raise ApiError(400, "Batched prompts are not supported by the simulator", "prompt")
        prompt = prompt[0]
    req = GenRequest(max_tokens=_max_tokens(body, ("max_tokens",), default_max_tokens))
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif isinstance(prompt, list):
        req.prompt_tokens = parse_token_ids(prompt, "prompt")
    else:
        raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")
    if body.get("echo") is True:
        raise ApiError(400, "echo is not supported by the simulator", "echo")
    _stream_flags(body, req)
    return req


def parse_chat(body: dict[str, Any], models: set[str], default_max_tokens: int) -> GenRequest:
    """``/v1/chat/completions``: messages to render with the chat template."""
    check_model(body, models)
    _check_common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    names = ("max_completion_tokens", "max_tokens")
    req = GenRequest(max_tokens=_max_tokens(body, names, default_max_tokens), messages=messages)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be a list", "tools")
    req.tools = tools or None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    req.chat_kwargs = kwargs or {}
    req.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    _stream_flags(body, req)
    return req


def parse_generate(body: dict[str, Any], default_max_tokens: int = 128) -> GenRequest:
    """SGLang's ``/generate``: ``text`` or ``input_ids`` plus ``sampling_params``."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "Either text or input_ids should be provided (exactly one)")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise ApiError(400, "sampling_params must be an object", "sampling_params")
    req = GenRequest(max_tokens=_max_tokens(sp, ("max_new_tokens",), default_max_tokens))
    _min_tokens(sp, "min_new_tokens", req.max_tokens)
    _bool(sp, "ignore_eos", False)
    if isinstance(text, str):
        req.prompt_text = text
    elif isinstance(ids, list) and (not ids or _is_int(ids[0])):
        req.prompt_tokens = parse_token_ids(ids, "input_ids")
    else:
        raise ApiError(400, "Batched requests are not supported by the simulator")
    req.stream = _bool(body, "stream", False)
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise ApiError(400, "rid must be a string", "rid")
    req.request_id = rid
    return req


def check_prompt(tokens: bytes, max_tokens: int, max_model_len: int, vocab: int | None) -> None:
    """Engine-side checks once the prompt is tokenized (empty, vocabulary, context length)."""
    n = len(tokens) // 4
    if not n:
        raise ApiError(400, "The prompt cannot be empty", "prompt")
    if vocab is not None:
        top = int(np.frombuffer(tokens, dtype="<u4").max())
        if top >= vocab:
            raise ApiError(400, f"Token id {top} is out of vocabulary", "prompt")
    if n + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n + max_tokens} tokens ({n} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            "max_tokens",
        )


# -- helpers ---------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class UnknownRank(ValueError):
    """A request pinned to a data-parallel rank the engine does not have (vLLM: a 400)."""


#: vLLM pins a request to a data-parallel rank with this header (case-insensitive)
VLLM_DP_RANK_HEADER = "X-data-parallel-rank"
#: SGLang pins with a request field (``data_parallel_rank`` before 0.5.x's rename)
SGLANG_DP_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")


def pinned_rank(flavor: str, headers: Mapping[str, str], body: dict[str, Any]) -> int | None:
    """The data-parallel rank a request is pinned to the engine's own way, or None."""
    if flavor == "vllm":
        raw: Any = headers.get(VLLM_DP_RANK_HEADER)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ApiError(400, f"{VLLM_DP_RANK_HEADER} must be an integer") from None
    for name in SGLANG_DP_RANK_FIELDS:
        raw = body.get(name)
        if raw is not None:
            if not _is_int(raw):
                raise ApiError(400, f"{name} must be an integer", name)
            return int(raw)
    return None


def check_model(body: dict[str, Any], models: set[str]) -> None:
    """``model``, when given, must be a served model's name (404 otherwise, as vLLM)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    if model not in models:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")


def _check_common(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if not _is_int(n) or n != 1:
        raise ApiError(400, "Only n=1 is supported by the simulator", "n")
    for name, lo, hi in (("temperature", 0.0, None), ("top_p", 0.0, 1.0)):
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or v < lo or (hi and v > hi):
            raise ApiError(400, f"{name} must be a number in range", name)
    _bool(body, "ignore_eos", False)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return v


def _max_tokens(body: dict[str, Any], names: tuple[str, ...], default: int) -> int:
    value: Any = None
    name = names[0]
    for name in names:
        value = body.get(name)
        if value is not None:
            break
    if value is None:
        value = default
    elif not _is_int(value) or value < 1:
        raise ApiError(400, f"{name} must be an integer >= 1, got {value!r}", name)
    _min_tokens(body, "min_tokens", value)
    return int(value)


def _min_tokens(body: dict[str, Any], name: str, max_tokens: int) -> None:
    v = body.get(name)
    if v is None:
        return
    if not _is_int(v) or v < 0:
        raise ApiError(400, f"{name} must be an integer >= 0", name)
    if v > max_tokens:
        raise ApiError(400, f"{name} ({v}) must be less than or equal to max_tokens", name)


def parse_token_ids(values: list[Any], param: str) -> bytes:
    """Token ids packed as uint32 LE, checked in C; the culprit is looked for only on failure."""
    try:
        data = array("I", values).tobytes()  # rejects non-integers, negatives, >= 2**32
        ok = not data or max(data[3::4]) < 0x80  # and >= 2**31: the top byte of each id
    except (TypeError, OverflowError):
        ok = False
    if not ok:
        bad = next((v for v in values if not _is_int(v) or not 0 <= v < MAX_TOKEN_ID), None)
        raise ApiError(400, f"{param} must hold token ids in [0, 2**31), got {bad!r}", param)
    return data


def _stream_flags(body: dict[str, Any], req: GenRequest) -> None:
    req.stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    if not req.stream:
        raise ApiError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    req.include_usage = _bool(opts, "include_usage", False)
