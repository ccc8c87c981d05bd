"""Offline cluster simulator: the gateway's routing core in front of one engine core per
worker, in virtual time.

Why: routing quality (hit rate, TTFT, balance) at hundreds of workers and a million requests
cannot be measured with processes and HTTP on a small machine. This module drives the objects
the live system runs — ``gateway.routing.router.Router`` (shadow index, load tracker, policies, cost
model) and ``loadtest.enginesim.scheduler.EngineCore`` (scheduler, radix KV cache, timing) —
from a discrete-event queue instead of sockets and clocks. What it says about routing is what
the gateway does; what it leaves out is the network and the processes' own CPU time.

Each part mirrors a live component:

* arrivals (open loop, in time order) are routed on arrival: ``Router.route`` then
  ``started``; ``first_token`` and ``finished`` follow when the engine produces them, as the
  gateway's proxy calls them;
* a worker behaves like the live sim worker's driver loop: a step is computed when it starts
  and its results are delivered when it ends; a request arriving meanwhile waits for the next
  step. A run of identical decode-only steps up to the next finish (nothing queued or
  prefilling, or a refused queue head) is a *span*, run with ``EngineCore``'s fast-forward in
  one call when its last step starts (as live, that step's finishes are then visible in the
  engine's state) or when an arrival interrupts it: decode costs nothing per token or step.
  ``fast_forward = False`` steps one iteration per call instead; both give the same run;
* KV events become canonical keys when the step ends (an engine block id -> key map per
  worker, like the agent's; canonical block size = the engine's) and reach the shadow index
  ``event_lag`` later (agent -> Redis -> consumer);
* each worker's load is sampled every ``report_interval`` (phases staggered) into an
  ``EngineReport`` with the fields the live agent fills (``waiting_prefill_tokens`` is not
  among them unless ``report_prefill_tokens``) and applied ``report_lag`` later;
* ``Router.tick`` runs every ``tick_interval``.

Block keys: routing only compares keys, so any chained, collision-free naming of block
prefixes routes identically. Blocks of up to 64 tokens use the deployment's ``BlockKeyer``.
Its path for larger blocks costs ~300 µs per 12k-token prompt here, so 512-token blocks (the
Mooncake trace's) get ``FingerprintKeys``: a 64-bit random-weight fingerprint per block,
chained with a 64-bit hash. Same chain property (``keys(tokens, parent)`` continues a
chain), ~10 µs per 12k-token prompt.

Pure: no I/O, no wall clock, no global state; deterministic for a seed. Results are compact
columns (a million requests fit in tens of MB); ``summary`` has the load driver's format.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import gc
import hashlib
import heapq
import math
import random
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import numpy as np

from gateway.contract.wire import EngineReport
from gateway.routing.costmodel import CostModel, CostParams
from gateway.routing.index import ShadowIndex
from gateway.routing.keys import BlockKeyer
from gateway.routing.policy import Decision, make_policy
from gateway.routing.remote import RemoteRequests
from gateway.routing.replication import WarmupIntent
from gateway.routing.router import Router, Ticket
from loadtest.driver import RequestRecord, balance
from loadtest.enginesim.config import CacheConfig, SchedulerConfig
from loadtest.enginesim.kvcache import (
    TOKEN_BYTES,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVEvent,
)
from loadtest.enginesim.scheduler import EngineCore, StepResult
from loadtest.enginesim.timing import Attention, TimingModel, timing_model

__all__ = [
    "Arrival",
    "CapacityProbe",
    "CapacityResult",
    "ClusterConfig",
    "ClusterSim",
    "FingerprintKeys",
    "KeyFunction",
    "RequestTable",
    "SimResult",
    "TokenKeys",
    "estimate_capacity",
    "native_rate",
    "pooled_bound",
    "pooled_config",
    "retime",
    "simulate",
]

_INF = float("inf")
_MASK64 = (1 << 64) - 1


# -- inputs ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Arrival:
    """One request of the stream: prompt token ids as the engine stores them (uint32 LE)."""

    index: int
    at: float  # seconds after the start of the run
    tokens: bytes
    max_tokens: int
    session: str | None = None  # the gateway's session key (``x-session-id``)
    #: the workers it may go to (a replayed request log's candidates); None: all
    workers: frozenset[str] | None = None
    #: the tokens it generates (uint32 LE) when known (a replayed log: the answer the next
    #: turn sent back, so the engine caches the blocks that turn reuses); None: a pattern
    output: bytes | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES


def native_rate(arrivals: Sequence[Arrival]) -> float:
    """Requests per second of a stream as given: (n - 1) / span."""
    if len(arrivals) < 2:
        return _INF
    span = arrivals[-1].at - arrivals[0].at
    return (len(arrivals) - 1) / span if span > 0 else _INF


def retime(
    arrivals: Sequence[Arrival], rate: float, duration: float | None = None
) -> list[Arrival]:
    """The same requests with every arrival time scaled so the stream runs at ``rate`` req/s,
    cut at ``duration`` seconds if given.

    The scaling the live comparison applies (``loadtest.compare``): think times compress with
    the inter-arrival gaps, so the offered load changes and nothing else.
    """
    native = native_rate(arrivals)
    factor = native / rate if math.isfinite(native) and rate > 0 else 1.0
    out = [dataclasses.replace(a, at=a.at * factor) for a in arrivals]
    return out if duration is None else [a for a in out if a.at <= duration]


# -- canonical block keys ---------------------------------------------------------------------


class KeyFunction(Protocol):
    """Canonical keys of the full blocks of uint32 LE ``tokens``, chained from ``parent``."""

    block_size: int

    def keys(self, tokens: bytes, parent: int | None = None) -> list[int]: ...


class TokenKeys:
    """The deployment's key function (``gateway.routing.keys.BlockKeyer``) over token bytes."""

    def __init__(self, seed: str, block_size: int) -> None:
        self.block_size = block_size
        self._keyer = BlockKeyer(seed, block_size)

    def keys(self, tokens: bytes, parent: int | None = None) -> list[int]:
        if len(tokens) < self.block_size * TOKEN_BYTES:
            return []
        # BlockKeyer takes numpy arrays too (no per-token Python objects)
        ids = cast(Sequence[int], np.frombuffer(tokens, dtype="<u4"))
        return self._keyer.keys(ids, parent)


