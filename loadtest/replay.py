"""Replaying a gateway request log (``gateway/request_log.py``) in the cluster simulator.

``kvroute simulate --from-log PATH`` runs the captured arrivals through
``loadtest.clustersim`` under any policy: the same arrival times, key chains, prompt and
output lengths and candidate workers as in production, on simulated engines whose timing
comes from the flags. What changes is only the policy (and its parameters), so the result
is a counterfactual "what would policy X have done with this traffic".

The log holds re-hashed block keys, not tokens; the engines need tokens. Each block key
becomes a block of token ids derived from the key (its 64 bits in 31-bit words, repeated to
the block size), so two prompts share engine blocks exactly where their logged key chains
agree, which is all that prefix caching and routing compare. The partial last block is
filled with ids unique to the request.

Answers sent back: an engine caches the blocks it wrote while *decoding* too, and a chat's
next turn reuses them when it sends the answer back. A request's **successor** is the later
request that extends its key chain past its last full block: the next such request of its
session, or, without a session key, the first such request when the chain's last key was
nobody's before (a prompt that ends inside a shared prefix has no successor of its own).
A request with a successor is replayed with the successor's tokens as its partial last block
and as what it generates, so its engine caches exactly the blocks the successor will look
up. A log whose follow-ups carried replies the engine did not write (a load generator's
scripted conversations, as ``kvroute loadtest compare`` sends) is replayed with
``answers="scripted"``: no successors, the engine's own tokens. What a replay still cannot
reproduce: an answer the client changed before sending it back, and retried attempts (only
the attempt that served is logged).

Bad input: a last line without its newline (a writer stopped mid-line) is skipped and
counted; any other line that is not a record is an error naming the file and line, unless
``skip_bad`` (then skipped, counted and its line numbers reported).
"""

from __future__ import annotations

import glob
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from gateway.request_log import VERSION, LogRecord
from loadtest.clustersim import TOKEN_BYTES, Arrival, SimResult

__all__ = [
    "ANSWERS",
    "Answers",
    "CapturedLog",
    "LogFormatError",
    "agreement",
    "block_tokens",
    "read_log",
    "successors",
]

_W31 = np.uint64(0x7FFFFFFF)
_FILLERS = 2**31 - 4
#: a session's requests still waiting for the turn that sends their answer back
_WAITING = 4


#: where a follow-up turn's copy of the previous answer came from (``CapturedLog.arrivals``)
Answers = Literal["returned", "scripted"]
ANSWERS: tuple[Answers, ...] = ("returned", "scripted")


class LogFormatError(ValueError):
    """A request log line is not a record (the message names file and line)."""


@dataclass(slots=True)
class _Row:
    t: float
    keys: np.ndarray  # uint64
    prompt_tokens: int
    output_tokens: int
    session: str | None
    workers: frozenset[str]
    worker: str
    policy: str


@dataclass
class LogStats:
    files: list[str] = field(default_factory=list)
    records: int = 0
    truncated: int = 0  # last lines cut short (skipped)
    bad: int = 0  # malformed lines skipped (skip_bad)
    bad_lines: list[str] = field(default_factory=list)  # the first few, "file:line"
    other_pools: dict[str, int] = field(default_factory=dict)
    no_usage: int = 0  # records without output tokens (replayed with 1)


