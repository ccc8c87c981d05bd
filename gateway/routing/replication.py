"""How many workers a hot prefix should live on, and the warm-ups that put it there.

A prefix's holders serve its requests from cache; the holder set has to be large enough to
carry the prefix's traffic. The measure is work, not a request count: a prefix arriving at
``rate`` requests/s, each of which would cost ``prefill_ms`` of prefill without the cache,
demands ``rate × prefill_ms`` milliseconds of engine time per second, and one worker has
``capacity_ms`` (1,000 ms/s) of it. ``holders_needed`` is that ratio times ``replication``
(headroom: a holder also decodes and serves other traffic), at least one, at most every
worker. It follows the prefix's decayed arrival rate both ways: when demand falls the need
falls, and holders beyond it get no new warm-ups (their caches turn over by themselves).

A new holder is warmed before it is used: the router records a ``WarmupIntent`` (worker,
prefix) instead of sending a real request there cold, the edge sends a one-token request
carrying just the prefix off the request path, and traffic moves to the new holder once the
index shows it holds the prefix (the engine's own events). ``WarmupBook`` remembers warm-ups
asked for until the index shows them or ``timeout`` passes: at most one per (prefix,
worker), counted as holders-to-be so a prefix is not warmed on more workers than it needs,
and a failed one is not asked for again before the timeout (no retry loop).

Pure: time is an argument, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = ["WarmupBook", "WarmupIntent", "holders_needed"]


def holders_needed(
    rate: float,
    prefill_ms: float,
    workers: int,
    replication: float = 1.0,
    capacity_ms: float = 1000.0,
) -> int:
    """Holders a prefix warrants: ``ceil(replication × rate × prefill_ms / capacity_ms)``,
    clamped to ``[1, workers]`` (``rate`` in requests/s, ``prefill_ms`` the cold prefill of
    the prefix, ``capacity_ms`` one worker's engine milliseconds per second)."""
    if workers <= 0:
        return 0
    if capacity_ms <= 0:
        raise ValueError("capacity_ms must be > 0")
    demand = replication * max(rate, 0.0) * max(prefill_ms, 0.0) / capacity_ms
    return min(workers, max(1, math.ceil(demand - 1e-9)))


@dataclass(frozen=True)
class WarmupIntent:
    """Send ``worker`` the first ``blocks`` canonical blocks of a prompt (``tokens`` tokens)
    whose block ``key`` ends the prefix, with one output token, off the request path."""

    worker: str
    key: int
    blocks: int
    tokens: int
    at: float


class WarmupBook:
    """Warm-ups asked for and not yet visible in the index, plus the ones not yet sent."""

    def __init__(self, timeout: float = 30.0, max_outbox: int = 256) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self.timeout = timeout
        self.max_outbox = max_outbox
        self._pending: dict[int, dict[str, float]] = {}  # prefix key -> worker -> asked at
        self._outbox: list[WarmupIntent] = []
        self.asked = 0  # intents recorded (for tests and the simulator's summary)

    def pending(self, key: int, holders: Collection[str], now: float) -> list[str]:
        """Workers being warmed with the prefix ``key``: asked within ``timeout`` and not
        yet among its ``holders`` (those are done and forgotten)."""
        book = self._pending.get(key)
        if not book:
            return []
        for w, at in list(book.items()):
            if w in holders or now - at >= self.timeout:
                del book[w]
        if not book:
            del self._pending[key]
            return []
        return list(book)

    def want(self, intent: WarmupIntent) -> bool:
        """Record a warm-up; False if one for this (prefix, worker) is already pending or
        the outbox is full (the edge is not taking them)."""
        if len(self._pending) > 64:  # bounded: forget the expired of prefixes not seen since
            self._expire(intent.at)
        book = self._pending.setdefault(intent.key, {})
        if intent.worker in book or len(self._outbox) >= self.max_outbox:
            return False
        book[intent.worker] = intent.at
        self._outbox.append(intent)
        self.asked += 1
        return True

    def take(self, keys: Sequence[int]) -> list[WarmupIntent]:
        """Intents whose prefix is a prefix of the prompt with block ``keys`` (the edge
        reads the prefix's token ids from that prompt); they leave the outbox."""
        mine: list[WarmupIntent] = []
        rest: list[WarmupIntent] = []
        for it in self._outbox:
            ok = it.blocks <= len(keys) and keys[it.blocks - 1] == it.key
            (mine if ok else rest).append(it)
        if mine:
            self._outbox = rest
        return mine

    def latest(self, n: int) -> list[WarmupIntent]:
        """The last ``n`` intents recorded and not yet taken (the router speculates them)."""
        return self._outbox[-n:] if n > 0 else []

    def drain(self) -> list[WarmupIntent]:
        """Every intent not yet taken (the simulator sends them at once)."""
        out, self._outbox = self._outbox, []
        return out

    def _expire(self, now: float) -> None:
        for key in list(self._pending):
            self.pending(key, (), now)

    def __len__(self) -> int:
        """Warm-ups pending (asked, not yet seen in the index nor timed out)."""
        return sum(len(b) for b in self._pending.values())