class FingerprintKeys:
    """Chained 64-bit block names for large blocks (see the module docstring).

    A block's fingerprint is the sum of its 64-bit words (token pairs) times random odd
    64-bit weights, mod 2**64: one vectorised multiply-and-sum for all blocks of a prompt.
    The key chains it with the parent's key through Python's tuple hash of ints, which is
    deterministic across processes (``hash(bytes)`` is not). Equal prefixes get equal keys;
    different ones collide with probability ~2**-61, or ~2**-32 when two sibling blocks
    differ only in odd-position tokens -- fine for simulation, not for adversaries.
    """

    def __init__(self, seed: str, block_size: int) -> None:
        if block_size % 2:
            raise ValueError("FingerprintKeys needs an even block size")
        self.block_size = block_size
        digest = hashlib.blake2b(seed.encode(), digest_size=16, person=b"kvroute-simkeys").digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        w = rng.integers(0, 2**63, size=block_size // 2, dtype=np.uint64)
        self._w = w * np.uint64(2) + np.uint64(1)
        self._root = int.from_bytes(digest[:8], "little")

    def keys(self, tokens: bytes, parent: int | None = None) -> list[int]:
        half = self.block_size // 2
        n = len(tokens) // (half * 8)
        if not n:
            return []
        words = np.frombuffer(tokens, dtype="<u8", count=n * half).reshape(n, half)
        key = self._root if parent is None else parent
        out = []
        for fp in (words @ self._w).tolist():
            key = hash((key, fp)) & _MASK64
            out.append(key)
        return out


def make_key_function(kind: str, seed: str, block_size: int) -> KeyFunction:
    """``exact``: BlockKeyer; ``fingerprint``; ``auto``: exact up to 64-token blocks."""
    if kind == "auto":
        kind = "exact" if block_size <= 64 else "fingerprint"
    if kind == "exact":
        return TokenKeys(seed, block_size)
    if kind == "fingerprint":
        return FingerprintKeys(seed, block_size)
    raise ValueError(f"unknown key function {kind!r}; known: auto, exact, fingerprint")


# -- configuration ----------------------------------------------------------------------------


@dataclass
class ClusterConfig:
    """A simulated cluster: workers, engine, gateway and the delays between them."""

    workers: int = 8
    #: worker ids (a replayed log's); empty: ``worker-<i>``. Given, they set ``workers``
    names: list[str] = field(default_factory=list)
    policy: str = "ttft"
    policy_params: dict[str, Any] = field(default_factory=dict)
    # engine (per worker) -- the live sim's defaults
    kv_blocks: int = 16384
    block_size: int = 16  # engine block size = canonical block size
    timing: str = "mocker"
    speedup: float = 1.0
    #: what a step's quadratic prefill term is paid on ("batch", "sequence"; see
    #: loadtest/enginesim/timing.py)
    attention: Attention = "batch"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    eviction: Literal["block", "node"] = "block"  # vLLM trims LRU leaves block by block
    # vLLM caches a prompt's blocks when a step schedules them (SGLang: once computed)
    commit_on_schedule: bool = True
    cache_outputs: bool = True
    #: multiplies the engine's compute (prefill of T tokens costs what T/compute_scale cost
    #: one worker; decode unchanged); the pooled bound's single big worker uses it
    compute_scale: float = 1.0
    # gateway
    cost: CostParams = field(default_factory=CostParams)
    speculative_ttl: float = 5.0  # gateway default (index.speculative_ttl)
    tick_interval: float = 0.1  # the gateway's tick loop
    #: gateway replicas behind a round-robin front (Q4): each keeps its own shadow index
    #: (fed by every worker's events), load view (every report, its own requests in flight
    #: between reports), speculative inserts and policy state, as separate processes do
    replicas: int = 1
    #: replicas publish their speculative inserts to the others (the gateway's
    #: ``replicas.share_placements``, on by default), which apply them ``placement_lag`` later:
    #: a request's start goes out at once (``replicas.start_gap``), so the lag is the XADD,
    #: the others' read and the start's batching, a few ms
    share_placements: bool = True
    placement_lag: float = 0.002
    #: with ``share_placements``, replicas also share their requests' starts and ends and the
    #: prefixes they shared (the gateway's ``replicas.share_load``): each replica's load view
    #: and prefix rates count the others' requests (gateway/routing/remote.py)
    share_load: bool = True
    hash_seed: str = "kvroute-sim"
    keys: Literal["auto", "exact", "fingerprint"] = "auto"
    # agent -> Redis -> gateway
    event_lag: float = 0.02
    report_interval: float = 0.25  # worker_agent's report_interval default
    report_lag: float = 0.02
    report_prefill_tokens: bool = False  # the live agents cannot (engines do not export it)
    # run
    seed: int = 0
    slo_ttft_ms: float = 2000.0  # the driver's default

    def __post_init__(self) -> None:
        if self.names:
            if len(set(self.names)) != len(self.names):
                raise ValueError("worker names must be distinct")
            self.workers = len(self.names)
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.event_lag < 0 or self.report_lag < 0 or self.placement_lag < 0:
            raise ValueError("lags must be >= 0")
        if not (self.report_interval > 0 and self.tick_interval > 0 and self.compute_scale > 0):
            raise ValueError("report_interval, tick_interval and compute_scale must be > 0")
        if self.max_num_seqs >= self.max_num_batched_tokens:
            # decodes alone could then fill a step's token budget and stall prefills, which
            # the decode spans (see ClusterSim._plan) do not model
            raise ValueError("max_num_seqs must be below max_num_batched_tokens")

    def worker_names(self) -> list[str]:
        """``names``, or ``worker-<i>`` (the live stack's ids), so per-worker tables line up."""
        return list(self.names) or [f"worker-{i}" for i in range(self.workers)]

    def timing_model(self) -> TimingModel:
        base = timing_model(self.timing, self.speedup, self.attention)
        s = self.compute_scale
        if s == 1:
            return base
        return dataclasses.replace(
            base, prefill_a=base.prefill_a / (s * s), prefill_b=base.prefill_b / s
        )

    def new_engine(self) -> EngineCore:
        cache = CacheConfig(
            kv_blocks=self.kv_blocks,
            block_size=self.block_size,
            eviction=self.eviction,
            cache_outputs=self.cache_outputs,
        )
        sched = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill=self.chunked_prefill,
        )
        return EngineCore(
            cache,
            sched,
            self.timing_model(),
            evict_whole_nodes=self.eviction == "node",
            commit_on_schedule=self.commit_on_schedule,
        )


# -- results ----------------------------------------------------------------------------------


