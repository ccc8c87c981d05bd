"""Client requests: parse and validate OpenAI, Anthropic and SGLang ``/generate`` bodies.

Pure functions from body bytes to a ``ClientRequest`` or an ``ApiError`` (always a 4xx).
Only what routing needs is validated strictly (model, messages or prompt, stream flags,
output length); every other field is passed through to the worker untouched, so engine
extensions keep working. The raw bytes are kept and forwarded as they are unless the
gateway has to change the body (``with_changes``). Responses and Messages requests are
converted to the chat messages their engine endpoint renders (``messages`` is set: they route
like chats), and are always forwarded unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.errors import ApiError, bad_request
from gateway.tokenization import TokenizationError
from gateway.tokenization.anthropic_input import anthropic_messages, anthropic_tools
from gateway.tokenization.responses_input import responses_messages, responses_tools

__all__ = ["ClientRequest", "parse_body"]

Kind = Literal["chat", "completion", "generate", "responses", "messages"]
#: kinds whose prompt is a list of chat messages rendered with the chat template
CHAT_KINDS = frozenset(("chat", "responses", "messages"))


@dataclass
class ClientRequest:
    kind: Kind
    body: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool = False
    #: the client asked for a usage chunk at the end of the stream
    include_usage: bool = False
    max_tokens: int | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: the prompt routed on: text, or token ids (the first prompt of a batch)
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    user: str | None = None

    def with_changes(self, **fields: Any) -> bytes:
        """The body re-encoded with ``fields`` set (other fields and their order kept)."""
        body = dict(self.body)
        body.update(fields)
        return json.dumps(body, ensure_ascii=False).encode()


def parse_body(raw: bytes, kind: Kind) -> ClientRequest:
    body = _json_object(raw)
    if kind == "chat":
        return _chat(body, raw)
    if kind == "completion":
        return _completion(body, raw)
    if kind == "responses":
        return _responses(body, raw)
    if kind == "messages":
        return _messages(body, raw)
    return _generate(body, raw)


# -- parts -----------------------------------------------------------------------------------


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}",
            code="invalid_utf8",
        ) from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(
            f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    return body


def _opt(body: dict[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_request(
            f"'{name}' must be {what}, got a boolean", param=name, code="invalid_type"
        )
    if not isinstance(value, types):
        raise bad_request(
            f"'{name}' must be {what}, got {type(value).__name__}", param=name, code="invalid_type"
        )
    return value


def _common(body: dict[str, Any], kind: Kind, raw: bytes) -> ClientRequest:
    model = _opt(body, "model", str, "a string")
    stream = bool(_opt(body, "stream", bool, "a boolean") or False)
    opts = _opt(body, "stream_options", dict, "an object") or {}
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request(
            "'stream_options.include_usage' must be a boolean",
            param="stream_options",
            code="invalid_type",
        )
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):
        v = _opt(body, name, int, "an integer")
        if v is not None:
            if v < 0:
                raise bad_request(
                    f"'{name}' must be >= 0, got {v}", param=name, code="invalid_value"
                )
            max_tokens = v
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _opt(body, name, (int, float), "a number")
    n = _opt(body, "n", int, "an integer")
    if n is not None and n < 1:
        raise bad_request(f"'n' must be >= 1, got {n}", param="n", code="invalid_value")
    user = _opt(body, "user", str, "a string")
    return ClientRequest(kind, body, raw, model, stream, include_usage, max_tokens, user=user)


def _chat(body: dict[str, Any], raw: bytes) -> ClientRequest:
    req = _common(body, "chat", raw)
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", param="messages", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            "'messages' must be a non-empty array", param="messages", code="invalid_type"
        )
    req.messages = messages
    req.tools = _opt(body, "tools", list, "an array")
    agp = _opt(body, "add_generation_prompt", bool, "a boolean")
    req.add_generation_prompt = True if agp is None else agp
    kwargs = _opt(body, "chat_template_kwargs", dict, "an object") or {}
    if _opt(body, "continue_final_message", bool, "a boolean"):
        kwargs = {**kwargs, "continue_final_message": True}
    req.template_kwargs = kwargs
    return req


def _responses(body: dict[str, Any], raw: bytes) -> ClientRequest:
    """OpenAI ``/v1/responses``: ``instructions`` + ``input`` as vLLM converts them."""
    req = _common(body, "responses", raw)
    for name, why in (
        ("previous_response_id", "it names a response stored by one engine"),
        ("conversation", "it names a conversation stored by one engine"),
    ):
        if body.get(name) is not None:
            raise bad_request(
                f"'{name}' is not supported through this gateway ({why}); send the whole "
                "conversation in 'input'",
                param=name,
                code="unsupported_parameter",
            )
    if _opt(body, "background", bool, "a boolean"):
        raise bad_request(
            "'background' responses are not supported through this gateway",
            param="background",
            code="unsupported_parameter",
        )
    if body.get("input") is None:
        raise bad_request("'input' is required", param="input", code="missing_field")
    mot = _opt(body, "max_output_tokens", int, "an integer")
    if mot is not None:
        if mot < 1:
            raise bad_request(
                f"'max_output_tokens' must be >= 1, got {mot}",
                param="max_output_tokens",
                code="invalid_value",
            )
        req.max_tokens = mot
    req.messages = _converted(
        lambda: responses_messages(body.get("instructions"), body["input"]), "input"
    )
    req.tools = _converted(lambda: responses_tools(body.get("tools")), "tools")
    return req


def _messages(body: dict[str, Any], raw: bytes) -> ClientRequest:
    """Anthropic ``/v1/messages``: ``system`` + ``messages`` as vLLM converts them."""
    req = _common(body, "messages", raw)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad_request("'max_tokens' is required", param="max_tokens", code="missing_field")
    if req.max_tokens is None or req.max_tokens < 1:
        raise bad_request(
            "'max_tokens' must be a positive integer", param="max_tokens", code="invalid_value"
        )
    metadata = _opt(body, "metadata", dict, "an object") or {}
    user_id = metadata.get("user_id")
    if user_id is not None and not isinstance(user_id, str):
        raise bad_request(
            "'metadata.user_id' must be a string", param="metadata", code="invalid_type"
        )
    req.messages = _converted(
        lambda: anthropic_messages(body.get("system"), body.get("messages")), "messages"
    )
    req.tools = _converted(lambda: anthropic_tools(body.get("tools")), "tools")
    kwargs = _opt(body, "chat_template_kwargs", dict, "an object") or {}
    req.template_kwargs = kwargs
    return req


def _converted(convert: Any, param: str) -> Any:
    try:
        return convert()
    except TokenizationError as exc:
        raise bad_request(str(exc), param=param, code="invalid_prompt") from None


def _token_ids(value: list[Any], param: str) -> list[int]:
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise bad_request(
                f"'{param}' token ids must be non-negative integers",
                param=param,
                code="invalid_type",
            )
    return value


def _completion(body: dict[str, Any], raw: bytes) -> ClientRequest:
    req = _common(body, "completion", raw)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt", code="missing_field")
    _route_prompt(req, prompt, "prompt")
    return req


def _generate(body: dict[str, Any], raw: bytes) -> ClientRequest:
    req = _common(body, "generate", raw)
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise bad_request(
            "one of 'text' or 'input_ids' is required", param="text", code="missing_field"
        )
    _route_prompt(req, ids if ids is not None else text, "input_ids" if ids is not None else "text")
    params = _opt(body, "sampling_params", dict, "an object") or {}
    mnt = params.get("max_new_tokens")
    if mnt is not None and (isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 0):
        raise bad_request(
            "'sampling_params.max_new_tokens' must be a non-negative integer",
            param="sampling_params",
            code="invalid_type",
        )
    req.max_tokens = mnt if mnt is not None else req.max_tokens
    return req


def _route_prompt(req: ClientRequest, prompt: Any, param: str) -> None:
    """Accept a string, token ids, or a batch of either; route on the first."""
    if isinstance(prompt, str):
        req.prompt_text = prompt
        return
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(
            f"'{param}' must be a string, an array of token ids, or a non-empty array of those",
            param=param,
            code="invalid_type",
        )
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise bad_request(
                f"'{param}' batch must hold only strings", param=param, code="invalid_type"
            )
        req.prompt_text = first
    elif isinstance(first, list):
        for p in prompt:
            if not isinstance(p, list) or not p:
                raise bad_request(
                    f"'{param}' batch must hold non-empty arrays of token ids",
                    param=param,
                    code="invalid_type",
                )
            _token_ids(p, param)
        req.prompt_ids = first
    else:
        req.prompt_ids = _token_ids(prompt, param)


def too_long(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> ApiError | None:
    """vLLM's check: prompt (plus requested output) must fit the context window."""
    requested = prompt_tokens + (max_tokens or 0)
    if prompt_tokens >= max_model_len or requested > max_model_len:
        return bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {requested} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens or 0} in the completion). Please reduce the length of the messages "
            "or completion.",
            param="messages",
            code="context_length_exceeded",
        )
    return None