@dataclass
class CapturedLog:
    """The records of one pool, sorted by arrival time."""

    pool: str
    block_size: int
    rows: list[_Row]
    stats: LogStats
    _successors: list[int] | None = field(default=None, init=False, repr=False)

    def successors(self) -> list[int]:
        """``successors(self.rows)``, computed once (every policy, draw and bound replays
        the same log)."""
        if self._successors is None:
            self._successors = successors(self.rows)
        return self._successors

    @property
    def names(self) -> list[str]:
        """Every worker that was ever a candidate (the simulated cluster)."""
        return sorted(set().union(*(r.workers for r in self.rows))) if self.rows else []

    @property
    def policies(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.policy] = out.get(r.policy, 0) + 1
        return out

    def __len__(self) -> int:
        return len(self.rows)

    def arrivals(
        self,
        rate: float | None = None,
        *,
        candidates: bool = True,
        answers: Answers = "returned",
    ) -> Iterator[Arrival]:
        """The requests as arrivals from time 0, built lazily (prompts can be large).

        ``rate``: scale the gaps so the stream runs at ``rate`` req/s (a what-if load);
        ``candidates``: restrict each request to its logged workers (False for the pooled
        bound's single worker); ``answers``: "returned", a follow-up turn sent back what the
        engine generated (chat clients do), or "scripted", it carried a reply the engine did
        not write (a load generator's scripted conversation: ``kvroute loadtest compare``'s)
        and the engine generates tokens of its own.
        """
        if answers not in ANSWERS:
            raise ValueError(f"answers must be one of {ANSWERS}, got {answers!r}")
        rows = self.rows
        if not rows:
            return
        t0 = rows[0].t
        factor = 1.0
        span = rows[-1].t - t0
        if rate and len(rows) > 1 and span > 0:
            factor = (len(rows) - 1) / span / rate
        bs = self.block_size
        after = self.successors() if answers == "returned" else [-1] * len(rows)
        for i, r in enumerate(rows):
            j = after[i]
            output = None
            if j < 0:
                tokens = block_tokens(r.keys, r.prompt_tokens, bs, i)
            else:  # its answer came back in request j: j's tokens, up to its last full block
                sent = rows[j].keys
                upto = block_tokens(sent, len(sent) * bs, bs, j)
                cut = r.prompt_tokens * TOKEN_BYTES
                tokens = upto[:cut]
                output = upto[cut : cut + r.output_tokens * TOKEN_BYTES]
            yield Arrival(
                i,
                (r.t - t0) * factor,
                tokens,
                r.output_tokens,
                r.session,
                r.workers if candidates else None,
                output,
            )


def successors(rows: Sequence[_Row]) -> list[int]:
    """For each request, the index of the request that sent its answer back, or -1 (see
    the module docstring). Key chains are hash chains: a later chain holding this request's
    last full-block key holds its whole prefix, at the same position.

    One pass in time order, in memory proportional to the requests, not to their keys (a
    production log holds hundreds of keys per request): only keys that end some sessionless
    request's chain are looked at, found per request by one vectorised search."""
    out = [-1] * len(rows)
    by_session: dict[str, list[int]] = {}  # requests of a session still waiting, oldest first
    by_key: dict[int, list[int]] = {}  # sessionless requests waiting, by their last key
    ends = np.unique(
        np.array([r.keys[-1] for r in rows if r.session is None and len(r.keys)], dtype=np.uint64)
    )
    seen: set[int] = set()  # of those keys, the ones some request so far held
    for j, r in enumerate(rows):
        keys = r.keys
        n = len(keys)
        if n == 0:
            continue
        if r.session is not None:
            waiting = by_session.setdefault(r.session, [])
            for i in list(waiting):
                m = len(rows[i].keys)
                if m < n and keys[m - 1] == rows[i].keys[m - 1]:
                    out[i] = j
                    waiting.remove(i)
            waiting.append(j)
            if len(waiting) > _WAITING:  # a session that forks or restarts: stay bounded
                del waiting[0]
        if not len(ends):
            continue
        pos = np.minimum(np.searchsorted(ends, keys), len(ends) - 1)
        at = np.flatnonzero(ends[pos] == keys)
        if not len(at):
            continue
        held = keys[at].tolist()
        if by_key:
            for p, k in zip(at.tolist(), held, strict=True):
                if p < n - 1 and k in by_key:  # j's chain goes on past that request's end
                    for i in by_key.pop(k):
                        out[i] = j
        last = int(keys[-1])
        if r.session is None and last not in seen:  # a chain end nobody held before
            by_key.setdefault(last, []).append(j)
        seen.update(held)
    return out


def block_tokens(keys: np.ndarray, prompt_tokens: int, block_size: int, uniq: int) -> bytes:
    """A prompt's token ids (uint32 LE) from its block keys (see the module docstring)."""
    n = len(keys)
    words = np.stack([keys & _W31, (keys >> np.uint64(31)) & _W31, keys >> np.uint64(62)], axis=1)
    blocks = words[:, np.arange(block_size) % 3].astype("<u4").tobytes() if n else b""
    tail = prompt_tokens - n * block_size
    # one id per request, a valid token id (< 2**31: the engine's own decode may fill the
    # block and publish it) and >= 4, so no key's block (its third word is < 4) equals it
    filler = np.full(tail, 4 + uniq % _FILLERS, dtype="<u4").tobytes()
    return blocks + filler


def expand_paths(paths: Sequence[str]) -> list[str]:
    """Paths and globs (``gw.jsonl*``: every process's file and rotation) -> files."""
    out: list[str] = []
    for p in paths:
        hits = sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
        if not hits:
            raise LogFormatError(f"{p}: no such request log")
        out.extend(hits)
    return list(dict.fromkeys(out))


