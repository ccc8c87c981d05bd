"""How much of the traffic each shared prefix carries (decayed request rates).

A prefix that every request shares (one system prompt, a hot document) cannot be served well
by one worker however cheap its cache hits are: its holder's queue grows while the others
idle. It should live on about ``share × workers`` workers, and the one-time prefill that puts
it on another worker is an investment every later request benefits from — something a
per-request cost cannot see. The router records, for every decision, the canonical key at
the end of the request's longest cached prefix; the policy reads that prefix's share of
recent traffic to decide how many holders it warrants.

Rates decay exponentially (``half_life`` seconds), so shares follow the traffic. ``rate``
turns a prefix's decayed count into requests per second, unbiased for a prefix seen only for
a moment (a sudden hot prompt is sized from its first second, not from its decayed count,
which would take several half-lives to build up). Pure: time is an argument. Memory is bounded by the prefixes seen in the last few half-lives; pruning is
amortised (when the table has doubled since the last prune).
"""

from __future__ import annotations

import math

__all__ = ["PrefixPopularity"]


class PrefixPopularity:
    def __init__(
        self, half_life: float = 20.0, floor: float = 0.01, min_window: float = 0.1
    ) -> None:
        if half_life <= 0 or min_window <= 0:
            raise ValueError("half_life and min_window must be > 0")
        self.half_life = half_life
        self.floor = floor  # decayed weight below which a prefix is forgotten
        self.min_window = min_window  # shortest span a rate is measured over (seconds)
        self._rate = math.log(2) / half_life
        self._w: dict[int, tuple[float, float]] = {}  # key -> (weight, at)
        self._first: dict[int, float] = {}  # key -> when it was first seen (since forgotten)
        self._total = (0.0, 0.0)
        self._start: float | None = None  # the first request observed
        self._prune_at = 1024

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        w, at = entry
        return w * math.exp(-self._rate * (now - at)) if now > at else w

    def observe(self, key: int, now: float) -> None:
        """One request shared the prefix that ends with ``key``."""
        entry = self._w.get(key)
        if entry is None:
            self._first[key] = now
            entry = (0.0, now)
        self._w[key] = (self._decayed(entry, now) + 1.0, now)
        self._total = (self._decayed(self._total, now) + 1.0, now)
        if self._start is None:
            self._start = now
        if len(self._w) >= self._prune_at:
            self._prune(now)

    def observe_request(self, now: float) -> None:
        """A request that shared no prefix (it still counts in the total)."""
        self._total = (self._decayed(self._total, now) + 1.0, now)
        if self._start is None:
            self._start = now

    def total_rate(self, now: float) -> float:
        """Recent arrivals per second of all requests (as ``rate`` for one prefix)."""
        if self._start is None:
            return 0.0
        return self._decayed(self._total, now) / self._span(self._start, now)

    def _span(self, first: float, now: float) -> float:
        """The decayed length of the time since ``first`` (at least ``min_window``): what a
        decayed count is divided by to give a rate."""
        age = max(now - first, self.min_window)
        return -math.expm1(-self._rate * age) / self._rate

    def weight(self, key: int, now: float) -> float:
        """Recent requests (exponentially decayed) that shared the prefix ending with ``key``."""
        entry = self._w.get(key)
        return 0.0 if entry is None else self._decayed(entry, now)

    def rate(self, key: int, now: float, plus: float = 0.0, since: float | None = None) -> float:
        """Recent arrivals per second of requests sharing the prefix ending with ``key``.

        The decayed count divided by the decayed length of the span it was collected over
        (since the prefix was first seen, at least ``min_window``): for a steady stream of
        ``r`` requests/s this is ``r`` from the first ``min_window`` on, where the count alone
        reaches ``r × half_life / ln 2`` only after several half-lives. ``plus``: requests
        not yet observed counted as arriving at ``now`` (the one being routed). ``since``:
        when the prefix is known to have existed already (the first request that carried
        it, before any request matched it), if earlier than its first observation: one
        request matching a prefix sent seconds ago is not ``1 / min_window`` requests/s.
        """
        entry = self._w.get(key)
        if entry is None and plus <= 0:
            return 0.0
        first = self._first.get(key, now)
        if since is not None and since < first:
            first = since
        count = 0.0 if entry is None else self._decayed(entry, now)
        return (count + plus) / self._span(first, now)

    def share(self, key: int, now: float) -> float:
        """Fraction of recent requests that shared the prefix ending with ``key``."""
        entry = self._w.get(key)
        total = self._decayed(self._total, now)
        if entry is None or total <= 0:
            return 0.0
        return min(1.0, self._decayed(entry, now) / total)

    def __len__(self) -> int:
        return len(self._w)

    def _prune(self, now: float) -> None:
        self._w = {k: e for k, e in self._w.items() if self._decayed(e, now) >= self.floor}
        self._first = {k: t for k, t in self._first.items() if k in self._w}
        self._prune_at = max(1024, 2 * len(self._w))
