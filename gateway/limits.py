"""Admission control: a concurrency limit with a bounded priority queue, and rate limits.

``Admission`` caps requests in flight upstream; beyond the cap requests wait in a queue
ordered by priority tier (higher first), then arrival. A full queue answers 429 at once, a
wait longer than the queue timeout answers 408: under overload the gateway sheds load
explicitly instead of letting latency grow without bound.

``TokenBucket`` is the per-API-key rate limit (requests/s and tokens/s): pure, time is an
argument; a request that would overdraw it gets 429 with the seconds until it would fit.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass

from gateway.errors import ApiError

__all__ = ["Admission", "TokenBucket"]


class Admission:
    def __init__(self, max_concurrency: int, queue_size: int, queue_timeout: float) -> None:
        self.max_concurrency = max_concurrency  # 0: unlimited
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.in_flight = 0
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self.rejected_full = 0
        self.rejected_timeout = 0

    @property
    def queued(self) -> int:
        return sum(1 for _, _, f in self._queue if not f.done())

    async def acquire(self, priority: int = 0) -> None:
        """Wait for a slot; raises ``ApiError`` 429 (queue full) or 408 (waited too long)."""
        if not self.max_concurrency or (self.in_flight < self.max_concurrency and not self.queued):
            self.in_flight += 1
            return
        if self.queued >= self.queue_size:
            self.rejected_full += 1
            raise ApiError(
                429,
                "the gateway is overloaded: too many requests are waiting; retry later",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (-priority, next(self._seq), fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout)
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # granted just as we gave up: keep it
                return
            fut.cancel()
            self.rejected_timeout += 1
            raise ApiError(
                408,
                f"request waited more than {self.queue_timeout:g}s for a free slot",
                "timeout_error",
                code="queue_timeout",
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was granted to a client that went away
            else:
                fut.cancel()
            raise

    def release(self) -> None:
        """Free a slot: hand it to the highest-priority live waiter, if any."""
        while self._queue:
            _, _, fut = heapq.heappop(self._queue)
            if not fut.done():
                fut.set_result(None)  # the slot passes on: in_flight unchanged
                return
        self.in_flight -= 1


@dataclass
class TokenBucket:
    """``rate`` units per second, bursts up to ``burst`` units (0 rate: unlimited)."""

    rate: float
    burst: float
    level: float = 0.0
    updated: float = 0.0

    def __post_init__(self) -> None:
        self.level = self.burst

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.burst, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` if available: returns 0.0, else the seconds until it would be."""
        if self.rate <= 0:
            return 0.0
        self._refill(now)
        if self.level >= amount or self.level >= self.burst:
            self.level -= amount  # a request larger than the burst may overdraw once
            return 0.0
        return (amount - self.level) / self.rate

    def charge(self, amount: float, now: float) -> None:
        """Charge usage known only afterwards (completion tokens); may go negative."""
        if self.rate > 0:
            self._refill(now)
            self.level -= amount