def read_log(
    paths: Sequence[str], *, pool: str | None = None, skip_bad: bool = False
) -> CapturedLog:
    """Read request log files (any order: records are merged by time) for one pool.

    ``pool``: required when the log holds several pools.
    """
    stats = LogStats(files=expand_paths(paths))
    decode = msgspec.json.Decoder(LogRecord).decode
    by_pool: dict[str, list[tuple[int, LogRecord]]] = {}
    seq = 0
    for path in stats.files:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise LogFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
        lines = data.split(b"\n")
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            last = no == len(lines)  # no newline after it
            try:
                rec = decode(line)
                _check(rec)
            except (msgspec.DecodeError, ValueError) as exc:
                if last:
                    stats.truncated += 1
                    continue
                where = f"{path}:{no}"
                if not skip_bad:
                    raise LogFormatError(f"{where}: not a request log record: {exc}") from None
                stats.bad += 1
                if len(stats.bad_lines) < 10:
                    stats.bad_lines.append(where)
                continue
            by_pool.setdefault(rec.pool, []).append((seq, rec))
            seq += 1
    if pool is None:
        if len(by_pool) > 1:
            counts = ", ".join(f"{p} ({len(v)})" for p, v in sorted(by_pool.items()))
            raise LogFormatError(f"the log holds several pools; choose one with --pool: {counts}")
        pool = next(iter(by_pool), "")
    recs = [r for _, r in sorted(by_pool.get(pool, []), key=lambda x: (x[1].t, x[0]))]
    stats.other_pools = {p: len(v) for p, v in by_pool.items() if p != pool}
    sizes = {r.block_size for r in recs}
    if len(sizes) > 1:
        raise LogFormatError(f"pool {pool!r} changed block size during the log: {sorted(sizes)}")
    interned: dict[frozenset[str], frozenset[str]] = {}
    rows = []
    for r in recs:
        ws = frozenset(r.workers)
        if r.output_tokens is None:
            stats.no_usage += 1
        rows.append(
            _Row(
                r.t,
                np.array([int(k, 16) for k in r.keys], dtype=np.uint64),
                r.prompt_tokens,
                max(1, r.output_tokens or 1),
                r.session,
                interned.setdefault(ws, ws),
                r.worker,
                r.policy,
            )
        )
    stats.records = len(rows)
    return CapturedLog(pool, sizes.pop() if sizes else 16, rows, stats)


def _check(rec: LogRecord) -> None:
    """What the types cannot say (raises ValueError)."""
    if rec.v != VERSION:
        raise ValueError(f"record format version {rec.v} (this kvroute reads {VERSION})")
    if rec.block_size < 1 or rec.prompt_tokens < 0:
        raise ValueError("block_size must be >= 1 and prompt_tokens >= 0")
    if len(rec.keys) * rec.block_size > rec.prompt_tokens:
        raise ValueError(f"{len(rec.keys)} block keys for {rec.prompt_tokens} prompt tokens")
    if any(len(k) != 16 for k in rec.keys):
        raise ValueError("block keys must be 16 hex digits")
    for k in rec.keys:
        int(k, 16)
    if not rec.workers or rec.worker not in rec.workers:
        raise ValueError(f"worker {rec.worker!r} is not among the candidates {rec.workers}")


def agreement(log: CapturedLog, result: SimResult) -> dict[str, Any]:
    """How many simulated decisions chose the worker the live gateway chose.

    Meaningful for the policy the log was captured under (see docs/benchmarks.md for when
    it must be 100%); for another policy it says how much that policy would change.
    """
    names = result.config.worker_names()
    tab = result.table
    same = compared = 0
    first: int | None = None
    for i, w in zip(tab.index, tab.worker, strict=True):
        compared += 1
        if names[w] == log.rows[i].worker:
            same += 1
        elif first is None or i < first:
            first = i
    return {
        "compared": compared,
        "same_worker": same,
        "rate": round(same / compared, 4) if compared else None,
        "first_difference": first,
    }


def decisions(log: CapturedLog) -> list[str]:
    """The live decisions, in arrival order."""
    return [r.worker for r in log.rows]


def simulated_decisions(result: SimResult, n: int) -> list[str | None]:
    """The simulated decisions in arrival order (None: the request failed in the simulator)."""
    names = result.config.worker_names()
    out: list[str | None] = [None] * n
    for i, w in zip(result.table.index, result.table.worker, strict=True):
        out[i] = names[w]
    return out
