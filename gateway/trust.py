"""Which workers' index entries the gateway trusts, and the precision it measures per worker.

Precision is measured per request, not as a ratio of sums: each served request adds the
tokens the index predicted cached on its worker and ``min(predicted, reported)``, the
tokens the engine's ``cached_tokens`` confirms (block-weighted: both count whole blocks of
tokens). ``agreed / predicted`` is then exact per worker: an over-claim on one request is
never offset by an under-claim (a hit the index did not know of) on another.

A worker is untrusted while its stream is (a digest mismatch or a gap not yet repaired, from
the consumer) or while its recent precision is below ``min_precision``; the router then
ignores its index entries (load alone). The precision tally decays with ``halflife``, so an
untrusted worker, predicted nothing while routed by load, is tried again once the evidence
against it has faded. Workers whose engine never reported a cached token are not judged:
their engine may not report the field at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Precision", "TrustBook", "TrustSettings"]


@dataclass
class TrustSettings:
    #: check the digests agents stamp on their streams; resync a worker on a mismatch
    antientropy: bool = True
    #: a worker whose recent agreed/predicted is below this is routed by load alone (0: never)
    min_precision: float = 0.5
    #: ...judged only on at least this many predicted tokens (decayed)
    min_predicted_tokens: int = 8192
    #: seconds for the precision tally's weight to halve
    halflife: float = 60.0


@dataclass
class Precision:
    """One worker's decayed tally of predicted and agreed cached tokens."""

    predicted: float = 0.0
    agreed: float = 0.0
    reported_any: bool = False  # the engine reported cached tokens at least once
    at: float = 0.0

    def decay(self, now: float, halflife: float) -> None:
        if now > self.at:
            f = math.exp2(-(now - self.at) / halflife) if halflife > 0 else 0.0
            self.predicted *= f
            self.agreed *= f
        self.at = max(self.at, now)

    @property
    def value(self) -> float | None:
        return self.agreed / self.predicted if self.predicted > 0 else None


@dataclass
class TrustBook:
    """Precision per worker and the resulting verdicts; pure (time is an argument)."""

    settings: TrustSettings = field(default_factory=TrustSettings)
    tallies: dict[str, Precision] = field(default_factory=dict)
    #: worker -> why it is untrusted (the router's ``untrusted`` is its keys)
    why: dict[str, str] = field(default_factory=dict)

    @property
    def untrusted(self) -> frozenset[str]:
        return frozenset(self.why)

    def observe(self, worker: str, predicted: int, reported: int, now: float) -> int:
        """One served request; returns the agreed tokens ``min(predicted, reported)``."""
        t = self.tallies.get(worker)
        if t is None:
            t = self.tallies[worker] = Precision(at=now)
        t.decay(now, self.settings.halflife)
        agreed = min(predicted, reported)
        t.predicted += predicted
        t.agreed += agreed
        t.reported_any = t.reported_any or reported > 0
        return agreed

    def precision(self, worker: str, now: float) -> float | None:
        t = self.tallies.get(worker)
        if t is None:
            return None
        t.decay(now, self.settings.halflife)
        return t.value

    def update(self, stream: dict[str, str], now: float) -> dict[str, str]:
        """Recompute the verdicts from the consumer's stream issues and the tallies."""
        s = self.settings
        why = dict(stream)
        for w, t in self.tallies.items():
            if w in why or not t.reported_any or s.min_precision <= 0:
                continue
            t.decay(now, s.halflife)
            value = t.value
            enough = t.predicted >= s.min_predicted_tokens and value is not None
            if enough and value is not None and value < s.min_precision:
                why[w] = f"precision {value:.2f} < {s.min_precision:.2f}"
        self.why = why
        return why

    def forget(self, worker: str) -> None:
        self.tallies.pop(worker, None)
        self.why.pop(worker, None)
