"""Worker load: what the engine last reported, plus what this gateway sent since.

Pure bookkeeping, no I/O. The agent scrapes the engine and publishes an ``EngineReport``
every few hundred milliseconds; between reports the gateway's own accounting of requests it
sent (prefill tokens until their first token, decode until their end) fills the gap.

Every change recomputes that worker's effective ``LoadView`` at once, and the tracker keeps
the pool ordered for the policy: a set of idle workers (interchangeable for a request none of
them has cached) and the busy ones sorted by queued prefill work. A decision then looks at a
handful of workers instead of scanning them all, which is what lets one routing core serve a
64-worker pool in tens of microseconds and a 2,048-worker simulated cluster.

Each worker has a bit (by default its own; a ``Router`` binds them to the shadow index's
slots, so index match masks and load sets combine with one integer operation): the members
and the idle workers are also kept as bit sets, so a policy counts the idle holders of a
prefix without touching them one by one. Idle workers are also kept sorted by when they were
last sent a request: an idle worker's last send cannot change while it stays idle (a send
makes it busy), so "the idle holder that has waited longest" is found by walking that order
from its oldest end, not by scanning every idle holder.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from gateway.contract.wire import EngineReport

__all__ = ["LoadTracker", "LoadView"]


@dataclass(frozen=True)
class LoadView:
    """What the policy sees of one worker's load."""

    queued_prefill_tokens: float = 0.0  # prefill work ahead of a new request
    running: float = 0.0  # sequences in the engine (slow every step down)
    kv_usage: float = 0.0

    @property
    def idle(self) -> bool:
        return self.queued_prefill_tokens <= 0 and self.running <= 0


_IDLE = LoadView()
#: decoded bit sets kept by ``LoadTracker.names``, and the largest kept (memory stays below
#: a few MB however large the pool)
_DECODED_MAX = 4096
_DECODED_LARGEST = 128


@dataclass
class _Worker:
    view: LoadView = _IDLE
    report: EngineReport | None = None
    report_fresh: bool = False
    report_version: int = 0
    prefill_tokens: int = 0  # our requests still waiting for their first token
    prefill_requests: int = 0
    decoding: int = 0  # our requests streaming tokens
    sent_since_report: int = 0  # our requests sent after the report, still in flight
    sent_tokens_since_report: int = 0  # ... and their prefill tokens, until the first token
    finished_since_report: int = 0  # our requests the report counted that have finished since
    prefilled_since_report: int = 0  # ... and prefill tokens of those that got their first token
    requests: set[int] = field(default_factory=set)


@dataclass
class _Inflight:
    worker: str
    prefill_tokens: int
    report_version: int  # the worker's report version when sent: newer reports include it
    first_token: bool = False