@dataclass
class RequestTable:
    """Per-request outcomes as columns (finish order), compact enough for a million rows."""

    index: array = field(default_factory=lambda: array("q"))
    worker: array = field(default_factory=lambda: array("q"))
    arrival: array = field(default_factory=lambda: array("d"))
    ttft: array = field(default_factory=lambda: array("d"))  # seconds
    e2e: array = field(default_factory=lambda: array("d"))
    prompt_tokens: array = field(default_factory=lambda: array("q"))
    cached_tokens: array = field(default_factory=lambda: array("q"))
    output_tokens: array = field(default_factory=lambda: array("q"))
    # prompt tokens the gateway's index predicted cached on the chosen worker (the decision's
    # match); against ``cached_tokens`` it gives the index precision (Q8)
    predicted_tokens: array = field(default_factory=lambda: array("q"))

    def __len__(self) -> int:
        return len(self.index)

    def rows(self) -> Iterator[dict[str, Any]]:
        cols = [f.name for f in dataclasses.fields(self)]
        for i in sorted(range(len(self)), key=self.index.__getitem__):
            yield {c: getattr(self, c)[i] for c in cols}

    def to_records(self, names: Sequence[str]) -> list[RequestRecord]:
        """The rows as the load driver's records (ITL: each request's mean gap, repeated)."""
        out = []
        for r in self.rows():
            n = int(r["output_tokens"])
            gap = (r["e2e"] - r["ttft"]) / (n - 1) if n > 1 else 0.0
            out.append(
                RequestRecord(
                    index=int(r["index"]),
                    session="",
                    scheduled=r["arrival"],
                    sent=r["arrival"],
                    ttft=r["ttft"],
                    e2e=r["e2e"],
                    itl=[gap] * (n - 1),
                    output_tokens=n,
                    prompt_tokens=int(r["prompt_tokens"]),
                    cached_tokens=int(r["cached_tokens"]),
                    worker=names[int(r["worker"])],
                    status=200,
                )
            )
        return out


@dataclass
class SimResult:
    """A run's outcome: the driver-format summary plus the simulator's own counters."""

    config: ClusterConfig
    summary: dict[str, Any]
    table: RequestTable
    duration: float  # virtual seconds from 0 to the last finish
    failed: dict[str, int]
    engine: dict[str, Any]  # engine and index counters

    @property
    def hit_rate(self) -> float:
        return float(self.summary["hit_rate"])

    def ttfts_ms(self) -> list[float]:
        """Sorted TTFTs in ms (the comparison's CDF plot input)."""
        return sorted(round(x * 1000.0, 2) for x in self.table.ttft)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "summary": self.summary,
            "sim": {"duration_s": round(self.duration, 3), "failed": self.failed, **self.engine},
        }


