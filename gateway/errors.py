"""Errors the gateway answers with, shaped like OpenAI's.

Every client-visible failure is an ``ApiError``: an HTTP status plus the OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` that SDKs parse. Bad input is always a
4xx; a 5xx means the gateway or the workers failed, never the client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["ApiError", "bad_request", "error_body", "not_found"]


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

    def body(self) -> bytes:
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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)
