"""Types every tokenization module shares: the error clients see, the stats, a chat's ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ContentFormat = Literal["string", "openai"]


class TokenizationError(ValueError):
    """Bad input (messages, tools, template kwargs) or a template failure; the message says what
    is wrong and is safe to return to a client as a 400."""


@dataclass(frozen=True)
class TokenizerStats:
    """A snapshot of the incremental cache's counters."""

    piece_hits: int
    piece_misses: int
    token_hits: int
    token_misses: int
    tokens_cached: int
    pieces_cached: int  # cache entries: pieces and remembered chat prefixes
    evictions: int
    prefix_hits: int  # chats that reused the remembered ids of an earlier chat
    prefix_tokens: int  # tokens those reused
    full_encodes: int  # chats encoded in one piece because splitting is unsafe or overlapped
    incremental: bool  # whether this tokenizer's configuration allows the piece cache at all
    fallback_reason: str | None
    chunked: bool = False  # whether text between added tokens is cut into cached chunks
    chunk_fallback_reason: str | None = None


Ids = tuple[int, ...]


@dataclass(frozen=True)
class ChatIds:
    """A chat's ids and the remembered prefixes behind them, for callers that derive data
    from ids (block keys) and want to derive it once per conversation prefix.

    ``reused`` is the remembered prefix the ids start with (``()`` if none): the same tuple
    object for every request that reused it, as long as the cache holds it. ``remembered``
    is the prefix this request left for the next turn (None when it kept ``reused``);
    ``lead`` the one it left under its first message alone (a system prompt: the start of
    new conversations under it), None when it left none."""

    ids: list[int]
    reused: Ids = ()
    remembered: Ids | None = None
    lead: Ids | None = None