def summarize(
    table: RequestTable,
    names: Sequence[str],
    duration: float,
    slo_ttft_ms: float,
    failed: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``loadtest.driver.summarize`` computed on columns (same keys, same percentile rule).

    Differences: every worker appears in ``per_worker`` and the balance (the live driver only
    sees workers that answered); ITL percentiles weight each request's mean gap by its gaps.
    Added: ``index_precision`` as the live comparison reports it (Q8): of the tokens the
    index predicted cached, the share the engine reused, min(predicted, cached) per request
    (None when nothing was predicted).
    """
    failed = failed or {}
    n_ok = len(table)
    n_failed = sum(failed.values())
    ttft = np.frombuffer(table.ttft, dtype=np.float64) if n_ok else np.zeros(0)
    e2e = np.frombuffer(table.e2e, dtype=np.float64) if n_ok else np.zeros(0)
    out_tok = np.frombuffer(table.output_tokens, dtype=np.int64) if n_ok else np.zeros(0, np.int64)
    prompt = np.frombuffer(table.prompt_tokens, dtype=np.int64) if n_ok else np.zeros(0, np.int64)
    cached = np.frombuffer(table.cached_tokens, dtype=np.int64) if n_ok else np.zeros(0, np.int64)
    worker = np.frombuffer(table.worker, dtype=np.int64) if n_ok else np.zeros(0, np.int64)

    def pct(xs: np.ndarray, q: float) -> float | None:
        return None if not len(xs) else round(float(np.percentile(xs, q * 100)) * 1000.0, 2)

    gaps = out_tok - 1
    has_gap = gaps > 0
    itl_vals = ((e2e - ttft)[has_gap] / gaps[has_gap]) if n_ok else np.zeros(0)
    itl_w = gaps[has_gap]
    n_w = len(names)
    req_w = np.bincount(worker, minlength=n_w)
    prompt_w = np.bincount(worker, weights=prompt, minlength=n_w)
    cached_w = np.bincount(worker, weights=cached, minlength=n_w)
    per_worker: dict[str, dict[str, float]] = {}
    for i, name in enumerate(names):
        p, c = float(prompt_w[i]), float(cached_w[i])
        per_worker[name] = {
            "requests": int(req_w[i]),
            "prompt_tokens": int(p),
            "cached_tokens": int(c),
            "hit_rate": round(c / p, 4) if p else 0.0,
        }
    total = n_ok + n_failed
    good = int(np.count_nonzero(ttft * 1000.0 <= slo_ttft_ms))
    sum_prompt, sum_cached = int(prompt.sum()), int(cached.sum())
    pred = np.frombuffer(table.predicted_tokens, dtype=np.int64) if n_ok else np.zeros(0, np.int64)
    sum_pred = int(pred.sum())
    agreed = int(np.minimum(pred, cached).sum()) if sum_pred else 0
    errors = {k: v for k, v in failed.items() if v}
    return {
        "requests": total,
        "ok": n_ok,
        "failed": n_failed,
        "errors": errors,
        "duration_s": round(duration, 2),
        "throughput_rps": round(n_ok / duration, 3) if duration > 0 else 0.0,
        "output_tokens_per_s": round(float(out_tok.sum()) / duration, 1) if duration > 0 else 0.0,
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p90_ms": pct(ttft, 0.9),
        "ttft_p99_ms": pct(ttft, 0.99),
        "ttft_mean_ms": round(float(ttft.mean()) * 1000.0, 2) if n_ok else None,
        "itl_p50_ms": _weighted_pct_ms(itl_vals, itl_w, 0.5),
        "itl_p99_ms": _weighted_pct_ms(itl_vals, itl_w, 0.99),
        "e2e_p50_ms": pct(e2e, 0.5),
        "e2e_p99_ms": pct(e2e, 0.99),
        "slo_ttft_ms": slo_ttft_ms,
        "goodput": round(good / total, 4) if total else 0.0,
        "goodput_rps": round(good / duration, 3) if duration > 0 else 0.0,
        "hit_rate": round(sum_cached / sum_prompt, 4) if sum_prompt else 0.0,
        "prompt_tokens": sum_prompt,
        "cached_tokens": sum_cached,
        "predicted_tokens": sum_pred,
        "index_precision": round(agreed / sum_pred, 4) if sum_pred else None,
        "per_worker": per_worker,
        **balance(
            {w: v["requests"] for w, v in per_worker.items()},
            {w: v["prompt_tokens"] for w, v in per_worker.items()},
        ),
    }


def _weighted_pct_ms(values: np.ndarray, weights: np.ndarray, q: float) -> float | None:
    """Percentile of ``values`` each repeated ``weights`` times (the driver's linear rule)."""
    if not len(values):
        return None
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    ends = np.cumsum(w)  # value i covers ranks [ends[i] - w[i], ends[i])
    k = (ends[-1] - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    vlo = v[np.searchsorted(ends, lo, side="right")]
    vhi = v[np.searchsorted(ends, hi, side="right")]
    return round(float(vlo + (vhi - vlo) * (k - lo)) * 1000.0, 2)


# -- the simulator ----------------------------------------------------------------------------

# worker modes
_IDLE, _STEP, _SPAN = 0, 1, 2
# heap event kinds, in the order they run when simultaneous (load reports have their own
# queues, see ``run``)
_BUS, _TICK, _WORKER, _SHARED = 0, 1, 2, 3
# index operations carried by a bus delivery
_STORE, _REMOVE, _CLEAR = 0, 1, 2


@dataclass(slots=True, eq=False)
class _Flight:
    """A request in flight: what the gateway remembers about it."""

    index: int
    at: float
    ticket: Ticket
    worker: int
    router: Router  # the replica that routed it (and accounts for it)
    first: float = 0.0


_GLIBC_PAD = 128 << 10  # glibc's default M_TRIM_THRESHOLD and M_TOP_PAD
_M_TRIM_THRESHOLD, _M_TOP_PAD = -1, -2


def _malloc_pad(nbytes: int) -> bool:
    """Set glibc's heap trim threshold and top pad to ``nbytes``; False where there is no
    glibc (the run is the same, only slower)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, nbytes)) and bool(mallopt(_M_TOP_PAD, nbytes))


def _mean_free(vals: tuple[Any, ...] | None) -> bool:
    """Whether a report with these load values gives a view that does not depend on the
    pool's mean prompt (``LoadTracker.report`` turns waiting requests into queued tokens at
    that mean, which every request sent anywhere moves): no request waiting, or the engine
    reporting its waiting prompt tokens itself."""
    return vals is not None and (vals[1] == 0 or vals[3] is not None)


def _report_order(report: tuple[float, Any, tuple[Any, ...], int]) -> tuple[float, float]:
    """Where a report stands in the queue: arrival time, then sampling time."""
    return report[0], report[2][3]


class _Worker:
    """One engine and its driver state (see the module docstring for the modes)."""

    __slots__ = (
        "blocked",
        "blocks",
        "clock",
        "core",
        "finishes",
        "ghost",
        "i",
        "mode",
        "muts",
        "name",
        "pending",
        "queued",
        "rep_at",
        "rep_mean",
        "rep_muts",
        "rep_vals",
        "span_dt",
        "span_start",
        "touched_at",
        "version",
    )

    def __init__(self, i: int, name: str, core: EngineCore) -> None:
        self.i = i
        self.name = name
        self.core = core
        self.mode = _IDLE
        self.pending: StepResult | None = None
        self.span_start = 0.0
        self.span_dt = 0.0
        self.version = 0  # bumps invalidate this worker's queued events
        self.blocked = False  # the queue's head was refused and nothing finished since
        self.clock = 0  # the engine's decode clock (decode iterations so far)
        self.finishes: list[int] = []  # decode clock at which each decoding request ends
        self.blocks: dict[int, int] = {}  # engine block id -> canonical key (the agent's map)
        self.rep_vals: tuple[Any, ...] | None = None  # load values of the last applied report
        self.rep_at = -_INF  # when it was applied
        # the pool's mean prompt then: a report's waiting requests become queued tokens at it
        self.rep_mean = -1.0
        self.muts = 0  # calls that may have changed the engine (requests added, steps run)
        self.rep_muts = -1  # ``muts`` when the last applied report was sampled
        self.queued = 0  # its reports sampled and not yet applied
        # a report left out of the queue because it repeats the last one (``_sample``)
        self.ghost: tuple[float, _Worker, tuple[Any, ...], int] | None = None
        # when the gateway's own accounting of this worker last changed: a request sent, a
        # first token, a finish (each moves counters a report would reset)
        self.touched_at = -_INF


class ClusterSim:
    """One simulated cluster; ``run`` a request stream through it once."""

    #: skip load reports that provably change nothing (see ``_report``); tests turn it off
    skip_redundant_reports = True
    #: decode spans (see ``_plan``); off = one ``step`` call per engine step like the live
    #: worker (tests check both give the same run)
    fast_forward = True
    #: the cyclic garbage collector's thresholds during ``run`` (restored after; None: left
    #: alone). A large run keeps millions of long-lived containers (cache and index nodes,
    #: requests in flight) and allocates short-lived ones per event: at Python's default
    #: (700, 10, 10) collections took 12-14% of a 2,048-worker run's CPU and found nothing
    #: to free (per-request results are identical with the collector off). Reference counting
    #: frees almost everything here; the rarer collections still reclaim any cycle.
    gc_thresholds: tuple[int, int, int] | None = (100_000, 20, 100)
    #: glibc's heap trim threshold and top pad during ``run`` (bytes; glibc's 128 KiB
    #: defaults after; None: left alone). Each arrival's prompt is tens of kilobytes and the
    #: engines' caches grow for the whole run: at the defaults the heap is handed back to
    #: the kernel and faulted in again, 10-15% of a 2,048-worker run in the kernel.
    malloc_pad: int | None = 256 << 20

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        cfg = config
        self.names = cfg.worker_names()
        self.keyfn = make_key_function(cfg.keys, cfg.hash_seed, cfg.block_size)
        #: one (index, router) per gateway replica; arrivals go to them in turn
        self.indexes: list[ShadowIndex] = []
        self.routers: list[Router] = []
        for r in range(cfg.replicas):
            index = ShadowIndex(speculative_ttl=cfg.speculative_ttl)
            self.indexes.append(index)
            self.routers.append(
                Router(
                    make_policy(cfg.policy, **cfg.policy_params),
                    cfg.block_size,
                    index=index,
                    cost=CostModel(dataclasses.replace(cfg.cost)),
                    rng=random.Random(cfg.seed if r == 0 else cfg.seed * 1_000_003 + r),
                )
            )
        self.index = self.indexes[0]
        self.router = self.routers[0]
        self._next_replica = 0
        self._share = cfg.share_placements and cfg.replicas > 1
        self._remote = [RemoteRequests() for _ in self.routers]
        self._replica_of = {id(router): r for r, router in enumerate(self.routers)}
        if self._share:
            for index in self.indexes:
                index.outbox = []
            if cfg.share_load:
                for router in self.routers:
                    router.journal = []
        self._routed = [0] * cfg.replicas
        self.workers = [_Worker(i, n, cfg.new_engine()) for i, n in enumerate(self.names)]
        self._by_name = {w.name: w for w in self.workers}
        for w in self.workers:
            for router, index in zip(self.routers, self.indexes, strict=True):
                router.add_worker(w.name)
                index.add_worker(w.name)
        # without index use (round robin, ...) KV events need not be turned into keys
        self._index_events = self.router.policy.uses_index
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        # load reports: sampling schedule cursor, and samples on their way (constant lag)
        self._next_sample = _INF
        self._sample_i = 0
        self._sample_k = 0
        self._reports: deque[tuple[float, _Worker, tuple[Any, ...], int]] = deque()
        self._table = RequestTable()
        self._failed: dict[str, int] = {}
        self._inflight = 0
        self._more = True  # arrivals not exhausted
        self._last_finish = 0.0
        self._stats = {
            "steps": 0,
            "step_calls": 0,
            "spans": 0,
            "interrupts": 0,
            "stalls": 0,
            "reports_skipped": 0,
            "reports_revived": 0,
            "warmups": 0,
            "warmup_tokens": 0,
        }
        self._ran = False
        #: sets glibc's heap pad (``malloc_pad``); an attribute so that tests can watch it
        self.pad_heap: Callable[[int], bool] = _malloc_pad
        #: called just before / after each arrival's routing decision, and for each warm-up
        #: sent (tests and ``presettrace`` observe decisions and the state they saw; the
        #: compiled simulator's and router's methods cannot be replaced or overridden)
        self.before_route: Callable[[Arrival], None] | None = None
        self.after_route: Callable[[Arrival, Decision], None] | None = None
        self.on_warmup: Callable[[WarmupIntent, float], None] | None = None

    # -- public -------------------------------------------------------------------------------

    def run(
        self,
        arrivals: Iterable[Arrival],
        progress: Callable[[int], None] | None = None,
        progress_every: int = 1000,
    ) -> SimResult:
        """Simulate ``arrivals`` (sorted by ``at``) to the end; ``progress(n)`` gets the number
        of arrivals processed every ``progress_every`` of them."""
        if self._ran:
            raise RuntimeError("a ClusterSim runs once; build a new one")
        self._ran = True
        before = gc.get_threshold()
        if self.gc_thresholds is not None:
            gc.set_threshold(*self.gc_thresholds)
        padded = self.malloc_pad is not None and self.pad_heap(self.malloc_pad)
        try:
            return self._run(arrivals, progress, progress_every)
        finally:
            gc.set_threshold(*before)
            if padded:
                self.pad_heap(_GLIBC_PAD)

    def _run(
        self,
        arrivals: Iterable[Arrival],
        progress: Callable[[int], None] | None,
        progress_every: int,
    ) -> SimResult:
        cfg = self.config
        heap = self._heap
        reports = self._reports
        self._push(0.0, _TICK, None, None)
        it = iter(arrivals)
        nxt = next(it, None)
        self._more = nxt is not None
        self._next_sample = cfg.report_interval * 0.5 / len(self.workers)
        done = 0
        last_at = -_INF
        pop = heapq.heappop
        inf = _INF
        # Four sources, in this order at equal times: load reports reaching the gateway,
        # heap events (bus deliveries, ticks, engine steps), load samples, arrivals.
        while True:
            t_heap = heap[0][0] if heap else inf
            t_arr = nxt.at if nxt is not None else inf
            t_rep = reports[0][0] if reports else inf
            t_smp = self._next_sample
            if t_rep <= t_heap and t_rep <= t_smp and t_rep <= t_arr:
                if t_rep == inf:
                    break
                t, w, sample, muts = reports.popleft()
                self._report(w, sample, muts, t)
            elif t_heap <= t_smp and t_heap <= t_arr:
                t, kind, _, a, b = pop(heap)
                if kind == _WORKER:
                    self._worker_event(a, b, t)
                elif kind == _BUS:
                    self._apply(a, b, t)
                elif kind == _SHARED:
                    self._shared(a, b, t)
                else:
                    for router in self.routers:
                        router.tick(t)
                    if self._more or self._inflight:
                        self._push(t + cfg.tick_interval, _TICK, None, None)
            elif t_smp <= t_arr:
                self._sample(t_smp)
            else:
                assert nxt is not None
                if nxt.at < last_at:
                    raise ValueError(f"arrivals out of order at request {nxt.index}")
                last_at = nxt.at
                self._arrive(nxt)
                done += 1
                if progress is not None and done % progress_every == 0:
                    progress(done)
                nxt = next(it, None)
                if nxt is None:
                    self._more = False
        if progress is not None and done % progress_every:
            progress(done)
        return self._result()

    # -- arrivals -----------------------------------------------------------------------------

    def _arrive(self, a: Arrival) -> None:
        t = a.at
        tokens = a.tokens
        n = len(tokens) // TOKEN_BYTES
        r = self._next_replica
        router = self.routers[r]
        self._next_replica = r + 1 if r + 1 < len(self.routers) else 0
        self._routed[r] += 1
        keys = self.keyfn.keys(tokens)
        exclude = () if a.workers is None else self._by_name.keys() - a.workers
        if self.before_route is not None:
            self.before_route(a)
        decision = router.route(keys, n, t, session_key=a.session, exclude=exclude)
        if self.after_route is not None:
            self.after_route(a, decision)
        for intent in router.ctx.warmups.drain():
            self._warm(router, intent, tokens, t)
        ticket = router.started(decision, n, t)
        if self._share:  # this replica's speculative inserts and journal go out
            self._send(r, t)
        w = self._by_name[decision.worker]
        w.touched_at = t
        if w.ghost is not None:
            self._revive(w, t)
        if w.mode == _SPAN:
            self._interrupt(w, t)
        flight = _Flight(a.index, t, ticket, w.i, router)
        w.muts += 1
        try:
            w.core.add_request(tokens, a.max_tokens, t, tag=flight, output=a.output)
        except ValueError as exc:  # RequestTooLarge or a malformed request: the engine's 400
            router.finished(ticket, t)
            reason = type(exc).__name__
            self._failed[reason] = self._failed.get(reason, 0) + 1
            return
        self._inflight += 1
        if w.mode == _IDLE:
            self._plan(w, max(t, w.core.free_at))

    def _warm(self, router: Router, intent: WarmupIntent, tokens: bytes, t: float) -> None:
        """A warm-up the policy asked for, as the gateway sends it (``gateway/warmup.py``):
        the prefix alone with one output token, counted as load, not as a request."""
        if self.on_warmup is not None:
            self.on_warmup(intent, t)
        w = self._by_name[intent.worker]
        decision = Decision(w.name, "warmup", "warmup", 0, None)
        flight = _Flight(-1, t, router.started(decision, intent.tokens, t), w.i, router)
        w.touched_at = t
        if w.ghost is not None:
            self._revive(w, t)
        if w.mode == _SPAN:
            self._interrupt(w, t)
        w.muts += 1
        w.core.add_request(tokens[: intent.tokens * TOKEN_BYTES], 1, t, tag=flight)
        self._inflight += 1
        self._stats["warmups"] += 1
        self._stats["warmup_tokens"] += intent.tokens
        if w.mode == _IDLE:
            self._plan(w, max(t, w.core.free_at))

    def _interrupt(self, w: _Worker, t: float) -> None:
        """An arrival at ``t`` during a decode span: run the span's steps that started
        before ``t`` in one fast-forward; the last of them is in flight at ``t`` and the new
        request waits for the step after it, as on a live engine."""
        w.version += 1  # the span's end event is stale
        self._stats["interrupts"] += 1
        start, dt = w.span_start, w.span_dt
        k = math.ceil((t - start) / dt)
        if k <= 0:  # the span had not begun: the engine is free at ``t``
            w.mode = _IDLE
            return
        # ``until`` half a step past the k-th step end: immune to rounding in the engine's
        # int((until - start) / dt)
        self._pend(w, self._step(w, start, start + (k + 0.5) * dt))

    # -- workers ------------------------------------------------------------------------------

    def _step(self, w: _Worker, now: float, until: float | None) -> StepResult:
        w.muts += 1
        res = w.core.step(now, until)
        st = self._stats
        st["step_calls"] += 1
        st["steps"] += res.steps
        return res

    def _pend(self, w: _Worker, res: StepResult) -> None:
        w.mode = _STEP
        w.pending = res
        w.version += 1
        self._push(res.end, _WORKER, w, w.version)

    def _plan(self, w: _Worker, now: float) -> None:
        """The engine is free at ``now``: start its next step, or a decode span, or idle.

        The next steps are decode-only until a request finishes when nothing is queued or
        prefilling, or when the queue's head was just refused (memory, ``max_num_seqs``) and
        no request finished since: a refused head stays refused until a finish frees room,
        and later arrivals queue behind it.
        """
        core = w.core
        if not core.has_work():
            w.mode = _IDLE
            return
        if self.fast_forward and (w.blocked or core.waiting_prompt_tokens == 0):
            fin = w.finishes
            while fin and fin[0] <= w.clock:
                heapq.heappop(fin)
            k = fin[0] - w.clock
            if k > 1:
                # Like a live engine, the span's last step is computed when it starts (its
                # finishes show in the engine's state from then on): the span's event.
                w.mode = _SPAN
                w.span_start = now
                w.span_dt = core.timing.step_seconds(0, core.num_running, core.kv_usage)
                w.version += 1
                self._stats["spans"] += 1
                self._push(now + (k - 1) * w.span_dt, _WORKER, w, w.version)
                return
        res = self._step(w, now, None)
        if not res.steps:  # nothing schedulable (cannot happen with a consistent engine)
            self._stats["stalls"] += 1
            w.mode = _IDLE
            return
        w.blocked = res.prefill_tokens == 0 and core.num_waiting > 0 and not res.finished
        self._pend(w, res)

    def _worker_event(self, w: _Worker, version: int, t: float) -> None:
        if version != w.version:
            return
        if w.mode == _STEP:
            res = w.pending
            assert res is not None
            w.pending = None
            self._deliver(w, res)
        else:  # _SPAN: its last step starts now; run the whole span, deliver at its end
            res = self._step(w, w.span_start, _INF)
            if abs(res.end - t - w.span_dt) > 1e-9 * max(1.0, t) or not res.finished:
                raise AssertionError(
                    f"{w.name}: decode span predicted to end at {t + w.span_dt}, "
                    f"the engine ended it at {res.end}"
                )
            self._pend(w, res)
            return
        self._plan(w, t)

    def _deliver(self, w: _Worker, res: StepResult) -> None:
        """What a step produced, at its end: first tokens, finishes, KV events."""
        now = res.end
        if res.decode_seqs:
            w.clock += res.steps
        if res.first_token or res.finished:
            w.touched_at = now
            if w.ghost is not None:
                self._revive(w, now)
        for req in res.first_token:
            f: _Flight = req.tag
            f.first = now
            f.router.first_token(f.ticket, now)
            if f.router.journal:
                self._send(self._replica_of[id(f.router)], now)
            if req.max_tokens > 1:
                heapq.heappush(w.finishes, w.clock + req.max_tokens - 1)
        if res.finished:
            w.blocked = False  # a finish frees blocks and a sequence slot
            tab = self._table
            for req in res.finished:
                f = req.tag
                f.router.finished(f.ticket, now)
                if f.router.journal:
                    self._send(self._replica_of[id(f.router)], now)
                if f.index < 0:  # a warm-up: cost, not a request
                    continue
                tab.index.append(f.index)
                tab.worker.append(f.worker)
                tab.arrival.append(f.at)
                tab.ttft.append(f.first - f.at)
                tab.e2e.append(now - f.at)
                tab.prompt_tokens.append(req.prompt_len)
                tab.cached_tokens.append(req.cached_tokens)
                tab.output_tokens.append(req.max_tokens)
                tab.predicted_tokens.append(f.ticket.decision.matched_tokens)
            self._inflight -= len(res.finished)
            self._last_finish = max(self._last_finish, now)
        if res.events and self._index_events:
            self._emit(w, res.events, now)

    # -- agent, bus, consumer ---------------------------------------------------------------------

    def _emit(self, w: _Worker, events: list[KVEvent], now: float) -> None:
        """Engine events -> canonical index operations (the agent), delivered after the lag."""
        ops: list[tuple[int, int | None, list[int]]] = []
        blocks = w.blocks
        keys_of = self.keyfn.keys
        for ev in events:
            if isinstance(ev, BlocksStored):
                pid = ev.parent_block_id
                parent = None if pid is None else blocks[pid]
                keys = keys_of(ev.tokens, parent)
                blocks.update(zip(ev.block_ids, keys, strict=True))
                ops.append((_STORE, parent, keys))
            elif isinstance(ev, BlocksRemoved):
                # deepest first: an evicted leaf tail then leaves the index's run from its end
                # (ShadowIndex's cheap path) instead of splitting it key by key; same result
                pop = blocks.pop
                ops.append((_REMOVE, None, [pop(b) for b in reversed(ev.block_ids)]))
            elif isinstance(ev, AllBlocksCleared):
                blocks.clear()
                ops.append((_CLEAR, None, []))
        self._push(now + self.config.event_lag, _BUS, w, ops)

    def _send(self, r: int, t: float) -> None:
        """Replica ``r``'s speculative inserts and journal notes, on their way to the others."""
        outbox = self.indexes[r].outbox
        journal = self.routers[r].journal
        assert outbox is not None
        if outbox or journal:
            notes = list(journal) if journal else []
            self._push(t + self.config.placement_lag, _SHARED, r, (list(outbox), notes))
            outbox.clear()
            if journal:
                journal.clear()

    def _shared(self, source: int, payload: Any, t: float) -> None:
        """A replica's speculative inserts reach the others (``ShadowIndex.adopt``), and its
        requests their load views and prefix rates (``RemoteRequests``)."""
        items, notes = payload
        origin = str(source)
        for r, index in enumerate(self.indexes):
            if r != source:
                for worker, parent, keys in items:
                    index.adopt(worker, parent, keys, t)
                if notes:
                    self._remote[r].apply(origin, "", self.routers[r], notes, t)

    def _apply(self, w: _Worker, payload: Any, t: float) -> None:
        name = w.name
        for index in self.indexes:  # every replica consumes every worker's stream
            for op, parent, keys in payload:
                if op == _STORE:
                    index.stored(name, parent, keys)
                elif op == _REMOVE:
                    index.removed(name, keys)
                else:
                    index.cleared(name)

    def _sample(self, t: float) -> None:
        """An agent scrapes its engine's /metrics; the report reaches the gateway later.

        Worker i's agent samples at ``(k + (i + 0.5) / N) * report_interval``: staggered
        phases, one schedule for all (a cursor, no per-report heap traffic).

        Most samples of a large cluster repeat the last applied report of an engine that
        nothing touched since (``_report`` then skips them). Such a sample is not read from
        the engine nor queued: it is kept aside as the worker's ``ghost``, and queued in its
        place only if the gateway touches the worker before it would have arrived
        (``_revive``), the one case in which ``_report`` would apply it.
        """
        cfg = self.config
        w = self.workers[self._sample_i]
        due = t + cfg.report_lag
        if (
            w.muts == w.rep_muts  # the engine is as it was when that report was sampled
            and _mean_free(w.rep_vals)  # its view cannot move with the pool's mean prompt
            and not w.queued
            and (w.ghost is None or w.ghost[0] <= t)  # nor one left aside that may still be
            and w.touched_at < w.rep_at
            and due - w.rep_at < self.router.loads.report_ttl / 2
            and self.skip_redundant_reports
            and len(self.routers) == 1  # the skip rule reads one load view
        ):
            st = w.core.stats
            w.ghost = (due, w, (w.rep_vals, st.cache_queries, st.cache_hits, t), w.muts)
            self._stats["reports_skipped"] += 1
        else:
            core = w.core
            st = core.stats
            wpt = core.waiting_prompt_tokens if cfg.report_prefill_tokens else None
            vals = (core.num_running, core.num_waiting, core.kv_usage, wpt)
            self._reports.append((due, w, (vals, st.cache_queries, st.cache_hits, t), w.muts))
            w.queued += 1
        n = len(self.workers)
        self._sample_i += 1
        if self._sample_i == n:
            self._sample_i = 0
            self._sample_k += 1
        if self._more or self._inflight:
            self._next_sample = (self._sample_k + (self._sample_i + 0.5) / n) * cfg.report_interval
        else:
            self._next_sample = _INF

    def _revive(self, w: _Worker, now: float) -> None:
        """The gateway touched ``w`` (its counters moved) before its ghost report arrives:
        that report now changes the view, so it joins the queue in its sampling order."""
        ghost = w.ghost
        w.ghost = None
        if ghost is None or ghost[0] <= now:  # arrived (and skipped) already
            return
        reports = self._reports
        at = (ghost[0], ghost[2][3])
        reports.insert(bisect.bisect_right(reports, at, key=_report_order), ghost)
        w.queued += 1
        self._stats["reports_skipped"] -= 1
        self._stats["reports_revived"] += 1

    def _report(self, w: _Worker, sample: tuple[Any, ...], muts: int, t: float) -> None:
        """Apply a load report, unless it provably changes nothing.

        ``LoadTracker.report`` with the same load values as the last applied report, no
        request sent, prefilled or finished on the worker since that one (so nothing is
        counted as "sent", "prefilled" or "finished since the report"), the pool's mean
        prompt unchanged where the view depends on it (``_mean_free``) and that report still
        far from its TTL yields the same view; skipping it only saves time (most reports of
        a large cluster repeat the previous one).
        """
        w.queued -= 1
        vals, queries, hits, ts = sample
        loads = self.router.loads
        if (
            vals == w.rep_vals
            and (_mean_free(vals) or loads.mean_prompt_tokens == w.rep_mean)
            and w.touched_at < w.rep_at
            and t - w.rep_at < loads.report_ttl / 2
            and self.skip_redundant_reports
            and len(self.routers) == 1
        ):
            self._stats["reports_skipped"] += 1
            return
        running, waiting, kv, wpt = vals
        rep = EngineReport(running, waiting, kv, wpt, queries, hits, ts)
        for router in self.routers:  # every replica reads every worker's reports
            router.loads.report(w.name, rep, t)
        w.rep_vals = vals
        w.rep_at = t
        w.rep_muts = muts
        w.rep_mean = loads.mean_prompt_tokens

    def _push(self, t: float, kind: int, a: Any, b: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, a, b))

    # -- results ------------------------------------------------------------------------------

    def _result(self) -> SimResult:
        cfg = self.config
        duration = self._last_finish
        engine = {
            **self._stats,
            "engine_prompt_tokens": sum(w.core.stats.cache_queries for w in self.workers),
            "engine_cached_tokens": sum(w.core.stats.cache_hits for w in self.workers),
            "index": dataclasses.asdict(self.index.stats),
            "index_entries": self.index.entries(),
            "cost_scale": round(self.router.ctx.cost.scale, 4),
            "routed_per_replica": list(self._routed),
        }
        summary = summarize(self._table, self.names, duration, cfg.slo_ttft_ms, self._failed)
        return SimResult(cfg, summary, self._table, duration, dict(self._failed), engine)


# -- entry points -----------------------------------------------------------------------------


def simulate(
    arrivals: Iterable[Arrival],
    config: ClusterConfig,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Run ``arrivals`` through a fresh cluster of ``config``."""
    return ClusterSim(config).run(arrivals, progress)


def pooled_config(config: ClusterConfig) -> ClusterConfig:
    """The pooled-cache bound's cluster: ONE worker with N x everything of ``config``'s.

    N x KV blocks (the pooled cache), and N x compute so that it is exactly as loaded as the
    N workers together: N x ``max_num_seqs`` and ``max_num_batched_tokens`` (N workers' batches
    in one step) and a step time model in which prefilling T tokens costs what T / N cost
    one worker (``compute_scale``), decode steps unchanged. A full step of N x 8192 prefill
    tokens therefore takes as long as one worker's 8192-token step. No routing is involved.
    Only its hit rate is a bound: its TTFTs are not (a lone prompt prefills N x faster).
    """
    n = config.workers
    return dataclasses.replace(
        config,
        workers=1,
        names=[],
        policy="round_robin",
        policy_params={},
        kv_blocks=config.kv_blocks * n,
        max_num_seqs=config.max_num_seqs * n,
        max_num_batched_tokens=config.max_num_batched_tokens * n,
        compute_scale=config.compute_scale * n,
    )


def pooled_bound(
    arrivals: Iterable[Arrival],
    config: ClusterConfig,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Target Q1's reference: the hit rate of ``pooled_config(config)`` on the same stream.

    Every block cached anywhere in the cluster is cached once in one LRU pool of the cluster's
    total size and every request sees all of it, so no routing can do better, up to
    second-order effects (one LRU order instead of N; faster prefill caches blocks sooner)
    that in the tests leave the bound above every policy. Hit rate = cached prompt tokens /
    prompt tokens as the engine counts them.
    """
    return ClusterSim(pooled_config(config)).run(arrivals, progress)


@dataclass
class CapacityProbe:
    rate: float
    ok: bool
    ttft_p99_ms: float | None
    hit_rate: float
    throughput_rps: float
    failed: int


@dataclass
class CapacityResult:
    """``rate`` (req/s): see ``estimate_capacity`` for the definition."""

    rate: float
    limit_ms: float  # the p99 TTFT allowed
    reference_ms: float  # p99 of the unloaded cold prefill times
    ttft_factor: float
    probes: list[CapacityProbe]
    definition: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CAPACITY_DEFINITION = (
    "capacity = the highest offered rate (req/s; the workload's arrival times scaled to it, as "
    "loadtest.compare does) at which the cluster under the given policy keeps p99 TTFT <= "
    "ttft_factor x the p99 of the requests' unloaded cold prefill times (each prompt prefilled "
    "alone on an idle worker, no cache); found by doubling, then "
    "bisection to rel_tol. Past the saturation throughput p99 TTFT grows tenfold within ~20% "
    "more load, so this locates the knee of the latency curve rather than a latency target."
)


def cold_prefill_p99_ms(arrivals: Iterable[Arrival], config: ClusterConfig) -> float:
    """p99 over requests of the time to prefill the whole prompt on an idle worker.

    A property of the workload and the engine model only (no routing, no cache, no rate):
    the fixed yardstick the capacity criterion compares TTFTs against.
    """
    t = config.timing_model()
    chunk = config.max_num_batched_tokens
    times = [t.cold_prefill_seconds(a.prompt_tokens, chunk) for a in arrivals]
    return float(np.percentile(times, 99)) * 1000.0 if times else 0.0


def estimate_capacity(
    source: Callable[[float], Iterable[Arrival]],
    config: ClusterConfig,
    *,
    reference: Iterable[Arrival],
    ttft_factor: float = 3.0,
    start_rate: float | None = None,
    rel_tol: float = 0.05,
    max_probes: int = 16,
    progress: Callable[[CapacityProbe], None] | None = None,
) -> CapacityResult:
    """The request rate the cluster sustains (see ``CAPACITY_DEFINITION``).

    ``source(rate)``: the workload's stream retimed to ``rate`` req/s (fresh each call);
    ``reference``: the same requests (any timing) for the unloaded yardstick. A probe passes
    when p99 TTFT <= ``ttft_factor`` x reference (the simulator fails only requests larger
    than a worker's KV pool, at any rate; they do not count). Doubling from
    ``start_rate`` (default: one request per second per worker) brackets the answer, then
    bisection narrows it to ``rel_tol``; the result is the highest passing rate.
    """
    ref = cold_prefill_p99_ms(reference, config)
    limit = ttft_factor * ref
    probes: list[CapacityProbe] = []

    def probe(rate: float) -> bool:
        res = simulate(source(rate), config)
        s = res.summary
        p99 = s["ttft_p99_ms"]
        ok = p99 is not None and p99 <= limit
        pr = CapacityProbe(rate, ok, p99, s["hit_rate"], s["throughput_rps"], s["failed"])
        probes.append(pr)
        if progress is not None:
            progress(pr)
        return ok

    rate = start_rate or float(config.workers)
    lo, hi = 0.0, _INF
    if probe(rate):
        lo = rate
        while len(probes) < max_probes:
            rate *= 2
            if not probe(rate):
                hi = rate
                break
            lo = rate
    else:
        hi = rate
        while len(probes) < max_probes:
            rate /= 2
            if probe(rate):
                lo = rate
                break
            hi = rate
    while lo > 0 and math.isfinite(hi) and (hi - lo) > rel_tol * hi and len(probes) < max_probes:
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return CapacityResult(
        lo, round(limit, 2), round(ref, 2), ttft_factor, probes, CAPACITY_DEFINITION
    )
