"""The Responses and Messages APIs of a simulated engine, as vLLM serves them.

vLLM renders both as chats: ``/v1/responses`` turns ``instructions`` + ``input`` into chat
messages, ``/v1/messages`` (Anthropic's API) turns ``system`` + ``messages``; both apply the
chat template. The conversions are the gateway's (``gateway.tokenization.responses_input``,
``anthropic_input``), which copy vLLM's. Responses come in each API's own shape: a
``response`` object with ``usage.input_tokens_details.cached_tokens``, streamed as named events
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``); an Anthropic
``message`` with ``usage.cache_read_input_tokens`` (``input_tokens`` counts the uncached part,
as vLLM reports it since its cache accounting for this API), streamed as ``message_start``,
``content_block_*``, ``message_delta``, ``message_stop`` and vLLM's closing ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from loadtest.enginesim.api import ApiError, GenRequest, check_model

if TYPE_CHECKING:
    from loadtest.enginesim.worker import Generation

__all__ = [
    "EventShape",
    "MessagesShape",
    "ResponsesShape",
    "anthropic_error",
    "parse_messages",
    "parse_responses",
]

TextOf = Callable[[int, int], str]


def parse_responses(body: dict[str, Any], models: set[str], default_max_tokens: int) -> GenRequest:
    """``/v1/responses``: the request's input as the chat messages vLLM renders."""
    from gateway.tokenization import TokenizationError
    from gateway.tokenization.responses_input import responses_messages, responses_tools

    check_model(body, models)
    if body.get("previous_response_id") is not None:
        # vLLM without VLLM_ENABLE_RESPONSES_API_STORE stores nothing
        raise ApiError(404, f"Response with id '{body['previous_response_id']}' not found.")
    try:
        messages = responses_messages(body.get("instructions"), body.get("input"))
        tools = responses_tools(body.get("tools"))
    except TokenizationError as exc:
        raise ApiError(400, str(exc), "input") from None
    req = GenRequest(
        max_tokens=_positive(body, "max_output_tokens", default_max_tokens),
        messages=messages,
        tools=tools,
    )
    req.stream = _flag(body, "stream")
    return req


def parse_messages(body: dict[str, Any], models: set[str]) -> GenRequest:
    """``/v1/messages``: Anthropic's request as the chat messages vLLM renders."""
    from gateway.tokenization import TokenizationError
    from gateway.tokenization.anthropic_input import anthropic_messages, anthropic_tools

    check_model(body, models)
    if body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens: Field required", "max_tokens")
    try:
        messages = anthropic_messages(body.get("system"), body.get("messages"))
        tools = anthropic_tools(body.get("tools"))
    except TokenizationError as exc:
        raise ApiError(400, str(exc), "messages") from None
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    req = GenRequest(max_tokens=_positive(body, "max_tokens", 1), messages=messages, tools=tools)
    req.chat_kwargs = kwargs
    req.stream = _flag(body, "stream")
    return req


def anthropic_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's translation of its error body on ``/v1/messages``."""
    err = body.get("error") or {}
    return {"type": "error", "error": {"type": err.get("type"), "message": err.get("message")}}