class LoadTracker:
    """Per-worker load of one pool: engine reports merged with in-flight accounting.

    The merge avoids double counting: the engine's queue already holds our requests that it
    received before its report, so queued prefill work is the larger of (a) our own requests
    still waiting for a first token and (b) the engine's queue at report time, minus our
    requests it counted that have been prefilled since, plus our requests sent after the
    report that still wait for their first token (likewise for running sequences). (a) is exact for a
    single gateway; (b) also sees other gateway replicas' traffic, with the report's delay.
    Reports older than ``report_ttl`` stop counting (``refresh(now)`` demotes them).
    """

    def __init__(
        self,
        mean_prompt_tokens: float = 2048.0,
        report_ttl: float = 5.0,
        order_key: Callable[[float, float, float], float] | None = None,
    ) -> None:
        #: uncached prompt tokens per request, for turning a reported count of waiting requests
        #: into queued work; learnt from the requests sent (an average over recent ones)
        self.mean_prompt_tokens = mean_prompt_tokens
        #: prompt tokens per request predicted cached where it was sent (the same average):
        #: with ``mean_prompt_tokens``, the pool's recent reuse (``reuse``)
        self.mean_cached_tokens = 0.0
        self._sent = 0
        self.report_ttl = report_ttl
        #: sorts busy workers: (queued tokens, running, kv usage) -> key; default: queued tokens
        self.order_key = order_key or (lambda q, r, kv: q)
        self._w: dict[str, _Worker] = {}
        self._req: dict[int, _Inflight] = {}
        self._next_id = 0
        self._idle: list[str] = []  # idle workers (order irrelevant; O(1) add/remove)
        self._idle_pos: dict[str, int] = {}
        self._busy: list[tuple[float, str]] = []  # (order key, worker), ascending
        self._busy_key: dict[str, tuple[float, str]] = {}
        self._expiry: deque[tuple[float, str, int]] = deque()  # report freshness deadlines
        self._last_sent: dict[str, float] = {}  # worker -> when it was last sent a request
        self._sorted_workers: list[str] | None = None
        self._idle_age: list[tuple[float, str]] = []  # idle (last sent, worker), ascending
        self._idle_age_key: dict[str, tuple[float, str]] = {}
        # bits: worker -> 1 << slot; slot -> worker; bit sets of members and idle members
        self._bit_of: Callable[[str], int] | None = None  # bound slots (None: own slots)
        self._bits: dict[str, int] = {}
        self._slot_names: list[str | None] = []
        self._free_slots: list[int] = []
        self._member_bits = 0
        self._idle_bits = 0
        self._unsent_bits = 0  # members never sent a request (absent from _last_sent)
        self._decoded: dict[int, list[str]] = {}  # bit set -> names (names' cache)

    # -- membership -------------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        if worker not in self._w:
            self._w[worker] = _Worker()
            self._assign_bit(worker)
            self._place(worker, _IDLE)
            self._sorted_workers = None

    def remove_worker(self, worker: str) -> None:
        w = self._w.pop(worker, None)
        if w is None:
            return
        self._unplace(worker, w.view)
        self._release_bit(worker)
        self._last_sent.pop(worker, None)
        for rid in w.requests:
            self._req.pop(rid, None)
        self._sorted_workers = None

    def __contains__(self, worker: object) -> bool:
        return worker in self._w

    def members(self) -> dict[str, object]:
        """The pool's workers as a mapping, for fast membership tests (do not mutate)."""
        return self._w  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._w)

    def workers(self) -> list[str]:
        """All workers, sorted (cached until membership changes)."""
        if self._sorted_workers is None:
            self._sorted_workers = sorted(self._w)
        return self._sorted_workers

    # -- bits ---------------------------------------------------------------------------------

    def bind_bits(self, bit_of: Callable[[str], int] | None) -> None:
        """Take each worker's bit from ``bit_of`` (e.g. ``ShadowIndex.bit``: one bit space with
        the index's match masks), now and for workers added later; None: the tracker's own.
        Call it again whenever the source may have reassigned bits."""
        self._bit_of = bit_of
        self._bits.clear()
        self._slot_names = []
        self._free_slots = []
        self._member_bits = self._idle_bits = self._unsent_bits = 0
        for worker in self._w:
            self._assign_bit(worker)
        self._idle_bits = sum(self._bits[w] for w in self._idle)

    def bit(self, worker: str) -> int:
        """The worker's bit (0 for a worker not in the pool)."""
        return self._bits.get(worker, 0)

    def bits(self) -> dict[str, int]:
        """Worker -> bit, for fast lookups (do not mutate)."""
        return self._bits

    def member_bits(self) -> int:
        return self._member_bits

    def unsent_bits(self) -> int:
        """The workers never sent a request, as a bit set (a tie among them is a draw)."""
        return self._unsent_bits

    def idle_bits(self) -> int:
        return self._idle_bits

    def names(self, bits: int) -> list[str]:
        """The workers of a bit set, by increasing bit (bits of non-members are ignored; do
        not mutate). Holder sets recur (a system prompt's holders), so recent ones are kept
        until membership changes."""
        bits &= self._member_bits
        out = self._decoded.get(bits)
        if out is not None:
            return out
        names = self._slot_names
        if bits.bit_count() > 64:  # a large set: find its bits in C
            raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), np.uint8)
            found = np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
            out = [names[i] for i in found]  # type: ignore[misc]
        else:
            out = []
            b = bits
            while b:
                low = b & -b
                out.append(names[low.bit_length() - 1])  # type: ignore[arg-type]
                b ^= low
        if len(out) <= _DECODED_LARGEST:
            if len(self._decoded) >= _DECODED_MAX:
                self._decoded.clear()
            self._decoded[bits] = out
        return out

    def nth(self, bits: int, k: int) -> str:
        """The ``k``-th worker (from 0, by increasing bit) of a non-empty bit set: a uniform
        draw from a large set without listing it (``names`` lists and caches small ones)."""
        bits &= self._member_bits
        if bits.bit_count() <= _DECODED_LARGEST:
            return self.names(bits)[k]
        raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), np.uint8)
        slot = int(np.flatnonzero(np.unpackbits(raw, bitorder="little"))[k])
        return self._slot_names[slot]  # type: ignore[return-value]

    def _assign_bit(self, worker: str) -> None:
        if self._bit_of is not None:
            bit = self._bit_of(worker)
        else:
            slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._slot_names)
            bit = 1 << slot
        slot = bit.bit_length() - 1
        names = self._slot_names
        if slot >= len(names):
            names.extend([None] * (slot + 1 - len(names)))
        names[slot] = worker
        self._bits[worker] = bit
        self._member_bits |= bit
        if worker not in self._last_sent:
            self._unsent_bits |= bit
        self._decoded.clear()

    def _release_bit(self, worker: str) -> None:
        bit = self._bits.pop(worker, 0)
        if bit:
            slot = bit.bit_length() - 1
            self._slot_names[slot] = None
            self._member_bits &= ~bit
            self._unsent_bits &= ~bit
            self._decoded.clear()
            if self._bit_of is None:
                heapq.heappush(self._free_slots, slot)

    # -- inputs -----------------------------------------------------------------------------

    def report(self, worker: str, report: EngineReport, now: float) -> None:
        self.add_worker(worker)
        w = self._w[worker]
        w.report = report
        w.report_fresh = True
        w.report_version += 1
        w.sent_since_report = 0
        w.sent_tokens_since_report = 0
        w.finished_since_report = 0
        w.prefilled_since_report = 0
        self._expiry.append((now + self.report_ttl, worker, w.report_version))
        self._update(worker, w)

    def started(self, worker: str, prefill_tokens: int, now: float, cached_tokens: int = 0) -> int:
        """A request was sent to ``worker`` (``prefill_tokens`` uncached, ``cached_tokens``
        predicted cached there); returns a handle for the calls below."""
        self.add_worker(worker)
        rid = self._next_id
        self._next_id += 1
        w = self._w[worker]
        self._req[rid] = _Inflight(worker, prefill_tokens, w.report_version)
        self._last_sent[worker] = now
        self._unsent_bits &= ~self._bits[worker]
        self._sent += 1
        alpha = max(0.02, 1.0 / self._sent)  # a plain mean at first, then recent requests
        self.mean_prompt_tokens += alpha * (prefill_tokens - self.mean_prompt_tokens)
        self.mean_cached_tokens += alpha * (cached_tokens - self.mean_cached_tokens)
        w.prefill_tokens += prefill_tokens
        w.prefill_requests += 1
        w.sent_since_report += 1
        w.sent_tokens_since_report += prefill_tokens
        w.requests.add(rid)
        self._update(worker, w)
        return rid

    @property
    def sent(self) -> int:
        """Requests started so far: the evidence behind ``reuse`` and the means."""
        return self._sent

    def reuse(self) -> float:
        """The share of recent requests' prompt tokens predicted cached where they were sent
        (0 before any request, 1 when all were)."""
        total = self.mean_cached_tokens + self.mean_prompt_tokens
        return self.mean_cached_tokens / total if self._sent and total > 0 else 0.0

    def first_token(self, rid: int) -> bool:
        """The request's prefill is done. False if the handle is unknown or already done."""
        req = self._req.get(rid)
        if req is None or req.first_token:
            return False
        req.first_token = True
        w = self._w.get(req.worker)
        if w is not None:
            w.prefill_tokens -= req.prefill_tokens
            w.prefill_requests -= 1
            w.decoding += 1
            if req.report_version == w.report_version:
                w.sent_tokens_since_report -= req.prefill_tokens
            else:  # the report counted it as waiting
                w.prefilled_since_report += req.prefill_tokens
            self._update(req.worker, w)
        return True

    def finished(self, rid: int) -> None:
        req = self._req.pop(rid, None)
        if req is None:
            return
        w = self._w.get(req.worker)
        if w is None:
            return
        if req.first_token:
            w.decoding -= 1
        else:
            w.prefill_tokens -= req.prefill_tokens
            w.prefill_requests -= 1
        if req.report_version == w.report_version:
            w.sent_since_report -= 1
            if not req.first_token:
                w.sent_tokens_since_report -= req.prefill_tokens
        else:  # the report counted it
            w.finished_since_report += 1
            if not req.first_token:
                w.prefilled_since_report += req.prefill_tokens
        w.requests.discard(rid)
        self._update(req.worker, w)

    def refresh(self, now: float) -> None:
        """Stop counting engine reports older than ``report_ttl`` (amortised O(1))."""
        exp = self._expiry
        while exp and exp[0][0] <= now:
            _, worker, version = exp.popleft()
            w = self._w.get(worker)
            if w is not None and w.report_version == version and w.report_fresh:
                w.report_fresh = False
                self._update(worker, w)

    # -- outputs ----------------------------------------------------------------------------

    def view(self, worker: str) -> LoadView:
        w = self._w.get(worker)
        return _IDLE if w is None else w.view

    def idle_workers(self) -> list[str]:
        """Idle workers, in no particular order (do not mutate)."""
        return self._idle

    def idle_index(self) -> dict[str, int]:
        """Idle workers as a mapping, for fast membership tests (do not mutate)."""
        return self._idle_pos

    def idle_by_age(self) -> list[tuple[float, str]]:
        """Idle workers as (last sent, worker), longest waiting first (-inf: never sent; do not
        mutate)."""
        return self._idle_age

    def busy_count(self) -> int:
        return len(self._busy)

    def busy_by_key(self) -> Iterator[tuple[float, str]]:
        """Busy workers as (order key, worker), by increasing key."""
        return iter(self._busy)

    def busy_entry(self, worker: str) -> tuple[float, str] | None:
        """A busy worker's (order key, worker), as ``busy_by_key`` yields it (None: idle)."""
        return self._busy_key.get(worker)

    def last_sent(self, worker: str) -> float:
        """When ``worker`` was last sent a request (-inf: never)."""
        return self._last_sent.get(worker, float("-inf"))

    def last_sent_map(self) -> dict[str, float]:
        """Worker -> when it was last sent a request (workers never sent one are absent)."""
        return self._last_sent

    def inflight(self, worker: str) -> int:
        w = self._w.get(worker)
        return 0 if w is None else len(w.requests)

    def inflight_total(self) -> int:
        return len(self._req)

    def last_report(self, worker: str) -> EngineReport | None:
        w = self._w.get(worker)
        return None if w is None else w.report

    def check_invariants(self) -> None:
        """Self-check for tests: the idle set and the busy order match the views."""
        assert sorted(self._idle) == sorted(n for n, w in self._w.items() if w.view.idle)
        assert self._busy == sorted(
            (self.order_key(w.view.queued_prefill_tokens, w.view.running, w.view.kv_usage), n)
            for n, w in self._w.items()
            if not w.view.idle
        )
        assert all(self._idle[i] == n for n, i in self._idle_pos.items())
        assert self._idle_age == sorted(
            (self._last_sent.get(n, float("-inf")), n) for n in self._idle
        )
        assert self._idle_bits == sum(self._bits[n] for n in self._idle)
        assert self._member_bits == sum(self._bits[n] for n in self._w)
        assert self._unsent_bits == sum(self._bits[n] for n in self._w if n not in self._last_sent)

    # -- internals --------------------------------------------------------------------------

    def _update(self, worker: str, w: _Worker) -> None:
        local_q = float(w.prefill_tokens)
        local_r = float(w.decoding + w.prefill_requests)
        rep = w.report
        if rep is None or not w.report_fresh:
            view = LoadView(local_q, local_r, 0.0)
        else:
            if rep.waiting_prefill_tokens is not None:
                engine_q = float(rep.waiting_prefill_tokens)
            else:
                engine_q = rep.waiting * self.mean_prompt_tokens
            # the report, minus what we know left it since, plus what we sent since
            engine_q = max(0.0, engine_q - w.prefilled_since_report)
            engine_r = max(0, rep.running + rep.waiting - w.finished_since_report)
            view = LoadView(
                max(local_q, engine_q + w.sent_tokens_since_report),
                max(local_r, float(engine_r + w.sent_since_report)),
                rep.kv_usage,
            )
        old = w.view
        if view != old:
            w.view = view
            self._unplace(worker, old)
            self._place(worker, view)

    def _place(self, worker: str, view: LoadView) -> None:
        if view.idle:
            self._idle_pos[worker] = len(self._idle)
            self._idle.append(worker)
            self._idle_bits |= self._bits[worker]
            age = (self._last_sent.get(worker, float("-inf")), worker)
            self._idle_age_key[worker] = age
            bisect.insort(self._idle_age, age)
        else:
            entry = (
                self.order_key(view.queued_prefill_tokens, view.running, view.kv_usage),
                worker,
            )
            self._busy_key[worker] = entry
            bisect.insort(self._busy, entry)

    def _unplace(self, worker: str, view: LoadView) -> None:
        pos = self._idle_pos.pop(worker, None)
        if pos is not None:
            last = self._idle.pop()
            if last != worker:
                self._idle[pos] = last
                self._idle_pos[last] = pos
            self._idle_bits &= ~self._bits[worker]
            age = self._idle_age_key.pop(worker)
            del self._idle_age[bisect.bisect_left(self._idle_age, age)]
            return
        entry = self._busy_key.pop(worker, None)
        if entry is None:
            return
        i = bisect.bisect_left(self._busy, entry)
        if i < len(self._busy) and self._busy[i] == entry:
            del self._busy[i]
