"""``kvroute simulate``: the offline cluster simulator on a workload or a Mooncake trace.

The simulation itself is ``loadtest.clustersim`` (pure); this module builds its request streams
and is its command line:

* ``workload_arrivals``: a text workload (chat, agent, shared_prefix) tokenized exactly as the
  live path sends it (``mode``: ``chat`` renders the chat template like the gateway and the
  engine do; ``completion`` encodes the joined text with special tokens; ``completion_ids``
  concatenates per-segment ids, the driver's token-id mode);
* ``trace_arrivals``: a Mooncake-format JSONL trace, streamed (constant memory). Each hash id
  becomes a run of ``block_tokens`` copies of one token id (``id + 2``; the engines' caches
  only compare tokens, so any distinct content per id shares prefixes exactly as the trace
  says). ``TraceWorkload`` draws 512 random ids per block in Python and keeps every block,
  which is ~150 µs per block and unbounded memory at a million requests;
* ``compare_reference``: the two numbers ``loadtest.compare`` needs (pooled-cache bound and
  capacity) for a compare configuration.

Examples::

    kvroute simulate --workload chat --workers 8 --kv-blocks 2048 --bound --capacity
    kvroute simulate --gen-trace trace.jsonl --requests 50000 --duration-s 600
    kvroute simulate --trace trace.jsonl --workers 64 --compare-policies ttft,round_robin
    kvroute simulate --from-log 'gw-requests.jsonl*' --compare ttft,prefix,round_robin --plot out/

``--from-log`` replays a gateway request log (``request_log.path``; ``loadtest/replay.py``):
the captured arrivals, key chains, lengths and candidate workers, under any policy and
``--policy-param`` values; each result says how often it chose the worker the live gateway
chose.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import yaml
from tqdm import tqdm

from loadtest.clustersim import (
    Arrival,
    CapacityProbe,
    CapacityResult,
    ClusterConfig,
    RequestTable,
    SimResult,
    estimate_capacity,
    pooled_bound,
    retime,
    simulate,
    summarize,
)
from loadtest.replay import ANSWERS, CapturedLog, agreement, read_log
from loadtest.report import format_table
from loadtest.workloads import WorkItem, make_workload, tokenize_segments, write_synthetic_trace

__all__ = [
    "TraceInfo",
    "compare_reference",
    "for_comparison",
    "items_arrivals",
    "scan_trace",
    "trace_arrivals",
    "workload_arrivals",
]

#: KV capacity per worker when --kv-blocks is not given: the live sim's 16384 x 16 tokens
DEFAULT_KV_TOKENS = 16384 * 16
TRACE_BLOCK_TOKENS = 512


# -- request streams ------------------------------------------------------------------------


def workload_arrivals(
    kind: str,
    params: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    mode: str = "chat",
    tokenizer: Any = None,
    chat_template: str = "deepseek-v3",
) -> list[Arrival]:
    """A text workload's requests as the engines will see them (see the module docstring).

    ``tokenizer``: a ``gateway.tokenization.Tokenizer``; default the bundled test tokenizer
    with ``chat_template`` (the stack's defaults).
    """
    wl = make_workload(kind, seed=seed, **dict(params or {}))
    if wl.prompt_kind != "text":
        raise ValueError(f"workload {kind!r} has no text prompts; use trace_arrivals")
    return items_arrivals(
        list(wl.items()), mode=mode, tokenizer=tokenizer, chat_template=chat_template
    )


def items_arrivals(
    items: list[WorkItem],
    *,
    mode: str = "chat",
    tokenizer: Any = None,
    chat_template: str = "deepseek-v3",
) -> list[Arrival]:
    """``WorkItem``s as arrivals, tokenized like the load driver's ``mode`` sends them.

    ``completion_ids`` tokenizes the items' segments in place (``tokenize_segments``), so the
    same items can then be sent by the live driver with identical token ids.
    """
    if tokenizer is None:
        from gateway.tokenization import Tokenizer, bundled_test_tokenizer

        tokenizer = Tokenizer.load(bundled_test_tokenizer(), chat_template)
    if mode == "completion_ids":
        tokenize_segments(items, lambda text: tokenizer.encode(text, add_special_tokens=False))
        ids = [it.prompt_ids() for it in items]
    elif mode == "completion":
        ids = [tokenizer.encode(it.prompt_text(), add_special_tokens=True) for it in items]
    elif mode == "chat":
        ids = [tokenizer.encode_chat(it.messages()) for it in items]
    else:
        raise ValueError(f"unknown mode {mode!r}; known: chat, completion, completion_ids")
    return [
        Arrival(it.index, it.at, array("I", p).tobytes(), it.max_tokens, it.session)
        for it, p in zip(items, ids, strict=True)
    ]


class _Record(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclasses.dataclass(frozen=True)
class TraceInfo:
    requests: int
    first_s: float
    last_s: float

    @property
    def rate(self) -> float:
        """Native request rate (req/s) of the trace at speed 1."""
        span = self.last_s - self.first_s
        return (self.requests - 1) / span if span > 0 and self.requests > 1 else math.inf


def _records(path: str | Path, limit: int | None) -> Iterator[_Record]:
    decode = msgspec.json.Decoder(_Record).decode
    with open(path, "rb") as f:
        n = 0
        for line in f:
            if limit is not None and n >= limit:
                return
            if not line.strip():
                continue
            try:
                rec = decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(
                    f"{path}: record {n} is not a Mooncake trace record: {exc}"
                ) from None
            n += 1
            yield rec


def scan_trace(path: str | Path, limit: int | None = None) -> TraceInfo:
    """One pass over the trace: request count and time span (for ``--rate``)."""
    n, first, last = 0, math.inf, -math.inf
    for rec in _records(path, limit):
        n += 1
        first = min(first, rec.timestamp / 1000.0)
        last = max(last, rec.timestamp / 1000.0)
    return TraceInfo(n, first if n else 0.0, last if n else 0.0)


def trace_arrivals(
    path: str | Path,
    *,
    speed: float = 1.0,
    limit: int | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> Iterator[Arrival]:
    """Stream a Mooncake-format trace as arrivals (``speed`` > 1 compresses time).

    A request's prompt is its hash ids' blocks, cut to ``input_length`` (the last block may
    be partial); its session key is ``trace-<i>``, like ``TraceWorkload``.
    """
    if speed <= 0:
        raise ValueError("speed must be > 0")
    for i, rec in enumerate(_records(path, limit)):
        n = rec.input_length
        if n <= 0 or not rec.hash_ids:
            continue
        # block j is token (hash_ids[j] + 2) repeated, cut to input_length: built in numpy
        # (half the cost of joining per-block byte strings, a tenth of the simulator's time)
        used = rec.hash_ids[: -(-n // block_tokens)]
        try:
            ids = np.array(used, dtype=np.int64)
            bad = (ids < 0) | (ids >= 2**31 - 2)
        except OverflowError:  # beyond int64: out of range too
            bad = np.array([not 0 <= h < 2**31 - 2 for h in used])
        if bad.any():
            h = used[int(np.argmax(bad))]
            raise ValueError(f"{path}: record {i}: hash id {h} out of range")
        tokens = np.repeat((ids + 2).astype("<u4"), block_tokens)[:n].tobytes()
        yield Arrival(
            i,
            rec.timestamp / 1000.0 / speed,
            tokens,
            max(1, rec.output_length),
            f"trace-{i}",
        )


# -- the two numbers the live comparison needs -------------------------------------------------


def compare_reference(
    workload: str,
    params: dict[str, Any] | None = None,
    *,
    workers: int = 8,
    kv_blocks: int = 4096,
    block_size: int = 16,
    timing: str = "mocker",
    speedup: float = 1.0,
    seed: int = 0,
    mode: str = "chat",
    slo_ttft_ms: float = 1000.0,
    policy: str = "ttft",
    loads: Iterable[float] = (0.3, 0.6, 0.8, 0.95),
    duration: float | None = None,
    capacity_rps: float = 0.0,
    ttft_factor: float = 3.0,
) -> dict[str, Any]:
    """Capacity and pooled-cache bound for a live comparison of this workload and cluster.

    Streams are what the comparison sends: the workload tokenized like the driver's ``mode``,
    retimed to each rate and cut at ``duration`` seconds. ``capacity_rps``: given (0: run
    ``estimate_capacity`` under ``policy``). The bound is computed on the stream of every
    load level; ``bound_hit_rate`` is the highest (the strictest reference for Q1) and
    ``bound_by_load`` has them all, beside ``policy_hit_rate_by_load`` for a preview.
    """
    arrivals = workload_arrivals(workload, params, seed=seed, mode=mode)
    cfg = ClusterConfig(
        workers=workers,
        policy=policy,
        kv_blocks=kv_blocks,
        block_size=block_size,
        timing=timing,
        speedup=speedup,
        seed=seed,
        slo_ttft_ms=slo_ttft_ms,
    )
    cap: CapacityResult | None = None
    if not capacity_rps:
        cap = estimate_capacity(
            partial(retime, arrivals, duration=duration),
            cfg,
            reference=arrivals,
            ttft_factor=ttft_factor,
        )
        capacity_rps = cap.rate
    bounds: dict[str, float] = {}
    routed: dict[str, float] = {}
    for load in loads:
        stream = retime(arrivals, load * capacity_rps, duration)
        bounds[str(load)] = pooled_bound(stream, cfg).hit_rate
        routed[str(load)] = simulate(stream, cfg).hit_rate
    return {
        "capacity_rps": round(capacity_rps, 3),
        "bound_hit_rate": max(bounds.values(), default=None),
        "bound_by_load": bounds,
        "policy_hit_rate_by_load": routed,
        "capacity": None if cap is None else cap.to_json(),
    }


def for_comparison(cfg: Any) -> dict[str, Any]:
    """``compare_reference`` for a ``loadtest.compare.CompareConfig``."""
    return compare_reference(
        cfg.workload,
        cfg.params,
        workers=cfg.workers,
        kv_blocks=cfg.kv_blocks,
        block_size=cfg.block_size,
        timing=cfg.timing,
        speedup=cfg.speedup,
        seed=cfg.seed,
        mode=cfg.mode,
        slo_ttft_ms=cfg.slo_ttft_ms,
        loads=cfg.loads,
        duration=cfg.duration,
        capacity_rps=cfg.capacity_rps,
    )


# -- command line ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("request stream")
    src.add_argument("--trace", help="Mooncake-format JSONL trace (streamed)")
    src.add_argument("--from-log", nargs="+", metavar="PATH",
                     help="gateway request log files or globs (request_log.path) to replay")  # fmt: skip
    src.add_argument("--pool", help="--from-log: the pool to replay (when the log has several)")
    src.add_argument(
        "--answers",
        choices=ANSWERS,
        default="returned",
        help="--from-log: a follow-up turn sent back the answer the engine generated "
        "(returned: chat clients; its decoded blocks are reused) or a reply the engine did "
        "not write (scripted: a load generator's, e.g. kvroute loadtest compare's)",
    )
    src.add_argument("--skip-bad", action="store_true",
                     help="--from-log: skip and count malformed lines instead of failing")  # fmt: skip
    src.add_argument("--workload", choices=["chat", "agent", "shared_prefix"])
    src.add_argument("--set", action="append", default=[], metavar="PARAM=VALUE",
                     help="workload parameter (YAML value), e.g. --set conversations=500")  # fmt: skip
    src.add_argument("--mode", default="chat", choices=["chat", "completion", "completion_ids"],
                     help="how text prompts become tokens (as the live driver's mode)")  # fmt: skip
    src.add_argument("--rate", type=float, help="retime the stream to this many requests/s")
    src.add_argument("--speed", type=float, default=1.0, help="trace time compression")
    src.add_argument("--limit", type=int, help="use the first N requests")
    src.add_argument("--gen-trace", metavar="FILE",
                     help="write a synthetic Mooncake-format trace (write_synthetic_trace), then "
                     "simulate it unless --only-gen or another stream is given")  # fmt: skip
    src.add_argument("--requests", type=int, default=12_031, help="--gen-trace: requests")
    src.add_argument("--duration-s", type=float, default=3540.0, help="--gen-trace: time span")
    src.add_argument("--only-gen", action="store_true", help="--gen-trace: write and stop")
    cl = p.add_argument_group("cluster")
    cl.add_argument("--workers", type=int, default=8)
    cl.add_argument("--policy", help="routing policy (default: ttft; --from-log: the log's)")
    cl.add_argument("--policy-param", action="append", default=[], metavar="PARAM=VALUE",
                    help="policy parameter (YAML value), e.g. --policy-param tie_ms=5")  # fmt: skip
    cl.add_argument("--compare-policies", "--compare", metavar="P1,P2,...",
                    help="run the same stream through each of these policies")  # fmt: skip
    cl.add_argument("--replicas", default="1", metavar="N1,N2,...",
                    help="gateway replicas behind a round-robin front, each with its own index "
                    "and load view; several counts run the stream once each and report the hit "
                    "rate lost against the first (Q4)")  # fmt: skip
    cl.add_argument("--no-share-placements", dest="share_placements", action="store_false",
                    help="replicas keep their speculative inserts to themselves (the gateway's "
                    "replicas.share_placements: false)")  # fmt: skip
    cl.add_argument("--no-share-load", dest="share_load", action="store_false",
                    help="shared placements carry no requests: each replica's load view and "
                    "prefix rates count its own (the gateway's replicas.share_load: false)")  # fmt: skip
    cl.add_argument("--kv-blocks", type=int,
                    help=f"KV blocks per worker (default {DEFAULT_KV_TOKENS} tokens' worth)")  # fmt: skip
    cl.add_argument("--block-size", type=int,
                    help=f"engine = canonical block size (default {TRACE_BLOCK_TOKENS} for "
                    "traces, 16 otherwise)")  # fmt: skip
    cl.add_argument("--timing", default="mocker", help="engine timing preset")
    cl.add_argument("--speedup", type=float, default=1.0)
    cl.add_argument("--max-num-seqs", type=int, default=256)
    cl.add_argument("--event-lag", type=float, default=0.02, help="KV event delay (s)")
    cl.add_argument("--report-interval", type=float, default=0.25, help="load report period (s)")
    cl.add_argument("--keys", default="auto", choices=["auto", "exact", "fingerprint"])
    cl.add_argument("--seed", type=int, default=0)
    cl.add_argument(
        "--draws",
        type=int,
        default=1,
        metavar="K",
        help="run each policy K times with the routers' random streams --seed .. --seed+K-1 "
        "(the same requests): near capacity one draw can tip into eviction thrash where "
        "another does not, so compare policies on the means over draws",
    )
    cl.add_argument("--slo-ms", type=float, default=2000.0, help="TTFT SLO for goodput")
    cl.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="requests arriving in the first SECONDS are served but not counted (a live "
        "comparison's window: its warmup_s, with --from-log of that run)",
    )
    out = p.add_argument_group("extras and output")
    out.add_argument("--bound", action="store_true", help="also compute the pooled-cache bound")
    out.add_argument("--capacity", action="store_true", help="estimate the cluster's capacity")
    out.add_argument("--ttft-factor", type=float, default=3.0, help="capacity criterion")
    out.add_argument("--json", action="store_true", help="print only the JSON object")
    out.add_argument("--out", help="also write the JSON object to this file")
    out.add_argument("--plot", metavar="DIR", help="write comparison plots (PNG) to DIR")
    out.add_argument("--no-progress", action="store_true")


def parse_params(pairs: Iterable[str]) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (values read as YAML scalars): the
    workload and policy parameters of the offline tools. ValueError on a malformed pair."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected PARAM=VALUE, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def parse_policy(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:key=value,key=value`` (values parsed as YAML scalars)."""
    name, _, rest = spec.partition(":")
    return name.strip(), parse_params(filter(None, rest.split(",")))


def _params(pairs: list[str]) -> dict[str, Any]:
    try:
        return parse_params(pairs)
    except ValueError as exc:
        raise SystemExit(f"--set / --policy-param: {exc}") from None


class _Stream:
    """The request stream the arguments describe, re-readable at any rate."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.trace = args.trace
        self._list: list[Arrival] | None = None
        self._info: TraceInfo | None = None
        self.log: CapturedLog | None = None
        if args.from_log:
            self.log = read_log(args.from_log, pool=args.pool, skip_bad=args.skip_bad)
        elif not self.trace:
            self._list = workload_arrivals(
                args.workload, _params(args.set), seed=args.seed, mode=args.mode
            )
            if args.limit:
                self._list = self._list[: args.limit]

    def describe(self) -> dict[str, Any]:
        a = self.args
        if self.log is not None:
            return {
                "kind": "request_log",
                "pool": self.log.pool,
                "block_size": self.log.block_size,
                "workers": self.log.names,
                "captured_policies": self.log.policies,
                "answers": a.answers,
                **dataclasses.asdict(self.log.stats),
            }
        if self.trace:
            return {"kind": "trace", "path": self.trace, "speed": a.speed, "limit": a.limit}
        return {"kind": a.workload, "params": _params(a.set), "mode": a.mode, "seed": a.seed}

    def count(self) -> int | None:
        if self.log is not None:
            return len(self.log)
        if self._list is not None:
            return len(self._list)
        return self.info().requests

    def info(self) -> TraceInfo:
        if self._info is None:
            self._info = scan_trace(self.trace, self.args.limit)
        return self._info

    def at(self, rate: float | None) -> Iterable[Arrival]:
        """The stream at ``rate`` req/s (None: as given, with --speed for traces)."""
        a = self.args
        if self.log is not None:
            return self.log.arrivals(rate, answers=a.answers)
        if self._list is not None:
            return retime(self._list, rate) if rate else list(self._list)
        speed = a.speed if not rate else rate / self.info().rate
        return trace_arrivals(self.trace, speed=speed, limit=a.limit)

    def reference(self) -> Iterable[Arrival]:
        return self.at(None)

    def unrestricted(self, rate: float | None) -> Iterable[Arrival]:
        """The stream without per-request candidate sets (the pooled bound's one worker)."""
        if self.log is not None:
            return self.log.arrivals(rate, candidates=False, answers=self.args.answers)
        return self.at(rate)


def parse_replicas(spec: str) -> list[int]:
    """``"1,4,8"`` -> ``[1, 4, 8]``; SystemExit on anything but distinct counts >= 1."""
    try:
        counts = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--replicas: expected counts like 1,4,8, got {spec!r}") from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise SystemExit(f"--replicas: expected distinct counts >= 1, got {spec!r}")
    return counts


def _config(args: argparse.Namespace, policy: str, replicas: int = 1) -> ClusterConfig:
    return ClusterConfig(
        replicas=replicas,
        share_placements=args.share_placements,
        share_load=args.share_load,
        workers=args.workers,
        names=args.names,
        policy=policy,
        policy_params=_params(args.policy_param),
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        timing=args.timing,
        speedup=args.speedup,
        max_num_seqs=args.max_num_seqs,
        event_lag=args.event_lag,
        report_lag=args.event_lag,
        report_interval=args.report_interval,
        keys=args.keys,
        seed=args.seed,
        slo_ttft_ms=args.slo_ms,
    )


def _simulate(
    stream: _Stream,
    rate: float | None,
    cfg: ClusterConfig,
    warmup: float,
    progress: Callable[[int], None],
) -> SimResult:
    return measured_from(simulate(stream.at(rate), cfg, progress), warmup)


def measured_from(res: SimResult, warmup: float) -> SimResult:
    """``res`` counting only the requests that arrived at or after ``warmup`` seconds (the
    earlier ones were served and loaded the cluster, as a live run's warm-up does). Failed
    requests carry no arrival time: the whole run's are kept."""
    if warmup <= 0:
        return res
    t = res.table
    keep = np.frombuffer(t.arrival, dtype=np.float64) >= warmup
    cols = {}
    for f in dataclasses.fields(t):
        col = getattr(t, f.name)
        cols[f.name] = array(col.typecode, np.frombuffer(col, dtype=col.typecode)[keep].tobytes())
    table = RequestTable(**cols)
    duration = max(0.0, res.duration - warmup)
    summary = summarize(
        table, res.config.worker_names(), duration, res.config.slo_ttft_ms, res.failed
    )
    return dataclasses.replace(res, summary=summary, table=table, duration=duration)


def _timed(
    label: str, total: int | None, quiet: bool, fn: Callable[[Callable[[int], None]], SimResult]
) -> tuple[SimResult, float]:
    bar = tqdm(total=total, desc=label, unit="req", disable=quiet, leave=False, mininterval=0.5)
    seen = [0]

    def progress(n: int) -> None:
        bar.update(n - seen[0])
        seen[0] = n

    t0 = time.perf_counter()
    res = fn(progress)
    wall = time.perf_counter() - t0
    bar.close()
    return res, wall


#: the table's columns that ``--draws`` replaces with their mean over draws
_DRAWN = {
    "hit rate": "hit_rate",
    "TTFT p50 ms": "ttft_p50_ms",
    "TTFT p99 ms": "ttft_p99_ms",
    "goodput": "goodput",
}
_OVER = ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "goodput", "max_mean_requests")


def over_draws(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, min and max of each headline figure over the draws' summaries (draw order), and
    each draw's figures (``per_draw``)."""
    out: dict[str, Any] = {"draws": len(summaries)}
    for key in _OVER:
        vals = [float(s[key]) for s in summaries if s.get(key) is not None]
        if vals:
            out[key] = {
                "mean": round(sum(vals) / len(vals), 4),
                "min": round(min(vals), 4),
                "max": round(max(vals), 4),
            }
    out["per_draw"] = [{k: s.get(k) for k in _OVER} for s in summaries]
    return out


def _row(system: str, res: SimResult, wall: float) -> dict[str, Any]:
    s = res.summary
    n = s["requests"]
    return {
        "system": system,
        "requests": n,
        "hit rate": s["hit_rate"],
        "TTFT p50 ms": s["ttft_p50_ms"],
        "TTFT p99 ms": s["ttft_p99_ms"],
        "goodput": s["goodput"],
        "req/s": s["throughput_rps"],
        "max/mean load": s["max_mean_requests"],
        "wall s": round(wall, 1),
        "µs/req": round(wall / n * 1e6, 1) if n else None,
    }


def run(args: argparse.Namespace) -> int:
    if args.gen_trace:
        write_synthetic_trace(Path(args.gen_trace), requests=args.requests,
                              duration_s=args.duration_s, seed=args.seed)  # fmt: skip
        if not args.json:
            print(f"wrote {args.requests} requests over {args.duration_s:g} s to {args.gen_trace}",
                  file=sys.stderr)  # fmt: skip
        if args.only_gen:
            return 0
        if not args.trace and not args.workload:
            args.trace = args.gen_trace
    if sum(map(bool, (args.trace, args.workload, args.from_log))) != 1:
        raise SystemExit("give exactly one of --trace FILE, --workload KIND and --from-log PATH")
    args.names = []
    stream = _Stream(args)
    if stream.log is not None:
        log = stream.log
        if not len(log):
            raise SystemExit(f"the request log holds no records of pool {log.pool!r}")
        if args.block_size not in (None, log.block_size):
            raise SystemExit(f"--block-size: the log's pool uses {log.block_size}")
        args.block_size = log.block_size
        args.names = log.names
        args.workers = len(args.names)
        if args.policy is None:
            args.policy = max(log.policies.items(), key=lambda kv: kv[1])[0]
    args.policy = args.policy or "ttft"
    if args.block_size is None:
        args.block_size = TRACE_BLOCK_TOKENS if args.trace else 16
    if args.kv_blocks is None:
        args.kv_blocks = max(1, DEFAULT_KV_TOKENS // args.block_size)
    quiet = args.no_progress or args.json
    total = stream.count() if not args.trace or args.rate or args.limit else None
    policies = [p.strip() for p in (args.compare_policies or args.policy).split(",") if p.strip()]
    counts = parse_replicas(args.replicas)
    report: dict[str, Any] = {"workload": stream.describe(), "rate": args.rate, "results": []}
    rows = []
    runs: list[tuple[str, SimResult]] = []
    first: ClusterConfig | None = None
    if args.draws < 1:
        raise SystemExit("--draws must be at least 1")
    for policy in policies:
        base: SimResult | None = None
        for n in counts:
            cfg = _config(args, policy, n)
            first = first or cfg
            label = policy if len(counts) == 1 else f"{policy} x{n}"
            run = partial(_simulate, stream, args.rate, cfg, args.warmup)
            res, wall = _timed(label, total, quiet, run)
            entry = {"policy": policy, "replicas": n, "wall_s": round(wall, 2), **res.to_json()}
            row = _row(f"kvroute-{label}", res, wall)
            if args.draws > 1:
                more = [res.summary]
                for d in range(1, args.draws):
                    cfg_d = dataclasses.replace(cfg, seed=args.seed + d)
                    run = partial(_simulate, stream, args.rate, cfg_d, args.warmup)
                    more.append(_timed(f"{label} draw {d}", total, quiet, run)[0].summary)
                entry["over_draws"] = over = over_draws(more)
                row.update(
                    {k: round(over[m]["mean"], 1 if m.endswith("_ms") else 4)
                     for k, m in _DRAWN.items()}
                )  # fmt: skip
                row["p50 min-max ms"] = (
                    f"{over['ttft_p50_ms']['min']:,.0f}-{over['ttft_p50_ms']['max']:,.0f}"
                )
                row["draws"] = args.draws
            if len(counts) > 1:
                base = base or res
                lost = round((base.hit_rate - res.hit_rate) * 100, 2)
                entry["hit_points_lost"] = row[f"points lost vs x{counts[0]}"] = lost
                row["index precision"] = res.summary["index_precision"]
            if stream.log is not None:
                entry["same_worker_as_live"] = agree = agreement(stream.log, res)
                row["same worker as live"] = agree["rate"]
            report["results"].append(entry)
            rows.append(row)
            runs.append((label, res))
    assert first is not None
    report["cluster"] = dataclasses.asdict(first)
    if args.bound:
        res, wall = _timed(
            "bound",
            total,
            quiet,
            lambda pr: measured_from(
                pooled_bound(stream.unrestricted(args.rate), first, pr), args.warmup
            ),
        )
        report["bound_hit_rate"] = res.hit_rate
        report["bound"] = {"wall_s": round(wall, 2), **res.to_json()}
        rows.append(_row(f"pooled bound (1 x {args.workers})", res, wall))
    if args.capacity:
        cap = _capacity(stream, first, args, quiet)
        report["capacity_rps"] = round(cap.rate, 3)
        report["capacity"] = cap.to_json()
    if args.plot:
        report["plots"] = _plots(report, runs, Path(args.plot))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.json:
        print(json.dumps(report, default=str))
        return 0
    print(json.dumps(_slim(report), indent=2, default=str))  # per-worker detail: --out/--json
    print(format_table(rows))
    if args.capacity:
        print(f"capacity: {report['capacity_rps']} req/s  (p99 TTFT <= {cap.limit_ms} ms = "
              f"{cap.ttft_factor:g} x {cap.reference_ms} ms unloaded cold p99)")  # fmt: skip
    if args.out:
        print(f"JSON written to {args.out}")
    return 0


def _plots(report: dict[str, Any], runs: list[tuple[str, SimResult]], out: Path) -> list[str]:
    """The comparison's plots (``loadtest.plots.compare_plots``) for these runs, one load."""
    from loadtest.plots import compare_plots

    out.mkdir(parents=True, exist_ok=True)
    results = [
        {"system": f"kvroute-{p}", "load": 1.0, "ttfts_ms": res.ttfts_ms(), **res.summary}
        for p, res in runs
    ]
    cfg = {"slo_ttft_ms": runs[0][1].config.slo_ttft_ms} if runs else {}
    data = {"results": results, "config": cfg, "bound_hit_rate": report.get("bound_hit_rate")}
    return compare_plots(data, out)


def _slim(obj: Any) -> Any:
    """``obj`` without its per-worker tables (hundreds of lines for a large cluster)."""
    if isinstance(obj, dict):
        return {k: _slim(v) for k, v in obj.items() if k != "per_worker"}
    if isinstance(obj, list):
        return [_slim(v) for v in obj]
    return obj


def _capacity(
    stream: _Stream, cfg: ClusterConfig, args: argparse.Namespace, quiet: bool
) -> CapacityResult:
    def show(p: CapacityProbe) -> None:
        if not quiet:
            verdict = "ok" if p.ok else "over"
            print(f"  capacity probe {p.rate:9.3f} req/s: p99 TTFT {p.ttft_p99_ms} ms, "
                  f"hit {p.hit_rate:.3f} -> {verdict}", file=sys.stderr)  # fmt: skip

    return estimate_capacity(
        stream.at, cfg, reference=stream.reference(), ttft_factor=args.ttft_factor, progress=show
    )