def _positive(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"{name} must be an integer >= 1, got {value!r}", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return value


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


class EventShape:
    """Bodies and named SSE events of one request (the server's ``_stream`` drives it)."""

    def __init__(self, model: str, text: TextOf) -> None:
        self.model = model
        self.text = text
        self.created = int(time.time())
        self.prompt_tokens = 0

    def full(self, gen: Generation) -> dict[str, Any]:
        raise NotImplementedError

    def sse_opening(self, gen: Generation) -> bytes:
        raise NotImplementedError

    def sse_chunk(self, gen: Generation, start: int, end: int) -> bytes:
        raise NotImplementedError

    def sse_closing(self, gen: Generation, include_usage: bool) -> bytes:
        raise NotImplementedError


class ResponsesShape(EventShape):
    """OpenAI Responses: a ``response`` object; events numbered by ``sequence_number``."""

    def __init__(self, model: str, text: TextOf, body: dict[str, Any]) -> None:
        super().__init__(model, text)
        self.rid = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.body = body
        self.seq = 0

    def usage(self, gen: Generation) -> dict[str, Any]:
        n = gen.produced
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.req.cached_tokens},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + n,
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self._part(text)]
        return {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}

    def _response(self, status: str, output: list[Any], usage: Any) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "metadata": b.get("metadata"),
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "temperature": b.get("temperature", 1.0),
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p", 1.0),
            "truncation": "disabled",
            "background": False,
            "incomplete_details": None,
            "error": None,
            "text": {"format": {"type": "text"}},
            "usage": usage,
            "user": b.get("user"),
        }

    def full(self, gen: Generation) -> dict[str, Any]:
        message = self._message(self.text(0, gen.produced), "completed")
        return self._response("completed", [message], self.usage(gen))

    def _ev(self, name: str, **data: Any) -> bytes:
        out = _event(name, {"type": name, "sequence_number": self.seq, **data})
        self.seq += 1
        return out

    def sse_opening(self, gen: Generation) -> bytes:
        started = self._response("in_progress", [], None)
        where = {"output_index": 0, "item_id": self.msg_id}
        return b"".join(
            (
                self._ev("response.created", response=started),
                self._ev("response.in_progress", response=started),
                self._ev(
                    "response.output_item.added",
                    output_index=0,
                    item=self._message("", "in_progress"),
                ),
                self._ev(
                    "response.content_part.added", **where, content_index=0, part=self._part("")
                ),
            )
        )

    def sse_chunk(self, gen: Generation, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return self._ev(
            "response.output_text.delta",
            item_id=self.msg_id,
            output_index=0,
            content_index=0,
            delta=self.text(start, end),
            logprobs=[],
        )

    def sse_closing(self, gen: Generation, include_usage: bool) -> bytes:
        text = self.text(0, gen.produced)
        where = {"output_index": 0, "item_id": self.msg_id}
        message = self._message(text, "completed")
        return b"".join(
            (
                self._ev(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self._ev(
                    "response.content_part.done", **where, content_index=0, part=self._part(text)
                ),
                self._ev("response.output_item.done", output_index=0, item=message),
                self._ev(
                    "response.completed",
                    response=self._response("completed", [message], self.usage(gen)),
                ),
            )
        )


class MessagesShape(EventShape):
    """Anthropic Messages: a ``message`` object; ``message_start`` ... ``message_stop``."""

    def __init__(self, model: str, text: TextOf) -> None:
        super().__init__(model, text)
        self.rid = f"msg_{uuid.uuid4().hex}"

    def usage(self, gen: Generation) -> dict[str, Any]:
        cached = gen.req.cached_tokens
        return {
            "input_tokens": self.prompt_tokens - cached,
            "output_tokens": gen.produced,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _message(self, content: list[Any], stop: str | None, usage: Any) -> dict[str, Any]:
        return {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }

    def full(self, gen: Generation) -> dict[str, Any]:
        content = [{"type": "text", "text": self.text(0, gen.produced)}]
        return self._message(content, "max_tokens", self.usage(gen))

    def sse_opening(self, gen: Generation) -> bytes:
        start = self._message([], None, {**self.usage(gen), "output_tokens": 0})
        block = {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        }
        return _event("message_start", {"type": "message_start", "message": start}) + _event(
            "content_block_start", block
        )

    def sse_chunk(self, gen: Generation, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        delta = {"type": "text_delta", "text": self.text(start, end)}
        return _event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def sse_closing(self, gen: Generation, include_usage: bool) -> bytes:
        delta = {"stop_reason": "max_tokens", "stop_sequence": None}
        return b"".join(
            (
                _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _event(
                    "message_delta",
                    {"type": "message_delta", "delta": delta, "usage": self.usage(gen)},
                ),
                _event("message_stop", {"type": "message_stop"}),
                b"data: [DONE]\n\n",
            )
        )
