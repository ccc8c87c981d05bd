"""``kvroute loadtest compare``: one workload, one sim cluster, several routers, one report.

For each system (kvroute with its default policy or a baseline policy, and the peers of
``loadtest.peers``: smg, vllm-router, historical sglang-router) and each offered load, the
same seeded workload is replayed open-loop against the same simulated workers, whose caches
are emptied before every run. Per-worker hit rates and request counts are read from the
workers' own ``/metrics`` (before/after each run), so every router is measured the same way.

Three yardsticks are computed here, each on exactly what the live runs send:

* **Policy-neutral load.** Load 1.0 is the capacity of the pooled-cache cluster: ONE simulated
  worker with all the cluster's KV blocks and compute (``clustersim.pooled_config``), no routing
  policy at all. Its capacity is the highest offered rate at which its p99 TTFT stays within
  ``capacity_ttft_factor`` x the p99 cold prefill time of one real worker, found by doubling
  then bisection in the offline simulator, on the same requests retimed as the live runs retime
  them. No router can beat perfect sharing and perfect balance, so load 1.0 is at or beyond
  every system's own limit.
* **Capacity at SLO** (per system, the headline): the highest offered rate at which p90 TTFT
  (failed requests counted as infinitely slow) stays within ``slo_ttft_ms``. The load sweep's
  runs are its first probes; ``slo_probes`` more runs bisect between the highest passing and the
  lowest failing rate (or extend past the ends). Reported as ``capacity_at_slo`` in the JSON.
* **Q1's bound on the measured window.** Per load, the pooled-cache bound is simulated on the
  very requests sent, with the same arrival times, and its hit rate is counted over the requests
  the live figure counts (those scheduled after the warm-up): ``bound_hit_rate`` per row.

Traces (``--workload trace --set params.path=...``, Mooncake format) go through the same code:
their token ids are used as they are (``completion_ids``), only the part of the trace a run
needs is materialised, and KV capacity per worker comes from the model (``kv_blocks: 0``, a
70B FP8 model on 8xH100 by default: ~3M tokens per worker) unless a preset sets eviction
pressure on purpose.

Output: one JSON object, a markdown table, and PNG plots.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
import urllib.request
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gateway.routing.costmodel import CostParams
from gateway.routing.policy import make_policy
from loadtest.clustersim import (
    Arrival,
    ClusterConfig,
    cold_prefill_p99_ms,
    pooled_bound,
    pooled_config,
    simulate,
)
from loadtest.driver import DriverConfig, balance, run_load, summarize
from loadtest.enginesim.timing import Attention, timing_model
from loadtest.harness import post_json
from loadtest.paired import LEVEL, RESAMPLES, versus
from loadtest.peers import (
    HISTORICAL_NOTE,
    PEERS,
    SMG_TUNING,
    Peer,
    PeerNotInstalled,
    PeerUnsupported,
    is_peer,
    launch,
    peer_spec,
    pool_from_stack,
)
from loadtest.report import format_table
from loadtest.stack import Stack, StackConfig
from loadtest.workloads import TraceWorkload, WorkItem, Workload, make_workload

__all__ = [
    "DEFAULT_SYSTEMS",
    "KVROUTE_POLICIES",
    "SYSTEMS",
    "CompareConfig",
    "RateSearch",
    "Stream",
    "SyntheticTrace",
    "kv_blocks_from_model",
    "neutral_capacity",
    "p90_with_failures",
    "pick_best",
    "run_compare",
    "scrape_workers",
    "search_max_rate",
    "window_bound",
    "write_trace_window",
]

KVROUTE_POLICIES = ("ttft", "round_robin", "least_load", "prefix", "session", "random")
SYSTEMS = (
    "kvroute",
    *(f"kvroute-{p}" for p in KVROUTE_POLICIES if p != "ttft"),
    *PEERS,
)
DEFAULT_SYSTEMS = ("kvroute", "smg-cache_aware", "vllm-router-kv_aware", "smg-round_robin")

CAPACITY_DEFINITION = (
    "policy-neutral capacity = the highest offered rate (req/s, the workload retimed exactly as "
    "the live runs retime it) at which the pooled-cache cluster -- ONE simulated worker with all "
    "the cluster's KV blocks and compute, no routing -- keeps p99 TTFT of the measured window "
    "<= ttft_factor x the p99 of the requests' cold prefill times on one real worker; doubling "
    "then bisection in the offline simulator. Loads are fractions of it. One big worker shares "
    "every cached block and batches everything in one step, so N separate workers, however "
    "routed, reach somewhat less (2 workers on one hot prefix: ~24 req/s against its 28)."
)
SLO_DEFINITION = (
    "capacity at SLO = the highest offered rate at which p90 TTFT of the measured requests "
    "(failed ones counted as infinitely slow) is <= slo_ttft_ms: the load sweep's runs first, "
    "then up to slo_probes more runs bisecting between the highest passing rate below the "
    "lowest failing one and that failing rate (or extending past the ends by x1.5)."
)
BEST_DEFINITION = (
    "best smg setting = the highest goodput (requests with TTFT <= slo_ttft_ms / requests) at "
    "tune_load; settings within 0.01 of it are ranked by p90 TTFT (lower wins)"
)


@dataclass
class SyntheticTrace:
    """A window of ``loadtest.workloads.write_synthetic_trace``'s trace (its arguments, then
    the records kept: ``skip`` .. ``skip + take``)."""

    requests: int = 12_031
    duration_s: float = 3540.0
    seed: int = 0
    mean_input: int = 12_035
    mean_output: int = 343
    skip: int = 0
    take: int | None = None


@dataclass
class CompareConfig:
    workload: str = "chat"
    params: dict[str, Any] = field(default_factory=dict)
    #: offered loads, fractions of the policy-neutral capacity
    loads: list[float] = field(default_factory=lambda: [0.3, 0.6, 0.8, 0.95])
    #: requests/s at load 1.0; 0: the pooled-cache cluster's capacity (offline, see above)
    capacity_rps: float = 0.0
    #: the workers: "sim" (the engine simulator) or "vllm-cpu" (real vLLM on CPU, a tiny model
    #: with random weights: its hit accounting is vLLM's, its timing a CPU's; kv_blocks then
    #: counts vLLM's 32-token blocks and capacity_rps must be given)
    engine: str = "sim"
    capacity_ttft_factor: float = 3.0
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    workers: int = 8
    #: data-parallel ranks per worker, each a prefix cache and engine core of its own (the
    #: offline bound and capacity count ranks as workers: a rank is an independent engine)
    dp_size: int = 1
    #: the engines imitated: "vllm" or "sglang" (each speaks its own disaggregation protocol)
    flavor: str = "vllm"
    #: prefill/decode disaggregation: the first ``prefill_workers`` workers prefill, the
    #: others decode (0: none). The offline bound and capacity count the prefill workers:
    #: their caches are what the bound is about (give ``capacity_rps`` for the pair's)
    prefill_workers: int = 0
    #: LoRA workloads (``params.adapters``): adapter GPU slots per engine (vLLM --max-loras)
    max_loras: int = 2
    #: KV blocks per worker; 0: what the model leaves in GPU memory (the settings below)
    kv_blocks: int = 0
    block_size: int = 16
    #: the model behind kv_blocks 0 (default: a 70B FP8 model, e.g. Llama-3-70B: 80 layers x
    #: 8 KV heads x 128 dims x 2 (K and V) x 1 byte = 160 KiB per token) on gpus_per_worker GPUs
    model_kv_bytes_per_token: int = 163_840
    model_weights_gb: float = 70.0
    gpu_memory_gb: float = 80.0
    gpus_per_worker: int = 8
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 262_144
    speedup: float = 1.0
    timing: str = "mocker"
    #: what the simulated engines' quadratic prefill term is paid on: "batch" (every figure
    #: on record) or "sequence" (each chunk attends to its own context; timing.py)
    attention: Attention = "batch"
    duration: float = 60.0
    slo_ttft_ms: float = 1000.0
    #: extra live runs per system to narrow its capacity at SLO (0: the sweep's runs only)
    slo_probes: int = 2
    slo_rel_tol: float = 0.1
    #: measured seconds of those runs (0: duration)
    slo_probe_duration: float = 0.0
    #: run every smg setting of ``smg_variants`` at ``tune_load`` first; the best one then
    #: stands in for smg-cache_aware in ``systems`` (all of them are in the JSON)
    tune_smg: bool = False
    tune_load: float = 0.6
    smg_variants: list[str] = field(default_factory=lambda: list(SMG_TUNING))
    #: extra command-line flags per peer system, e.g. {"smg-cache_aware": ["--cache-threshold",
    #: "0.2"]}
    peer_args: dict[str, list[str]] = field(default_factory=dict)
    #: how trace prompts are sent: "text" (each token id spelled as one single-token word:
    #: the same prefixes and lengths as text completions, which every router takes; smg's
    #: OpenAI routes take text only) or "ids" (completion_ids, the trace's token ids as they
    #: are: no tokenizing anywhere, but only kvroute and vllm-router accept them)
    trace_prompts: Literal["ids", "text"] = "text"
    #: trace workload without params.path: write a window of the project's synthetic trace
    #: to <out_dir>/trace.jsonl (see SyntheticTrace)
    synthetic_trace: SyntheticTrace | None = None
    #: parameters of the ``kvroute`` system's policy (ttft), e.g. ``{long_tie_ratio: 1}``
    #: (``--set policy_params.long_tie_ratio=1``); the kvroute-<policy> baselines ignore them
    policy_params: dict[str, Any] = field(default_factory=dict)
    #: gateway replicas per kvroute system (and peer processes); the driver spreads requests
    #: over them round-robin, like a load balancer in front
    replicas: int = 1
    #: kvroute's gateways write a request log per run, replica ``i`` to
    #: ``<out_dir>/requests/<nn>-<system>_<load>_.g<i>.jsonl`` (``nn``: the run's number)
    #: (``kvroute simulate --from-log`` replays it: the simulator on the live stream)
    request_log: bool = False
    #: the kvroute gateway's cost model: "default" (the mocker fit with online calibration,
    #: what a deployment that configures no ``cost`` gets) or "engine" (fitted to the simulated
    #: engines' timing and speed-up, what an operator who measured the engines would
    #: configure; engine "sim" only). Offline and live alike (``engine_cost_params``)
    gateway_cost: Literal["default", "engine"] = "default"
    #: single cost-model settings on top of ``gateway_cost``'s, e.g. ``{calibration_max: 64}``
    #: (``--set cost_params.calibration_max=64``; the names of ``CostParams``)
    cost_params: dict[str, Any] = field(default_factory=dict)
    mode: str = "chat"
    out_dir: str = "reports/compare"
    seed: int = 0
    progress: bool = True


# -- KV capacity from the model ---------------------------------------------------------------


def kv_blocks_from_model(cfg: CompareConfig) -> int:
    """KV blocks per worker that the model leaves: (GPUs x memory x utilisation - weights)
    / KV bytes per token / block size (a 70B FP8 model on 8xH100: ~3.1M tokens)."""
    free = (
        cfg.gpus_per_worker * cfg.gpu_memory_gb * cfg.gpu_memory_utilization - cfg.model_weights_gb
    ) * 1e9
    tokens = int(free // cfg.model_kv_bytes_per_token)
    if tokens < cfg.block_size:
        raise ValueError("the model leaves no GPU memory for the KV cache")
    return tokens // cfg.block_size


def _kv_blocks(cfg: CompareConfig) -> int:
    return cfg.kv_blocks or kv_blocks_from_model(cfg)


# -- the gateway's cost model -----------------------------------------------------------------


def engine_cost_params(timing: str, speedup: float) -> CostParams:
    """The gateway's cost model of a simulated engine: its step-time coefficients, slowed by
    its speed-up, so a predicted prefill or decode step is the engine's own (before online
    calibration, which then starts at the truth); the chunk stays ``CostParams``' 8,192
    tokens, the engines' default step budget. The default ``CostParams`` is the mocker's
    fit at speed-up 1: the presets' engines (``seed-70b`` at 0.125-1) take 8-60x longer per
    prompt token than it predicts, more than calibration (at most 4x) absorbs."""
    t = timing_model(timing, speedup)
    s = t.speedup
    return CostParams(
        prefill_a=t.prefill_a / s,
        prefill_b=t.prefill_b / s,
        prefill_c=t.prefill_c / s,
        decode_d2=t.decode_d2 / s,
        decode_d1=t.decode_d1 / s,
        decode_d0=t.decode_d0 / s,
    )


def gateway_cost(cfg: CompareConfig) -> CostParams | None:
    """``cfg.gateway_cost`` with ``cfg.cost_params`` as the gateway's ``CostParams`` (None:
    the gateway's default)."""
    known = [f.name for f in fields(CostParams)]
    unknown = sorted(set(cfg.cost_params) - set(known))
    if unknown:
        raise ValueError(f"cost_params: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    if cfg.gateway_cost == "default":
        base = CostParams() if cfg.cost_params else None
    elif cfg.engine != "sim":
        raise ValueError(
            f"gateway_cost {cfg.gateway_cost!r} needs the simulated engines' timing model;"
            f" engine {cfg.engine!r} has none (leave gateway_cost 'default': calibration)"
        )
    else:
        base = engine_cost_params(cfg.timing, cfg.speedup)
    if base is None or not cfg.cost_params:
        return base
    values: dict[str, Any] = {}
    for name, value in cfg.cost_params.items():
        kind = int if name == "max_batched_tokens" else float
        try:
            values[name] = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"cost_params.{name}: not a number: {value!r}") from None
        if not math.isfinite(values[name]):
            raise ValueError(f"cost_params.{name}: not a finite number: {value!r}")
    return replace(base, **values)


