"""Errors the gateway answers with, shaped like the API the client speaks.

Every client-visible failure is an ``ApiError``: an HTTP status plus the OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` that SDKs parse, or on the Anthropic
Messages API Anthropic's ``{"type": "error", "error": {"type", "message"}}``. Bad input is
always a 4xx; a 5xx means the gateway or the workers failed, never the client. A stream that
breaks after it started ends with an error event in its API's own form (``stream_error``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ApiError",
    "ErrorShape",
    "anthropic_error_body",
    "bad_request",
    "error_body",
    "not_found",
    "stream_error",
]

#: the error conventions of the APIs the gateway serves
ErrorShape = Literal["openai", "responses", "anthropic"]

#: Anthropic's error type for an HTTP status (its documented set)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.message}"

    def body(self, shape: ErrorShape = "openai") -> bytes:
        if shape == "anthropic":
            return anthropic_error_body(self.status, self.message)
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type, "param": param, "code": code}}
    ).encode()


def anthropic_error_body(status: int, message: str) -> bytes:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def stream_error(shape: ErrorShape, message: str, code: str = "stream_broken") -> bytes:
    """The SSE event that ends a broken stream, as the client's API sends errors."""
    if shape == "anthropic":
        return b"event: error\ndata: " + anthropic_error_body(500, message) + b"\n\n"
    if shape == "responses":
        event = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    body = error_body(message, "upstream_error", None, code)
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)
