"""The incremental id cache: token ids of pieces, and remembered chat prefixes.

Pieces and prefixes share one LRU bounded by the number of token ids held. Each chat remembers
its ids up to its last safe cut, keyed by a hash chain over its messages; the next request of
the conversation looks its message prefixes up, checks that its rendered text starts with the
remembered text and only cuts and encodes the rest. A long first message (a system prompt) is
remembered under its own key too, up to the last safe cut inside it, so a new conversation
under it starts there."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.tokenization.types import Ids


@dataclass(frozen=True)
class Prefix:
    """The ids of a rendered chat (``text``) up to ``cut``, valid for any text starting with
    it."""

    text: str
    cut: int
    ids: Ids

    def __len__(self) -> int:
        return len(self.ids)


class IdCache:
    """LRU of token ids bounded by the total number of tokens held: pieces (text -> ids) and
    chat prefixes (conversation key -> :class:`Prefix`). Ids are tuples of shared int objects
    (8 bytes a token) so a hit is copied at memcpy speed; with the text they came from, a cached
    token costs about 20 bytes of English. A lock makes it safe from any thread."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = max(0, capacity_tokens)
        self._items: OrderedDict[str | int, Ids | Prefix] = OrderedDict()
        self._lock = threading.Lock()
        self.tokens = 0
        self.evictions = 0
        self.piece_hits = self.piece_misses = self.token_hits = self.token_misses = 0
        self.prefix_hits = self.prefix_tokens = 0

    def get_pieces(self, keys: Sequence[str]) -> list[Ids | None]:
        with self._lock:
            found: list[Ids | None] = []
            for key in keys:
                ids = self._items.get(key)
                if isinstance(ids, tuple):
                    self._items.move_to_end(key)
                    self.piece_hits += 1
                    self.token_hits += len(ids)
                    found.append(ids)
                else:
                    self.piece_misses += 1
                    found.append(None)
            return found

    def get_prefix(self, key: int) -> Prefix | None:
        with self._lock:
            entry = self._items.get(key)
            return entry if isinstance(entry, Prefix) else None

    def count_prefix_hit(self, key: int, prefix: Prefix) -> None:
        with self._lock:
            self.prefix_hits += 1
            self.prefix_tokens += len(prefix)
            if self._items.get(key) is prefix:
                self._items.move_to_end(key)

    def put_pieces(self, items: Iterable[tuple[str, Ids]]) -> None:
        with self._lock:
            for key, ids in items:
                self.token_misses += len(ids)
                self._insert(key, ids)
            self._evict()

    def put_prefix(self, key: int, prefix: Prefix) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.tokens -= len(old)
            self._insert(key, prefix)
            self._evict()

    def _insert(self, key: str | int, entry: Ids | Prefix) -> None:
        if len(entry) <= self.capacity and key not in self._items:
            self._items[key] = entry
            self.tokens += len(entry)

    def _evict(self) -> None:
        while self.tokens > self.capacity:
            _, evicted = self._items.popitem(last=False)
            self.tokens -= len(evicted)
            self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.tokens = 0

    def __len__(self) -> int:
        return len(self._items)


def conversation_keys(seed: str, messages: Sequence[dict[str, Any]]) -> list[int]:
    """A key per message prefix (the first 1, 2, ... messages): where a later request of the
    same conversation looks for the ids of an earlier one."""
    key, keys = hash(seed), []
    for message in messages:
        fields = tuple(message.items())
        try:  # text fields (the common message) hash as they are
            key = hash((key, fields))
        except TypeError:  # lists and dicts (content parts, tool calls) by their repr
            fields = tuple((k, v if isinstance(v, str) else repr(v)) for k, v in fields)
            key = hash((key, fields))
        keys.append(key)
    return keys


def or_key(ids: Ids | None, key: str) -> Ids | str:
    return key if ids is None else ids


@dataclass
class Plan:
    """A chat cut for encoding: reused prefix ids, then the split of the rest of the text."""

    text: str
    key: int | None  # the conversation key this chat is remembered under
    head: Ids  # ids of text[:start], from a remembered prefix
    start: int
    items: list[str | int]  # split of text[start:]
    resolved: list[int | Ids | str]  # items with cached ids in place; str = missing piece
    missing: list[str]
    # (key of the first message, end of its text) when the chat is remembered under its first
    # message too (Tokenizer._lead_end)
    lead: tuple[int, int] | None = None