def _pool_settings(cfg: CompareConfig, adapters: list[Any]) -> dict[str, Any]:
    """The kvroute gateway's pool settings beyond the stack's own."""
    settings: dict[str, Any] = {"adapters": adapters} if adapters else {}
    cost = gateway_cost(cfg)
    if cost is not None:
        settings["cost"] = asdict(cost)
    return settings


# -- the request stream -----------------------------------------------------------------------


class Stream:
    """A workload's requests, retimed to any rate exactly as the live runs send them.

    With ``sessions_ramp`` (conversations, agents), sessions start as a Poisson stream and then
    issue their turns, so a run starting from nothing ramps up: everything is sent from t=0
    but only requests scheduled after the warm-up (the median session span) are measured.
    Otherwise (shared-prefix groups, traces) the stream's own mean rate is scaled to the rate
    and there is no warm-up. Traces are read only as far as a window needs (they must be in
    time order, as Mooncake's are); their token ids are used as they are.
    """

    def __init__(
        self, workload: Workload, mode: str, tokenizer: Any = None, trace_text: bool = False
    ) -> None:
        self.workload = workload
        self.mode = mode
        self._tokenizer = tokenizer
        self._spell: _Speller | None = None
        if trace_text and workload.prompt_kind == "ids":
            self._spell = _Speller(self._get_tokenizer())
        self._gen: Iterator[WorkItem] | None = iter(workload.items())
        self.items: list[WorkItem] = []
        self._tokens: dict[int, bytes] = {}
        self.median_span = 0.0
        if workload.sessions_ramp:
            self._fill(math.inf)
            first: dict[str, float] = {}
            last: dict[str, float] = {}
            for it in self.items:
                first.setdefault(it.session, it.at)
                last[it.session] = it.at
            starts = sorted(first.values())
            span = starts[-1] - starts[0] if starts else 0.0
            self.steady = (
                (len(starts) - 1) / span * (len(self.items) / len(starts)) if span > 0 else 0.0
            )
            spans = sorted(last[s] - first[s] for s in first)
            self.median_span = spans[len(spans) // 2] if spans else 0.0
        elif isinstance(workload, TraceWorkload):
            n, t0, t1 = _scan_trace(workload)
            self.steady = (n - 1) / ((t1 - t0) / workload.speed) if n > 1 and t1 > t0 else 0.0
        else:
            self._fill(math.inf)
            span = self.items[-1].at - self.items[0].at if len(self.items) > 1 else 0.0
            self.steady = (len(self.items) - 1) / span if span > 0 else 0.0
        if self.steady <= 0:
            raise ValueError("the workload's arrivals span no time: cannot retime it to a rate")

    def timing(self, rate: float) -> tuple[float, float]:
        """(factor that scales arrival times to ``rate``, warm-up seconds at that rate)."""
        factor = self.steady / rate
        return factor, self.median_span * factor

    def window(self, rate: float, duration: float) -> tuple[list[WorkItem], float]:
        """The requests a run at ``rate`` sends (retimed copies) and its warm-up: everything
        scheduled up to warm-up + ``duration``."""
        factor, warmup = self.timing(rate)
        end = warmup + duration
        self._fill(self._origin() + end / factor)
        t0 = self._origin()  # a trace's first timestamp need not be 0
        items = [
            WorkItem(
                it.index, (it.at - t0) * factor, it.session, it.segments, it.max_tokens, it.model
            )
            for it in self.items
            if (it.at - t0) * factor <= end
        ]
        return items, warmup

    def covers(self, rate: float, duration: float) -> bool:
        """Whether the workload lasts the whole run at ``rate`` (to 90% of warm-up +
        ``duration``): past that rate a run is a burst of every request, not a load level."""
        factor, warmup = self.timing(rate)
        end = warmup + duration
        self._fill(self._origin() + end / factor)
        return self._gen is not None or (self.items[-1].at - self._origin()) * factor >= 0.9 * end

    def _origin(self) -> float:
        if not self.items:
            self._fill(-math.inf)
        return self.items[0].at if self.items else 0.0

    def arrivals(self, items: Sequence[WorkItem]) -> list[Arrival]:
        """``items`` as the offline simulator's arrivals: the token ids the engines get from
        the live driver's ``mode`` (tokenized once per request; for ``completion_ids`` the
        items' segments get their ids, which the driver then sends)."""
        todo = [it for it in items if it.index not in self._tokens]
        if todo:
            if self.workload.prompt_kind == "ids" and self._spell is None:
                for it in todo:
                    self._tokens[it.index] = array("I", it.prompt_ids()).tobytes()
            else:
                from loadtest.simulate import items_arrivals

                tk = self._get_tokenizer()
                for a in items_arrivals(todo, mode=self.mode, tokenizer=tk):
                    self._tokens[a.index] = a.tokens
        return [
            Arrival(it.index, it.at, self._tokens[it.index], it.max_tokens, it.session)
            for it in items
        ]

    def _get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from gateway.tokenization import Tokenizer, bundled_test_tokenizer

            self._tokenizer = Tokenizer.load(bundled_test_tokenizer(), "deepseek-v3")
        return self._tokenizer

    def _fill(self, until: float) -> None:
        """Read the workload's items up to native time ``until`` (and one beyond)."""
        while self._gen is not None and (not self.items or self.items[-1].at <= until):
            nxt = next(self._gen, None)
            if nxt is None:
                self._gen = None
                continue
            if self._spell is not None:
                nxt, self._tokens[nxt.index] = self._spell.item(nxt)
            self.items.append(nxt)


class _Speller:
    """Token-id prompts as text: id ``i`` becomes word ``i mod n`` of the workloads' word list,
    each of which is ONE token (with its leading space) for the stack's tokenizer, so the
    text tokenizes back to exactly those word ids and prefixes stay prefixes. Checked on the
    first prompt against the real tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        from loadtest.workloads import WORDS

        self.tokenizer = tokenizer
        self.words: list[str] = []
        self.ids: list[int] = []
        for w in WORDS:
            ids = tokenizer.encode(" " + w, add_special_tokens=False)
            if len(ids) == 1:
                self.words.append(" " + w)
                self.ids.append(ids[0])
        if len(self.words) < 64:
            raise ValueError("the tokenizer has too few single-token words to spell a trace")
        self._checked = False

    def item(self, it: WorkItem) -> tuple[WorkItem, bytes]:
        from loadtest.workloads import Segment

        n = len(self.words)
        segs: list[Segment] = []
        ids: list[int] = []
        for s in it.segments:
            src = s.ids or ()
            segs.append(Segment(s.key, s.role, "".join(self.words[i % n] for i in src)))
            ids.extend(self.ids[i % n] for i in src)
        out = WorkItem(it.index, it.at, it.session, segs, it.max_tokens, it.model)
        if not self._checked:
            real = self.tokenizer.encode(out.prompt_text(), add_special_tokens=True)
            if real != ids:
                raise RuntimeError("spelled trace prompts do not tokenize back to their ids")
            self._checked = True
        return out, array("I", ids).tobytes()


def _scan_trace(wl: TraceWorkload) -> tuple[int, float, float]:
    """Records, first and last timestamp (s) of a trace, without building its prompts."""
    from loadtest.simulate import scan_trace

    info = scan_trace(wl.path, wl.limit)
    return info.requests, info.first_s, info.last_s


def write_trace_window(
    path: Path,
    *,
    requests: int = 12_031,
    duration_s: float = 3540.0,
    seed: int = 0,
    skip: int = 0,
    take: int | None = None,
    **shape: Any,
) -> Path:
    """Records ``skip .. skip+take`` of ``write_synthetic_trace``'s trace, timestamps from 0.

    A window from the middle of the trace has its production shape: long prompts sharing
    block 0 (one 512-token prefix) and little other reuse, because the follow-ups it holds
    mostly extend conversations that started before the window."""
    from loadtest.workloads import write_synthetic_trace

    path.parent.mkdir(parents=True, exist_ok=True)
    full = path.with_name(path.name + ".full")
    write_synthetic_trace(full, requests=requests, duration_s=duration_s, seed=seed, **shape)
    lines = full.read_text().splitlines()
    full.unlink()
    kept = lines[skip : None if take is None else skip + take]
    if not kept:
        raise ValueError(f"synthetic_trace: no records left after skip={skip}")
    t0 = json.loads(kept[0])["timestamp"]
    with open(path, "w") as f:
        for line in kept:
            rec = json.loads(line)
            rec["timestamp"] -= t0
            f.write(json.dumps(rec) + "\n")
    return path


# -- bounded searches -------------------------------------------------------------------------


@dataclass
class RateSearch:
    """Highest passing rate found: ``rate`` (0 if none passed), every probe in order."""

    rate: float
    #: None: bracketed; "above": no probe failed (the answer is >= rate); "below": none passed
    censored: str | None
    probes: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def search_max_rate(
    probe: Callable[[float], bool | tuple[bool, dict[str, Any]]],
    *,
    known: Iterable[tuple[float, bool]] = (),
    start: float,
    max_probes: int,
    rel_tol: float = 0.1,
    grow: float = 2.0,
) -> RateSearch:
    """The highest rate at which ``probe(rate)`` passes, in at most ``max_probes`` calls.

    ``known``: results already measured (rate, passed). The answer is the highest passing rate
    below the lowest failing one (so a noisy pass above a failure does not count). Without a
    failure the search extends up by ``grow``; without a pass, down; then it bisects until the
    bracket is within ``rel_tol`` of its top. ``probe`` may return (passed, detail).
    """
    points: dict[float, bool] = {}
    probes: list[dict[str, Any]] = []
    for rate, ok in known:
        points[rate] = points.get(rate, True) and ok

    def bracket() -> tuple[float, float]:
        hi = min((r for r, ok in points.items() if not ok), default=math.inf)
        lo = max((r for r, ok in points.items() if ok and r < hi), default=0.0)
        return lo, hi

    n = 0
    while n < max_probes:
        lo, hi = bracket()
        if not points:
            rate = start
        elif math.isinf(hi):
            rate = lo * grow
        elif lo == 0.0:
            rate = hi / grow
        elif hi - lo <= rel_tol * hi:
            break
        else:
            rate = (lo + hi) / 2
        out = probe(rate)
        ok, detail = out if isinstance(out, tuple) else (out, {})
        points[rate] = ok
        probes.append({"rate": round(rate, 4), "ok": ok, **detail})
        n += 1
    lo, hi = bracket()
    censored = "above" if math.isinf(hi) else "below" if lo == 0.0 else None
    return RateSearch(round(lo, 4), censored, probes)


def p90_with_failures(ttfts_ms: Sequence[float], failed: int) -> float:
    """p90 TTFT (the driver's linear rule) over the requests with a TTFT plus ``failed``
    infinitely slow ones (failed before a first token); inf when none had one."""
    xs = sorted(ttfts_ms) + [math.inf] * failed
    if not xs:
        return math.inf
    k = (len(xs) - 1) * 0.9
    lo, hi = math.floor(k), math.ceil(k)
    if math.isinf(xs[hi]):
        return math.inf
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def pick_best(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The row that served best (see ``BEST_DEFINITION``); None when every run failed."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return None
    top = max(r["goodput"] for r in ok)
    near = [r for r in ok if r["goodput"] >= top - 0.01]

    def p90(r: dict[str, Any]) -> float:
        v = r.get("ttft_p90_ms")
        return math.inf if v is None else float(v)

    return min(near, key=lambda r: (p90(r), -r["goodput"]))


# -- offline references (same requests, same timing as the live runs) -------------------------


def _cluster(cfg: CompareConfig) -> ClusterConfig:
    return ClusterConfig(
        workers=(cfg.prefill_workers or cfg.workers) * cfg.dp_size,
        policy="round_robin",
        kv_blocks=_kv_blocks(cfg),
        block_size=cfg.block_size,
        timing=cfg.timing,
        speedup=cfg.speedup,
        attention=cfg.attention,
        seed=cfg.seed,
        slo_ttft_ms=cfg.slo_ttft_ms,
    )


def _measured(res: Any, warmup: float) -> np.ndarray:
    """Mask of the requests scheduled after the warm-up (those the live figures count)."""
    return np.frombuffer(res.table.arrival, dtype=np.float64) >= warmup


def neutral_capacity(
    stream: Stream, cfg: CompareConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The pooled-cache cluster's capacity (``CAPACITY_DEFINITION``) as a JSON object with
    ``capacity_rps`` and the probes."""
    cluster = _cluster(cfg)
    pooled = pooled_config(cluster)
    ref: list[float] = []

    def probe(rate: float) -> tuple[bool, dict[str, Any]]:
        if not stream.covers(rate, cfg.duration):
            if progress is not None:
                progress(f"  pooled capacity probe {rate:8.3f} req/s: the workload ends first")
            return False, {"exhausted": True}
        items, warmup = stream.window(rate, cfg.duration)
        arrivals = stream.arrivals(items)
        if not ref:  # the yardstick: cold prefill on ONE real worker, first window's requests
            ref.append(cold_prefill_p99_ms(arrivals, cluster))
        res = simulate(arrivals, pooled)
        mask = _measured(res, warmup)
        ttft = np.frombuffer(res.table.ttft, dtype=np.float64)[mask]
        p99 = float(np.percentile(ttft, 99)) * 1000.0 if len(ttft) else math.inf
        ok = p99 <= cfg.capacity_ttft_factor * ref[0]
        if progress is not None:
            progress(f"  pooled capacity probe {rate:8.3f} req/s: p99 TTFT {p99:9.1f} ms -> "
                     f"{'ok' if ok else 'over'}")  # fmt: skip
        shown = round(p99, 2) if math.isfinite(p99) else None
        return ok, {"ttft_p99_ms": shown, "requests": int(mask.sum())}

    found = search_max_rate(
        probe, start=float(cfg.workers * cfg.dp_size), max_probes=16, rel_tol=0.05, grow=2.0
    )
    if found.rate <= 0:
        raise RuntimeError(f"no rate passed the capacity criterion: {found.probes}")
    fails = [p for p in found.probes if not p["ok"]]
    lowest_fail = min(fails, key=lambda p: p["rate"]) if fails else {}
    return {
        "capacity_rps": found.rate,
        # the workload ran out before the cluster did: load 1.0 is its length's limit
        "workload_limited": bool(lowest_fail.get("exhausted")),
        "basis": "pooled",
        "definition": CAPACITY_DEFINITION,
        "ttft_factor": cfg.capacity_ttft_factor,
        "reference_ms": round(ref[0], 2),
        "limit_ms": round(cfg.capacity_ttft_factor * ref[0], 2),
        "censored": found.censored,
        "probes": found.probes,
    }


def window_bound(stream: Stream, rate: float, cfg: CompareConfig) -> dict[str, Any]:
    """Q1's pooled-cache bound on one run's window: the very requests a live run at ``rate``
    sends, with their arrival times, simulated on the pooled cluster; the hit rate counts the
    requests the live figure counts (scheduled after the warm-up)."""
    items, warmup = stream.window(rate, cfg.duration)
    res = pooled_bound(stream.arrivals(items), _cluster(cfg))
    mask = _measured(res, warmup)
    prompt = int(np.frombuffer(res.table.prompt_tokens, dtype=np.int64)[mask].sum())
    cached = int(np.frombuffer(res.table.cached_tokens, dtype=np.int64)[mask].sum())
    return {
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "requests": int(mask.sum()),
        "sent": len(items),
        "warmup_s": round(warmup, 2),
    }


# -- live runs --------------------------------------------------------------------------------


def _predicted_and_agreed(stack: Stack, replicas: int) -> tuple[float, float]:
    """kvroute's predicted-cached and engine-agreed prompt tokens so far, over its replicas,
    of the requests whose usage the engines reported (``kvroute_checked_predicted_tokens_total``,
    ``kvroute_agreed_cached_tokens_total``): a request the driver cancels at the end of a run
    past capacity has no usage, and counting its prediction would read as imprecision."""
    predicted = agreed = 0.0
    for g in range(replicas):
        predicted += stack.metric_sum("kvroute_checked_predicted_tokens_total", gateway=g)
        agreed += stack.metric_sum("kvroute_agreed_cached_tokens_total", gateway=g)
    return predicted, agreed


def _sim_lag(stack: Stack) -> float:
    """Seconds the simulated engines' ranks have lost to the host so far, per rank on
    average (``step_lag_s`` of every sim worker, summed over its ranks)."""
    states = stack.sim_state()
    ranks = len(states) * stack.config.dp_size
    return float(sum(s.get("step_lag_s", 0.0) for s in states)) / max(ranks, 1)


def _served_per_replica(stack: Stack, replicas: int) -> list[int]:
    """Requests each kvroute replica sent to a worker (``kvroute_requests_total``)."""
    return [int(stack.metric_sum("kvroute_requests_total", gateway=g)) for g in range(replicas)]


def _adopted_per_replica(stack: Stack, replicas: int) -> list[int]:
    """Other replicas' placements each kvroute replica adopted (``kvroute_placements``)."""
    adopted = 'outcome="adopted"'
    return [int(stack.metric_sum("kvroute_placements", g, adopted)) for g in range(replicas)]


def _remote_per_replica(stack: Stack, replicas: int) -> list[int]:
    """Other replicas' requests each kvroute replica counted (``kvroute_remote_requests``)."""
    started = 'outcome="started"'
    return [int(stack.metric_sum("kvroute_remote_requests", g, started)) for g in range(replicas)]


def scrape_workers(urls: list[str], dp_size: int = 1) -> dict[str, dict[str, float]]:
    """Per worker (per data-parallel rank, ``worker-<i>.dp<r>``, when workers have several):
    requests finished, prompt tokens, cached prompt tokens (engine counters)."""
    out = {}
    for i, url in enumerate(urls):
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for rank in range(dp_size) if dp_size > 1 else [None]:
            name = f"worker-{i}" if rank is None else f"worker-{i}.dp{rank}"
            out[name] = {
                "requests": _metric(
                    text, ("vllm:request_success_total", "sglang:num_requests_total"), rank
                ),
                "prompt_tokens": _metric(
                    text, ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total"), rank
                ),
                "cached_tokens": _metric(
                    text, ("vllm:prefix_cache_hits_total", "sglang:cached_tokens_total"), rank
                ),
            }
    return out


def _metric(text: str, names: tuple[str, ...], rank: int | None = None) -> float:
    """The sum of ``names``' series, or of rank ``rank``'s (vLLM labels a data-parallel rank
    ``engine``, SGLang ``dp_rank``)."""
    total = 0.0
    tags = (f'engine="{rank}"', f'dp_rank="{rank}"')
    for line in text.splitlines():
        if line.startswith(names) and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names and (rank is None or any(t in line for t in tags)):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _delta(
    after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    out = {}
    for w, a in after.items():
        b = before.get(w, {})
        d = {k: a[k] - b.get(k, 0.0) for k in a}
        d["hit_rate"] = (
            round(d["cached_tokens"] / d["prompt_tokens"], 4) if d["prompt_tokens"] else 0.0
        )
        out[w] = d
    return out


def _check_systems(systems: Iterable[str]) -> None:
    for s in systems:
        if is_peer(s):
            continue
        kind, _, policy = s.partition("-")
        if kind != "kvroute" or (policy and policy not in KVROUTE_POLICIES):
            raise ValueError(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")


def run_compare(cfg: CompareConfig) -> dict[str, Any]:
    """Run every (system, load) pair and each system's capacity at SLO; write JSON, markdown
    and plots to ``cfg.out_dir`` (the report is on disk after every run)."""
    _check_systems([*cfg.systems, *(cfg.smg_variants if cfg.tune_smg else ())])
    make_policy("ttft", **cfg.policy_params)  # bad parameters fail here, before any process
    gateway_cost(cfg)  # likewise a cost model the engines cannot give
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = dict(cfg.params)
    if cfg.workload == "trace" and not params.get("path"):
        if cfg.synthetic_trace is None:
            raise ValueError("workload 'trace' needs params.path (a Mooncake-format JSONL file)")
        params["path"] = str(write_trace_window(out / "trace.jsonl", **asdict(cfg.synthetic_trace)))
    workload = make_workload(cfg.workload, seed=cfg.seed, **params)
    text = cfg.trace_prompts == "text"
    if workload.prompt_kind == "ids":
        # token-id prompts (traces) go as they are, or spelled as text (see trace_prompts)
        cfg.mode = "completion" if text else "completion_ids"
    stream = Stream(workload, cfg.mode, trace_text=text)
    say = print if cfg.progress else None
    reference: dict[str, Any] = {"kv_blocks_per_worker": _kv_blocks(cfg)}
    if cfg.engine == "vllm-cpu" and not cfg.capacity_rps:
        raise ValueError(
            "engine vllm-cpu: set capacity_rps (the offline capacity estimate models GPU "
            "timing, not a tiny model on one CPU core)"
        )
    if cfg.engine not in ("sim", "vllm-cpu"):
        raise ValueError(f"engine {cfg.engine!r}: expected sim or vllm-cpu")
    if not cfg.capacity_rps:
        reference.update(neutral_capacity(stream, cfg, say))
        cfg.capacity_rps = reference["capacity_rps"]
    else:
        reference.update(capacity_rps=cfg.capacity_rps, basis="given")
    bounds = {str(load): window_bound(stream, load * cfg.capacity_rps, cfg) for load in cfg.loads}
    results: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "workload": workload.describe(),
        "bound_hit_rate": max((b["hit_rate"] for b in bounds.values()), default=None),
        "bound_by_load": {k: b["hit_rate"] for k, b in bounds.items()},
        "capacity_rps": cfg.capacity_rps,
        "config": asdict(cfg),
        "offline_reference": {**reference, "bound_windows": bounds},
        "results": results,
        "capacity_at_slo": {},
        "definitions": {"capacity": CAPACITY_DEFINITION, "capacity_at_slo": SLO_DEFINITION},
        "notes": {s: PEERS[s].note for s in cfg.systems if is_peer(s) and PEERS[s].note},
    }
    adapters = list(cfg.params.get("adapters") or [])
    lora_args = (
        [
            "--set",
            f"lora.adapters={json.dumps(adapters)}",
            "--set",
            f"lora.max_loras={cfg.max_loras}",
        ]
        if adapters
        else []
    )
    stack_cfg = StackConfig(
        workers=cfg.workers,
        dp_size=cfg.dp_size,
        flavor=cfg.flavor,
        prefill_workers=cfg.prefill_workers,
        sim_args=lora_args,
        pool_settings=_pool_settings(cfg, adapters),
        kv_blocks=_kv_blocks(cfg),
        block_size=cfg.block_size,
        speedup=cfg.speedup,
        timing=cfg.timing,
        attention=cfg.attention,
        max_model_len=cfg.max_model_len,
        gateways=0,
        log_dir=out / "logs",
    )
    if cfg.engine == "vllm-cpu":  # real vLLM: 32-token engine blocks, the pool in them
        stack_cfg.engine = "vllm-cpu"
        stack_cfg.vllm_blocks = cfg.kv_blocks or None
        stack_cfg.max_model_len = min(cfg.max_model_len, 8192)
        stack_cfg.start_timeout = 600.0
        if any(s.startswith("vllm-router") for s in cfg.systems):
            stack_cfg.vllm_events = "tcp"  # vllm-router subscribes over TCP only
    with Stack(stack_cfg) as stack:
        runner = _Runner(stack, cfg, stream)
        systems = list(cfg.systems)
        if cfg.tune_smg:
            report["smg_tuning"] = tuning = runner.tune_smg()
            _write_report(report, out)
            best = tuning.get("best")
            if best and "smg-cache_aware" in systems:
                systems = [best if s == "smg-cache_aware" else s for s in systems]
                if best != "smg-cache_aware":
                    report["notes"][best] = (
                        f"smg's best setting on this workload ({BEST_DEFINITION}); it stands "
                        "in for smg-cache_aware"
                    )
        for system in systems:
            rows: list[dict[str, Any]] = []
            for load in cfg.loads:
                row = runner.run(system, load * cfg.capacity_rps, cfg.duration, load=load)
                if "error" not in row:
                    b = bounds[str(load)]["hit_rate"]
                    row["bound_hit_rate"] = b
                    row["hit_rate_vs_bound"] = round(row["hit_rate"] / b, 4) if b else None
                rows.append(row)
                results.append(row)
                if cfg.progress:
                    print(_row_line(row), flush=True)
                _write_report(report, out)
                if isinstance(row.get("missing"), str):
                    break  # the peer is not installed: no point in the other loads
            report["capacity_at_slo"][system] = runner.capacity_at_slo(system, rows)
            _write_report(report, out)
    report["versus"] = versus(results, "kvroute")
    try:
        from loadtest.plots import compare_plots

        report["plots"] = compare_plots(report, out)
    except ImportError as exc:  # matplotlib is in the bench extra
        report["plots"] = f"not drawn: {exc}"
    _write_report(report, out)
    return report


class _Runner:
    """Runs one system at one rate on the stack (see ``run``)."""

    def __init__(self, stack: Stack, cfg: CompareConfig, stream: Stream) -> None:
        self.stack = stack
        self.cfg = cfg
        self.stream = stream
        self._logs = 0  # runs with request logs (numbered in run order)
        self._log_paths: list[str] = []  # the current run's request logs

    def run(
        self, system: str, rate: float, duration: float, load: float | None = None
    ) -> dict[str, Any]:
        cfg = self.cfg
        load = rate / cfg.capacity_rps if load is None else load
        row: dict[str, Any] = {"system": system, "load": round(load, 4), "rate": round(rate, 3)}
        items, warmup = self.stream.window(rate, duration)
        self.stream.arrivals(items)  # completion_ids: the segments get their token ids
        self._log_paths = []
        try:
            row.update(self._run_one(system, items, warmup, duration, f"{system} @ {load:.0%}"))
            if self._log_paths:
                row["request_logs"] = list(self._log_paths)
        except (PeerNotInstalled, PeerUnsupported) as exc:
            row.update(error=str(exc), missing=str(exc))
        except (OSError, TimeoutError, RuntimeError, ValueError) as exc:
            # one system failing (a peer that will not start, workers that will not drain)
            # must not cost the runs already done or the systems after it
            row["error"] = f"{type(exc).__name__}: {exc}"
        return row

    def tune_smg(self) -> dict[str, Any]:
        cfg = self.cfg
        rate = cfg.tune_load * cfg.capacity_rps
        rows = []
        for variant in cfg.smg_variants:
            row = self.run(variant, rate, cfg.duration, load=cfg.tune_load)
            if cfg.progress:
                print("tune " + _row_line(row), flush=True)
            rows.append(row)
        best = pick_best(rows)
        return {
            "load": cfg.tune_load,
            "rate": round(rate, 3),
            "criterion": BEST_DEFINITION,
            "best": None if best is None else best["system"],
            "results": rows,
        }

    def capacity_at_slo(self, system: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
        cfg = self.cfg
        done = [r for r in rows if "error" not in r]
        if not done:
            return {"capacity_at_slo_rps": None, "error": rows[0].get("error") if rows else None}
        duration = cfg.slo_probe_duration or cfg.duration

        def probe(rate: float) -> tuple[bool, dict[str, Any]]:
            if not self.stream.covers(rate, duration):
                return False, {"exhausted": True}  # a burst, not a load level
            row = self.run(system, rate, duration)
            if cfg.progress:
                print("slo  " + _row_line(row), flush=True)
            if "error" in row:
                return False, {"error": row["error"]}
            return bool(row["slo_ok"]), _probe_detail(row)

        known = [(r["rate"], bool(r["slo_ok"])) for r in done]
        found = search_max_rate(
            probe,
            known=known,
            start=done[0]["rate"],
            max_probes=cfg.slo_probes,
            rel_tol=cfg.slo_rel_tol,
            grow=1.5,
        )
        sweep = [{"rate": r["rate"], "ok": r["slo_ok"], **_probe_detail(r)} for r in done]
        return {
            "capacity_at_slo_rps": found.rate,
            "fraction_of_capacity": round(found.rate / cfg.capacity_rps, 4),
            "censored": found.censored,
            "slo_ttft_ms": cfg.slo_ttft_ms,
            "probes": sweep + found.probes,
        }

    def _request_log(self, label: str, g: int) -> dict[str, Any]:
        """Gateway settings for replica ``g`` of the run ``label``: its request log under
        ``<out_dir>/requests/`` when ``request_log`` is on (else none)."""
        if not self.cfg.request_log:
            return {}
        if g == 0:
            self._logs += 1
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
        path = Path(self.cfg.out_dir) / "requests" / f"{self._logs:02d}-{name}.g{g}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a run's own records only
        self._log_paths.append(str(path))
        return {"request_log": {"path": str(path)}}

    def _run_one(
        self, system: str, items: list[WorkItem], warmup: float, duration: float, label: str
    ) -> dict[str, Any]:
        stack, cfg = self.stack, self.cfg
        peers: list[Peer] = []
        urls: list[str] = []
        if is_peer(system):
            spec = peer_spec(system)
            if cfg.mode == "completion_ids" and not spec.token_ids:
                raise PeerUnsupported(
                    f"{system}: its /v1/completions takes text prompts only, and this workload "
                    "is sent as token ids (traces: trace_prompts: text includes it)"
                )
            _reset_workers(stack)
            pool = pool_from_stack(stack)
            for g in range(cfg.replicas):
                peer = launch(
                    spec,
                    pool,
                    stack.log_dir,
                    label=f"{system}-{g}",
                    extra_args=cfg.peer_args.get(system, ()),
                )
                stack.add_process(peer.proc)
                peers.append(peer)
            try:
                for peer in peers:
                    peer.wait_ready()
            except BaseException:
                _stop_peers(stack, peers)
                raise
            urls = [peer.url for peer in peers]  # once ready: a peer that lost a port moved
        else:
            _, _, policy = system.partition("-")
            stack.config.policy = policy or "ttft"
            stack.config.policy_params = {} if policy else dict(cfg.policy_params)
            for g in range(cfg.replicas):
                logged = self._request_log(label, g)
                if g < len(stack.gateways):
                    stack.restart_gateway(g, **logged)
                else:
                    stack.start_gateway(g, **logged)
            stack.wait_ready()
            urls = stack.gateway_urls[: cfg.replicas]
            _reset_workers(stack)
        kvroute = not peers
        try:
            snap: dict[str, dict[str, dict[str, float]]] = {}
            timer = threading.Timer(
                warmup,
                lambda: snap.setdefault(
                    "at_warmup", scrape_workers(stack.worker_urls, stack.config.dp_size)
                ),
            )
            dcfg = DriverConfig(
                base_url=urls[0],
                model=stack.config.model,
                mode=cfg.mode,  # type: ignore[arg-type]
                max_duration=warmup + duration,
                drain_timeout=max(60.0, duration),
                slo_ttft_ms=cfg.slo_ttft_ms,
                progress=cfg.progress,
                label=label,
            )
            lag = _sim_lag(stack) if cfg.engine == "sim" else None
            timer.start()
            try:
                result = asyncio.run(run_load(items, dcfg, base_urls=urls))
            finally:
                timer.cancel()
            if lag is not None:  # engine time the simulated workers lost to this host
                lost = _sim_lag(stack) - lag
                lag = round(lost / result.duration, 4) if result.duration > 0 else None
            before = snap.get("at_warmup") or scrape_workers(
                stack.worker_urls, stack.config.dp_size
            )
            per_worker = _delta(scrape_workers(stack.worker_urls, stack.config.dp_size), before)
            precision = None
            served: list[int] | None = None
            adopted: list[int] | None = None
            remote: list[int] | None = None
            if kvroute:  # the whole run: its gateways started with it, counters at zero
                predicted, agreed = _predicted_and_agreed(stack, cfg.replicas)
                if predicted > 0:
                    precision = round(agreed / predicted, 4)
                served = _served_per_replica(stack, cfg.replicas)
                adopted = _adopted_per_replica(stack, cfg.replicas)
                remote = _remote_per_replica(stack, cfg.replicas)
        finally:
            _stop_peers(stack, peers)
        measured = [
            r
            for r in result.records
            if r.scheduled >= warmup and r.error != "not sent: beyond max_duration"
        ]
        s = summarize(measured, duration, cfg.slo_ttft_ms)
        bal = balance(
            {w: v["requests"] for w, v in per_worker.items()},
            {w: v["prompt_tokens"] for w, v in per_worker.items()},
        )
        engine_prompt = sum(v["prompt_tokens"] for v in per_worker.values())
        engine_cached = sum(v["cached_tokens"] for v in per_worker.values())
        # TTFTs measured, the run's end cutting some after their first token (the driver's
        # ``timed``); the rest failed before one (infinitely slow for the SLO's p90)
        ttfts = sorted(round(r.ttft * 1000, 2) for r in measured if r.timed and r.ttft is not None)
        p90 = p90_with_failures(ttfts, len(measured) - len(ttfts))
        return {
            "hit_rate": s["hit_rate"],
            "engine_hit_rate": round(engine_cached / engine_prompt, 4) if engine_prompt else 0.0,
            "ttft_p50_ms": s["ttft_p50_ms"],
            "ttft_p90_ms": s["ttft_p90_ms"],
            "ttft_p99_ms": s["ttft_p99_ms"],
            "ttft_mean_ms": s["ttft_mean_ms"],
            "e2e_p50_ms": s["e2e_p50_ms"],
            "itl_p50_ms": s["itl_p50_ms"],
            "goodput": s["goodput"],
            "throughput_rps": s["throughput_rps"],
            "requests": s["requests"],
            "failed": s["failed"],
            "errors": s["errors"],  # why they failed (e.g. "cancelled at the end of the run")
            "slo_ok": p90 <= cfg.slo_ttft_ms,
            "max_mean_load": bal["max_mean_requests"],
            "max_mean_tokens": bal["max_mean_tokens"],
            # the work that must balance: prefill of the uncached prompt tokens per worker
            # (request counts mislead when prompt lengths have a long tail, as traces do)
            "max_mean_prefill": balance(
                {},
                {w: v["prompt_tokens"] - v["cached_tokens"] for w, v in per_worker.items()},
            )["max_mean_tokens"],
            "per_worker": per_worker,
            # Q8: of the prompt tokens kvroute's index predicted cached on the chosen worker,
            # the fraction the engine reported reused (per request min(predicted, reported)),
            # over the whole run; None for peers (no index to check) or no prediction
            "index_precision": precision,
            # Q4: measured requests by the endpoint (replica) the client sent them to, and
            # kvroute's replicas' own count of the requests each routed (the whole run)
            "per_replica": [sum(1 for r in measured if r.endpoint == u) for u in urls],
            "routed_per_replica": served,
            # placements (speculative inserts) each replica adopted from the others
            "placements_adopted_per_replica": adopted,
            # other replicas' requests each counted in its load views (replicas.share_load)
            "remote_requests_per_replica": remote,
            "warmup_s": round(warmup, 1),
            # share of the run the simulated engines (per rank, on average) sat between steps
            # with work waiting, the host's event loop late: a fairness check (a router whose
            # own process eats this machine's CPU slows the simulated GPUs); None: real engines
            "sim_lag_share": lag,
            "ttfts_ms": ttfts,
            # by request (the window's index; None: failed), so that systems pair up
            "ttft_by_request_ms": [
                [r.index, round(r.ttft * 1000, 2) if r.timed and r.ttft is not None else None]
                for r in sorted(measured, key=lambda r: r.index)
            ],
        }


def _probe_detail(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in ("ttft_p90_ms", "goodput", "requests", "failed")}


def _stop_peers(stack: Stack, peers: list[Peer]) -> None:
    for peer in peers:
        peer.stop()
        if peer.proc in stack.extra:
            stack.extra.remove(peer.proc)


def _write_report(report: dict[str, Any], out: Path) -> None:
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=_json_default))
    (out / "compare.md").write_text(markdown(report))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float | np.floating):
        return None if not math.isfinite(float(obj)) else float(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return str(obj)


#: engine gauges of requests still in a worker (vLLM and SGLang names)
BUSY_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
)


def _busy_requests(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            total += _metric(resp.read().decode(), BUSY_METRICS)
    return total


def _reset_workers(stack: Stack, timeout: float = 300.0) -> None:
    """Empty every worker's cache the engine's own way (AllBlocksCleared) and wait for the
    gateways' indexes to follow.

    An overloaded run (round robin past its capacity) leaves a backlog that the engines
    work off, or abort as their clients disconnect, after the driver stops; a request still
    running would cache blocks again after the reset. So: wait until no worker runs or
    queues a request, then reset, and reset again if blocks came back meanwhile."""
    deadline = time.monotonic() + timeout
    while (busy := _busy_requests(stack.worker_urls)) > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers still busy ({busy:g} requests) {timeout:g}s after a run")
        time.sleep(0.5)
    path = "/flush_cache" if stack.config.flavor == "sglang" else "/reset_prefix_cache"
    # vLLM publishes KV events once per engine step, so an idle engine's AllBlocksCleared
    # waits for its next step: a one-token request (no full block to cache) makes one
    nudge = {"model": stack.config.model, "prompt": "a", "max_tokens": 1}
    while True:
        for url in stack.worker_urls:
            req = urllib.request.Request(url + path, data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                resp.read()
            if stack.vllm is not None:
                post_json(url + "/v1/completions", nudge, timeout=60)
        again = time.monotonic() + 10.0
        while time.monotonic() < again:
            if not any(w["index_blocks"] for url in stack.gateway_urls for w in stack.workers(url)):
                return
            time.sleep(0.1)
        if time.monotonic() > deadline:
            raise TimeoutError("gateway index not cleared after resetting the workers' caches")


# -- output -----------------------------------------------------------------------------------


def _row_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return (
            f"{r['system']:<26} load {r['load']:.2f} rate {r['rate']:7.2f}/s  FAILED: {r['error']}"
        )
    return (
        f"{r['system']:<26} load {r['load']:.2f} rate {r['rate']:7.2f}/s  hit {r['hit_rate']:.3f}  "
        f"ttft p50 {r['ttft_p50_ms']} p90 {r['ttft_p90_ms']} p99 {r['ttft_p99_ms']} ms  "
        f"goodput {r['goodput']:.3f}  max/mean {r['max_mean_load']}  failed {r['failed']}"
        + (f"  sim lag {lag:.1%}" if (lag := r.get("sim_lag_share")) is not None else "")
    )


#: markdown column -> result key
COLUMNS = {
    "system": "system",
    "load": "load",
    "rate (req/s)": "rate",
    "hit rate": "hit_rate",
    "bound": "bound_hit_rate",
    "TTFT p50 (ms)": "ttft_p50_ms",
    "TTFT p90 (ms)": "ttft_p90_ms",
    "TTFT p99 (ms)": "ttft_p99_ms",
    "goodput": "goodput",
    "max/mean load": "max_mean_load",
    "max/mean prefill": "max_mean_prefill",
    "failed": "failed",
}


VERSUS_NOTE = (
    f"kvroute's TTFT quantile over each system's, on the requests both served, with the "
    f"{LEVEL:.0%} interval of a paired bootstrap ({RESAMPLES:,} resamplings of the requests): "
    "**lower** / **higher** when the whole interval is below / above 1, *level* when it "
    "holds 1 (this window cannot tell the two apart)"
)


def _versus_markdown(rows: list[dict[str, Any]]) -> str:
    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "too few requests"
        if r["low"] is None:
            return f"{r['ratio']:.3f} (too few requests past it for an interval)"
        word = r["verdict"] if r["verdict"] == "level" else f"**{r['verdict']}**"
        return f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}] {word}"

    if not rows:
        return ""
    table = [
        {
            "load": r["load"],
            "against": r["system"],
            "requests": r.get("pairs", ""),
            "p50 ratio [interval]": cell(r["p50"]),
            "p99 ratio [interval]": cell(r["p99"]),
        }
        for r in rows
    ]
    return f"\n{VERSUS_NOTE}:\n\n" + format_table(table, markdown=True) + "\n"


def _kvroute_settings(config: dict[str, Any]) -> str:
    """A line naming the kvroute gateway's settings that are not its defaults (the cost model
    and the policy's parameters), so that a report says what it measured; "" when none."""
    said = []
    cost = config.get("gateway_cost", "default")
    if cost != "default":
        said.append(f"cost model `{cost}` (the simulated engines' own coefficients)")
    if config.get("cost_params"):
        said.append(f"cost settings `{json.dumps(config['cost_params'], sort_keys=True)}`")
    if config.get("policy_params"):
        said.append(f"policy parameters `{json.dumps(config['policy_params'], sort_keys=True)}`")
    return f"kvroute's gateway: {'; '.join(said)}.\n\n" if said else ""


def markdown(report: dict[str, Any]) -> str:
    def cells(r: dict[str, Any]) -> dict[str, Any]:
        row = {col: r.get(key, "") for col, key in COLUMNS.items()}
        if "error" in r:
            row["failed"] = f"run failed: {r['error']}"
        return row

    head = f"Workload: `{json.dumps(report['workload'])}`\n\n"
    cap = report.get("capacity_rps")
    if cap:
        head += f"Load 1.0 = **{cap:g} req/s**"
        if (report.get("offline_reference") or {}).get("basis") == "pooled":
            head += (
                ": the policy-neutral capacity, that of the pooled-cache cluster (one worker "
                "with all the cluster's KV and compute, no routing)"
            )
        head += ".\n\n"
    head += _kvroute_settings(report.get("config") or {})
    if report.get("bound_by_load"):
        bounds = ", ".join(f"{k}: {v:.3f}" for k, v in report["bound_by_load"].items())
        head += f"Pooled-cache bound on the hit rate of each run's measured window: {bounds}\n\n"
    text = head + format_table([cells(r) for r in report["results"]], markdown=True) + "\n"
    precision = [
        f"{r['system']} @ {r['load']:g}: {r['index_precision']:.4f}"
        for r in report["results"]
        if r.get("index_precision") is not None
    ]
    if precision:  # Q8: predicted-cached tokens the engines reported reused
        text += "\nIndex precision (Q8, ≥ 0.98): " + "; ".join(precision) + "\n"
    spread = [
        f"{r['system']} @ {r['load']:g}: {' / '.join(map(str, r['per_replica']))}"
        for r in report["results"]
        if len(r.get("per_replica") or ()) > 1
    ]
    if spread:  # Q4: the client's round-robin front over each system's replicas
        text += "\nMeasured requests per replica (Q4, a round-robin front): " + "; ".join(spread)
        text += "\n"
    text += _versus_markdown(report.get("versus") or [])
    slo = report.get("capacity_at_slo") or {}
    if slo:
        rows = []
        for system, c in slo.items():
            rate = c.get("capacity_at_slo_rps")
            if rate is None:
                shown = f"run failed: {c.get('error')}"
            elif c.get("censored") == "below":
                shown = f"< {min(p['rate'] for p in c['probes']):g}"
            else:
                shown = ("≥ " if c.get("censored") == "above" else "") + f"{rate:g}"
            rows.append(
                {
                    "system": system,
                    "capacity at SLO (req/s)": shown,
                    "fraction of load 1.0": c.get("fraction_of_capacity", ""),
                    "runs": len(c.get("probes", [])),
                }
            )
        any_slo = next(iter(slo.values())).get("slo_ttft_ms", "")
        text += f"\nCapacity at SLO (p90 TTFT ≤ {any_slo} ms):\n\n"
        text += format_table(rows, markdown=True) + "\n"
    tuning = report.get("smg_tuning")
    if tuning:
        rows = [cells(r) for r in tuning["results"]]
        text += f"\nsmg settings at load {tuning['load']} (best: **{tuning['best']}**):\n\n"
        text += format_table(rows, markdown=True) + "\n"
    notes = report.get("notes") or {}
    if notes:
        text += "\n" + "\n".join(f"* `{s}`: {n}" for s, n in notes.items()) + "\n"
    if any(PEERS[s].historical for s in notes if s in PEERS):
        text += f"\nHistorical rows: {HISTORICAL_NOTE}.\n"
    return text
