"""Anti-entropy, reader side: prove the index equal to each agent's mirror, or resync.

Agents stamp their mirror's digest on a stream entry every ``digest_interval``
(``worker_agent/antientropy.py``). Right after applying that entry the consumer asks
``check``: the index's keys for the worker at that very position, digested the same way,
must equal the stamp. A mismatch means an event was lost or altered without a sequence gap;
the worker is then marked mismatched at that position, its stream is no longer applied, and
it is re-bootstrapped from the first snapshot at or after that position (``heals``), which
the agent writes right after each stamp. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.contract.wire import Entry, key_digest
from gateway.routing.index import ShadowIndex

__all__ = ["AntiEntropy", "AntiEntropyStats"]


@dataclass
class AntiEntropyStats:
    checks: int = 0
    mismatches: int = 0
    resyncs: dict[str, int] = field(default_factory=dict)  # per worker: healed mismatches


class AntiEntropy:
    """Digest checks against one ``ShadowIndex``; remembers unhealed mismatches."""

    def __init__(self, index: ShadowIndex) -> None:
        self.index = index
        self.stats = AntiEntropyStats()
        #: worker -> the (epoch, seq) whose digest disagreed: a snapshot at or after it heals
        self.mismatched: dict[str, tuple[int, int]] = {}

    def check(self, worker: str, entry: Entry) -> bool:
        """Whether the index agrees with ``entry``'s digest (True if it carries none).

        Call only right after ``entry`` was applied: the stamp describes that position."""
        stamp = entry.digest
        if stamp is None:
            return True
        self.stats.checks += 1
        keys = self.index.worker_key_list(worker)
        if len(keys) == stamp.blocks and key_digest(keys) == stamp.digest:
            return True
        self.stats.mismatches += 1
        self.mismatched[worker] = (entry.epoch, entry.seq)
        return False

    def heals(self, worker: str, epoch: int, seq: int) -> bool:
        """Whether a snapshot at (epoch, seq) is at or after ``worker``'s mismatch. A
        snapshot *at* the position is the mirror there, so it heals (a gap needs one after)."""
        at = self.mismatched.get(worker)
        return at is not None and (epoch, seq) >= at

    def healed(self, worker: str) -> bool:
        """``worker`` was re-bootstrapped; True if that closed a mismatch (a resync)."""
        if self.mismatched.pop(worker, None) is None:
            return False
        self.stats.resyncs[worker] = self.stats.resyncs.get(worker, 0) + 1
        return True

    def forget(self, worker: str) -> None:
        self.mismatched.pop(worker, None)
