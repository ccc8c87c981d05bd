"""The session key of a request: what clients already send to keep a conversation together.

The first configured header present wins (``X-Session-Affinity`` from aiperf, ``x-session-id``),
then the first configured body field holding a string (OpenAI's ``user`` and
``prompt_cache_key``, Anthropic's ``metadata.user_id``; dots name nested fields). The
``session`` policy routes on it; other policies ignore it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SessionKeys"]


@dataclass(frozen=True)
class SessionKeys:
    headers: tuple[str, ...]
    #: body fields as paths (``("metadata", "user_id")``)
    fields: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, headers: list[str], fields: list[str]) -> SessionKeys:
        return cls(tuple(h for h in headers if h), tuple(tuple(f.split(".")) for f in fields if f))

    def key(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
        for name in self.headers:
            header = headers.get(name)
            if header:
                return header
        for path in self.fields:
            value: Any = body
            for part in path:
                value = value.get(part) if isinstance(value, Mapping) else None
            if isinstance(value, str) and value:
                return value
        return None
