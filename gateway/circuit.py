"""Per-worker circuit breaker: stop sending requests to a worker that keeps failing.

Closed (normal) -> open after ``failure_threshold`` consecutive failures, or at once on a
refused connection (a dead worker is the common case and every request to it would need a
retry) -> after ``open_seconds`` half-open: exactly one probe request may go; its success
closes the circuit, its failure opens it again. Pure: time is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Circuit", "CircuitState"]


class CircuitState(Enum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass
class Circuit:
    failure_threshold: int = 3
    open_seconds: float = 2.0
    state: CircuitState = CircuitState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False
    opens: int = 0

    def allows(self, now: float) -> bool:
        """May a request be sent now? (Does not reserve the half-open probe.)"""
        if self.state is CircuitState.CLOSED:
            return True
        if self.state is CircuitState.OPEN and now - self.opened_at >= self.open_seconds:
            self.state = CircuitState.HALF_OPEN
            self.probing = False
        return self.state is CircuitState.HALF_OPEN and not self.probing

    def on_send(self) -> None:
        if self.state is CircuitState.HALF_OPEN:
            self.probing = True

    def on_success(self) -> None:
        self.state = CircuitState.CLOSED
        self.failures = 0
        self.probing = False

    def on_failure(self, now: float, fatal: bool = False) -> None:
        """A request failed; ``fatal``: the worker is unreachable (connection refused)."""
        self.failures += 1
        self.probing = False
        if fatal or self.state is CircuitState.HALF_OPEN or self.failures >= self.failure_threshold:
            if self.state is not CircuitState.OPEN:
                self.opens += 1
            self.state = CircuitState.OPEN
            self.opened_at = now
