"""``kvroute bench gateway``: what the gateway costs (targets P5, P6; P4 beside them), beside
``smg`` and ``vllm-router`` on the same simulated worker(s) in the same invocation.

Real processes on loopback: Redis, the engine simulator (``kvroute sim``, ``--speedup``
1000: a follow-up turn's prefill and decode steps take microseconds of engine time, and what
the worker costs is its own Python work per request), an agent per worker, one kvroute
gateway process, and each peer router as its own process.

**P5, added latency** (targets.md: "TTFT through it - TTFT direct to the same worker,
8,000-token chats, each request a new turn, several conversations in flight, 100 req/s per
gateway process"). Per system, in phases that alternate between the systems (``--rounds``,
ABC CBA ...), each phase with fresh conversations:

* every request is the next turn of its conversation: the chat so far, the reply just
  streamed back and a new user message, so the worker has the previous turn cached and the
  reply and the new message not. Chats start below ``--prompt-tokens`` and grow through it
  (``prompt_tokens_mean``/``_min``/``_max`` are the engine's own counts); every conversation's
  opening turn is sent before measuring, unmeasured;
* turns arrive open-loop, Poisson at ``--rate`` per second through the router, spread over
  ``--conversations`` conversations (an arrival takes the idle conversation that waited
  longest), so many are active at once and requests overlap (``in_flight_mean``/``_max``:
  requests in flight, routed and direct, seen at each send);
* one arrival in ``--direct-every`` goes to a *twin pair*: two conversations with the same
  shape (lengths, reply size) and different words, so neither reuses the other's cache. The
  routed twin goes through the router, the direct twin straight to the worker half a mean
  gap before or after it (drawn at random): the same cache state, the same moment, so drift
  hits both paths alike. The other arrivals are routed conversations alone, there to bring
  the router to ``--rate`` while the worker serves ``rate x (1 + 1/N)`` requests/s (the
  simulator tokenizes every chat in Python: at ``2 x rate`` it, not the router, would set
  the pace on 2 cores);
* TTFT is measured by the client, from the request's send to the first SSE chunk (the
  engine sends none before its first token);
* ``added_p50_ms``/``added_p99_ms`` are percentiles of the *paired* differences (routed twin's
  TTFT - direct twin's TTFT, same arrival). The difference of the two distributions'
  percentiles is reported beside them (``added_dist_*``): the p99 of paired differences
  carries both paths' jitter, the quantile difference does not;
* "the same worker": with one worker (the default) exact; with ``--workers N`` the direct
  twin goes where the router sent the routed twin the turn before when the router says so
  (kvroute's ``x-kvroute-worker``), otherwise to a fixed worker per pair (``direct_to``);
* ``requests_per_cpu_s``: routed requests per CPU-second of the router's process (and any
  children: utime + stime from /proc) over the phase.

``--mode completion`` sends Q3's requests instead (one shared prefix, a new question each) and
``--mode cold`` Q5's cold path (every request a new text: nothing cached in the gateway's
tokenizer or the engine; with ``--shared-words N`` after one N-word head every request
shares, as a production trace's long prompts do), both on ``/v1/completions``; ``--mode rag``
sends chats, each a new conversation under one system prompt (``--shared-words``) whose
message is a new ``--prompt-tokens``-word document (retrieval-augmented traffic). P5's bounds
are applied to each.

``ok`` is P5's verdict for kvroute: added p50 <= 1 ms and <= smg's, p99 <= 2 x smg's, from the
same run (``targets``); each system gets the same checks in its own row. A peer that is not
installed is named under ``missing``, and only the checks that need it fail.

**P6** (``--throughput-seconds``, 0 skips it): short prompts, 64 streamed tokens each,
``--concurrency`` clients closed-loop; requests completed per CPU-second of each router
process (``p6``; its own ``ok``: kvroute's >= smg's). The simulated workers and the client share
the machine's cores, so wall-clock req/s says more about the machine than the proxy.

``--gateway-processes N`` runs kvroute as N processes on one port (``server.workers``); P6 then
names the requests each process sent upstream (``requests_per_process``), and the CPU is the
whole process tree's.

**P4**: ``tokenize_followup_ratio`` from ``kvroute bench tokenize`` (``--tokenize-repeats``, 0
skips it); and, with ``--stall-seconds`` (0 skips them), the stall phases of
``loadtest/benchmarks/_stall.py``: short chats' added TTFT while cold long prompts arrive,
through a gateway that encodes them on a thread and one that does not, and what a new
conversation under a known system prompt costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import msgspec

from gateway.config import PoolSettings
from loadtest.benchmarks import _stall
from loadtest.peers import Peer, PeerNotInstalled, is_peer, launch, peer_spec, pool_from_stack
from loadtest.simulate import parse_params
from loadtest.stack import Stack, StackConfig
from loadtest.workloads import WORDS

NAME = "gateway"
HELP = (
    "gateway cost beside smg and vllm-router: added TTFT on growing 8,000-token chats at "
    "100 req/s (P5), requests per CPU-second (P6), tokenization follow-up ratio (P4)"
)

KVROUTE = "kvroute"
SMG = "smg-cache_aware"
VLLM_ROUTER = "vllm-router-kv_aware"
DEFAULT_SYSTEMS = (KVROUTE, SMG, VLLM_ROUTER)

# targets.md, P5
P5_P50_MS = 1.0  # added latency p50 <= 1 ms ...
P5_P99_VS_SMG = 2.0  # ... and p99 <= 2x smg's (p50 <= smg's too)
#: below this many measured pairs a system's figures are not judged (``sane``)
MIN_PAIRS = 20
#: arrivals that may find every conversation still busy (a stall) before a run is not sane
MAX_SKIPPED = 0.01

T = TypeVar("T")

CONFIG_KEYS = (
    "rate", "duration", "warmup", "rounds", "conversations", "direct_every", "prompt_tokens",
    "user_tokens", "max_tokens", "workers", "speedup", "kv_blocks", "seed", "gateway_processes",
    "mode", "pool_set", "shared_words",
)  # fmt: skip

_encode = msgspec.json.encode
_decode = msgspec.json.decode


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--rate", type=float, default=100.0, help="routed requests/s per router (open loop)")
    a("--duration", type=float, default=20.0, help="seconds of measured traffic per phase")
    a("--warmup", type=float, default=1.0, help="seconds of traffic sent, not counted, per phase")
    a("--rounds", type=int, default=2, help="phases per system, alternating between systems")
    a("--conversations", type=int, default=48, help="routed conversations per phase")
    a(
        "--direct-every",
        type=int,
        default=2,
        help="one arrival in N is a twin pair (routed + direct), the others routed alone: the "
        "worker serves rate x (1 + 1/N) requests/s",
    )
    a(
        "--mode",
        choices=("chat", "completion", "cold", "rag"),
        default="chat",
        help="chat: multi-turn chats growing through --prompt-tokens (P5); completion: Q3's "
        "requests, one --prompt-tokens-word prefix shared by all and a new --user-tokens "
        "question each, on /v1/completions; cold: Q5's cold path, every request a new "
        "--prompt-tokens-word text on /v1/completions (nothing cached in the gateway or the "
        "engine); rag: every request a new chat under one system prompt of --shared-words "
        "words (200 when 0), its user message a new --prompt-tokens-word document",
    )
    a("--prompt-tokens", type=int, default=8000, help="chat size the conversations grow through")
    a(
        "--shared-words",
        type=int,
        default=0,
        help="--mode cold: every new text starts with one prefix of this many words, as a "
        "production trace's prompts share a short head (0: none); --mode rag: the system "
        "prompt's words",
    )
    a("--user-tokens", type=int, default=32, help="words in each new user message")
    a("--max-tokens", type=int, default=8, help="streamed tokens per reply")
    a("--workers", type=int, default=1)
    a("--speedup", type=float, default=1000.0, help="engine simulator speed-up")
    a("--kv-blocks", type=int, default=65536, help="KV blocks per simulated worker")
    a(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help="comma-separated: kvroute and peer systems (loadtest/peers.py PEERS)",
    )
    a("--throughput-seconds", type=float, default=10.0, help="P6 run per system (0: skip)")
    a("--concurrency", type=int, default=32, help="P6 closed-loop clients")
    a("--tokenize-repeats", type=int, default=9, help="P4 ratio repeats (0: skip)")
    a(
        "--gateway-processes",
        type=int,
        default=1,
        help="kvroute processes sharing the gateway's port (server.workers, SO_REUSEPORT); "
        "P5 targets one process, P6 shows how N share the load",
    )
    a(
        "--pool-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of kvroute's pool (gateway/config.py PoolSettings; the value read as "
        "YAML), e.g. tokenize_overlap_cold=false: an A/B of one setting in two runs",
    )
    _stall.add_arguments(p)
    a("--seed", type=int, default=1)
    a("--log-dir", default="")


# -- small helpers ------------------------------------------------------------------------------


def _text(rng: random.Random, n: int) -> str:
    return "".join(" " + rng.choice(WORDS) for _ in range(max(1, n)))


def _pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, linear between order statistics."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(x: float) -> float | None:
    return None if math.isnan(x) else round(x * 1e3, 3)


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid``, its threads and its live descendants (Linux /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(entry)] = int(_stat_fields(int(entry))[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    ticks = 0
    for p in tree:
        with contextlib.suppress(OSError, IndexError, ValueError):
            f = _stat_fields(p)
            ticks += int(f[11]) + int(f[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop when installed (a cheaper client), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a gateway dependency
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


# -- one request --------------------------------------------------------------------------------


@dataclass
class Sample:
    kind: str  # "routed" | "direct"
    ttft: float = math.nan  # seconds, client side
    reply: str = ""
    worker: str = ""  # x-kvroute-worker, when the router says
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


async def _stream_chat(
    session: aiohttp.ClientSession, url: str, body: bytes, kind: str, completion: bool = False
) -> Sample:
    """POST a streamed chat (``completion``: a completion); TTFT is the first SSE chunk with
    text (the engine sends none before its first token); the reply text and the usage chunk
    are collected from the rest."""
    out = Sample(kind)
    parts: list[str] = []
    marker = b'"text"' if completion else b'"content"'
    t0 = time.perf_counter()
    try:
        async with session.post(
            url + ("/v1/completions" if completion else "/v1/chat/completions"),
            data=body,
            headers={"content-type": "application/json"},
        ) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return out
            out.worker = resp.headers.get("x-kvroute-worker", "")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                if math.isnan(out.ttft) and marker in line:
                    out.ttft = time.perf_counter() - t0
                data = line[5:].strip()
                if data == b"[DONE]":
                    continue  # read on to the end: the connection goes back to the pool
                chunk = _decode(data)
                for choice in chunk.get("choices") or ():
                    if completion:
                        parts.append(choice.get("text") or "")
                    else:
                        parts.append((choice.get("delta") or {}).get("content") or "")
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = int(details.get("cached_tokens") or 0)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    if math.isnan(out.ttft):
        out.error = "stream without a token"
    out.reply = "".join(parts)
    return out


# -- the P5 phase -------------------------------------------------------------------------------


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    rng: random.Random
    home: str = ""  # the worker URL it lives on, when known
    #: --mode completion: the shared prefix; each request is it + the last user message
    #: (--mode cold: an empty prefix)
    prefix: str | None = None
    #: words of each new question (--user-tokens; --mode cold: the whole --prompt-tokens)
    question_words: int = 0
    #: --mode rag: each turn is a new conversation (its last message replaced, not answered)
    renew: bool = False


@dataclass
class TwinPair:
    """A routed conversation and, in a twin pair, its direct twin (None: a routed
    conversation alone, there to bring the router to ``--rate``)."""

    index: int
    routed: Conversation
    direct: Conversation | None
    fixed_worker: str


@dataclass
class Phase:
    """One system's measured traffic in one round."""

    system: str
    url: str
    pairs: list[tuple[Sample, Sample]] = field(default_factory=list)  # (routed, direct)
    solo: list[Sample] = field(default_factory=list)  # routed turns without a twin
    errors: list[str] = field(default_factory=list)
    skipped: int = 0
    slots: int = 0
    routed_sent: int = 0
    direct_sent: int = 0
    routed_ok: int = 0
    in_flight: list[int] = field(default_factory=list)  # sampled at every send
    send_lag: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu_s: float | None = None


def _make_conversations(
    args: argparse.Namespace, worker_urls: list[str], seed: str, start_words: int
) -> tuple[list[TwinPair], list[TwinPair]]:
    """``--conversations`` routed conversations: one in ``--direct-every`` with a direct twin
    (twin pairs), the others alone. Every conversation opens with a shared 200-word head,
    then its own history; twins have the same lengths and different words."""
    shared = random.Random(f"{seed}-system")
    system_prompt = _text(shared, 200)  # a short shared head, as real deployments have
    hot = None  # chats
    if args.mode == "completion":
        hot = _text(shared, args.prompt_tokens)
    elif args.mode == "cold":
        hot = _text(shared, args.shared_words) if args.shared_words > 0 else ""
    elif args.mode == "rag" and args.shared_words > 0:
        system_prompt = _text(shared, args.shared_words)
    question_words = args.prompt_tokens if args.mode in ("cold", "rag") else args.user_tokens
    n_twins = max(1, math.ceil(args.conversations / max(1, args.direct_every)))
    twins: list[TwinPair] = []
    solos: list[TwinPair] = []
    for i in range(max(args.conversations, n_twins)):
        shape = random.Random(f"{seed}-shape{i}").random()
        convs = []
        for twin in ("a", "b") if i < n_twins else ("a",):
            rng = random.Random(f"{seed}-{i}-{twin}")
            if hot is not None:  # one prefix for every request (or none), a new question each
                question = {"role": "user", "content": _text(rng, question_words)}
                convs.append(
                    Conversation([question], rng, prefix=hot, question_words=question_words)
                )
                continue
            if args.mode == "rag":  # one system prompt, a new document each
                document = {"role": "user", "content": _text(rng, question_words)}
                system = {"role": "system", "content": system_prompt}
                convs.append(
                    Conversation([system, document], rng, question_words=question_words, renew=True)
                )
                continue
            history = _text(rng, max(1, start_words - 200 - int(shape * 100)))
            convs.append(
                Conversation(
                    [
                        {"role": "system", "content": system_prompt + history},
                        {"role": "user", "content": _text(rng, args.user_tokens)},
                    ],
                    rng,
                )
            )
        pair = TwinPair(
            i, convs[0], convs[1] if len(convs) > 1 else None, worker_urls[i % len(worker_urls)]
        )
        (twins if pair.direct is not None else solos).append(pair)
    return twins, solos


def _body(model: str, conv: Conversation, max_tokens: int) -> bytes:
    if conv.prefix is not None:
        prompt: dict[str, Any] = {"prompt": conv.prefix + conv.messages[-1]["content"]}
    else:
        prompt = {"messages": conv.messages}
    return _encode(
        {
            "model": model,
            **prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "ignore_eos": True,
        }
    )


def _next_turn(conv: Conversation, reply: str, user_tokens: int) -> None:
    if conv.prefix is not None:  # a completion: the same prefix, a new question
        words = conv.question_words or user_tokens
        conv.messages[-1] = {"role": "user", "content": _text(conv.rng, words)}
        return
    if conv.renew:  # a new conversation under the same system prompt
        conv.messages[-1] = {"role": "user", "content": _text(conv.rng, conv.question_words)}
        return
    conv.messages.append({"role": "assistant", "content": reply})
    conv.messages.append({"role": "user", "content": _text(conv.rng, user_tokens)})


class P5Runner:
    def __init__(
        self,
        args: argparse.Namespace,
        worker_urls: list[str],
        model: str,
        session: aiohttp.ClientSession,
    ) -> None:
        self.args = args
        self.worker_urls = worker_urls
        self.model = model
        self.session = session
        n = max(1, args.conversations)
        turns = args.rate * (args.duration + args.warmup) / n
        growth = turns * (args.user_tokens + args.max_tokens + 8)
        #: where the chats start so that they grow through --prompt-tokens
        self.start_words = max(args.prompt_tokens // 2, int(args.prompt_tokens - growth / 2))

    def _direct_target(self, pair: TwinPair) -> str:
        return pair.routed.home or pair.fixed_worker

    def _home(self, worker_id: str) -> str:
        try:
            return self.worker_urls[int(worker_id.rsplit("-", 1)[1])]
        except (IndexError, ValueError):
            return ""

    async def _open(self, phase: Phase, pairs: list[TwinPair]) -> None:
        """Each conversation's opening turn, unmeasured: routed first (its worker, when the
        router names it, becomes the direct twin's worker), then its direct twin."""
        sem = asyncio.Semaphore(4)
        a = self.args

        async def one(pair: TwinPair) -> None:
            async with sem:
                s = await _stream_chat(
                    self.session,
                    phase.url,
                    _body(self.model, pair.routed, a.max_tokens),
                    "routed",
                    pair.routed.prefix is not None,
                )
                if s.error:
                    raise RuntimeError(f"{phase.system}: opening turn failed: {s.error}")
                pair.routed.home = self._home(s.worker) if s.worker else ""
                _next_turn(pair.routed, s.reply, a.user_tokens)
                if pair.direct is None:
                    return
                d = await _stream_chat(
                    self.session,
                    self._direct_target(pair),
                    _body(self.model, pair.direct, a.max_tokens),
                    "direct",
                    pair.direct.prefix is not None,
                )
                if d.error:
                    raise RuntimeError(f"direct opening turn failed: {d.error}")
                _next_turn(pair.direct, d.reply, a.user_tokens)

        await asyncio.gather(*(one(p) for p in pairs))

    async def run_phase(self, system: str, url: str, pid: int | None, seed: str) -> Phase:
        a = self.args
        phase = Phase(system, url)
        twins, solos = _make_conversations(a, self.worker_urls, seed, self.start_words)
        await self._open(phase, twins + solos)

        rng = random.Random(f"{seed}-arrivals")
        gap = 1.0 / a.rate
        total = a.warmup + a.duration
        times, t = [], 0.0
        while t < total:
            times.append(t)
            t += rng.expovariate(a.rate)
        # least recently used first; a twin pair every --direct-every arrivals
        idle_twins, idle_solos = list(twins), list(solos)
        every = max(1, a.direct_every)
        in_flight = 0
        tasks: list[asyncio.Task[None]] = []

        async def send(conv: Conversation, target: str, kind: str, delay: float) -> Sample:
            nonlocal in_flight
            if delay > 0:
                await asyncio.sleep(delay)
            body = _body(self.model, conv, a.max_tokens)
            in_flight += 1
            phase.in_flight.append(in_flight)
            try:
                return await _stream_chat(self.session, target, body, kind, conv.prefix is not None)
            finally:
                in_flight -= 1

        def done(pair: TwinPair, s: Sample) -> bool:
            if s.error:
                phase.errors.append(f"{s.kind}: {s.error}")
                return False
            conv = pair.routed if s.kind == "routed" else pair.direct
            assert conv is not None
            if s.kind == "routed":
                phase.routed_ok += 1
                if s.worker:
                    conv.home = self._home(s.worker)
            _next_turn(conv, s.reply, a.user_tokens)
            return True

        async def twin_slot(pair: TwinPair, counted: bool, direct_first: bool) -> None:
            assert pair.direct is not None
            direct_to = self._direct_target(pair)
            r_delay, d_delay = (gap / 2, 0.0) if direct_first else (0.0, gap / 2)
            phase.routed_sent += 1
            phase.direct_sent += 1
            r, d = await asyncio.gather(
                send(pair.routed, url, "routed", r_delay),
                send(pair.direct, direct_to, "direct", d_delay),
            )
            ok_r, ok_d = done(pair, r), done(pair, d)
            if counted and ok_r and ok_d:
                phase.pairs.append((r, d))
            idle_twins.append(pair)

        async def solo_slot(pair: TwinPair, counted: bool) -> None:
            phase.routed_sent += 1
            r = await send(pair.routed, url, "routed", 0.0)
            if done(pair, r) and counted:
                phase.solo.append(r)
            idle_solos.append(pair)

        loop = asyncio.get_running_loop()
        cpu0 = _tree_cpu_seconds(pid) if pid else None
        t0 = loop.time()
        for i, at in enumerate(times):
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            phase.send_lag.append(max(0.0, loop.time() - (t0 + at)))
            phase.slots += 1
            counted = at >= a.warmup
            idle = idle_twins if i % every == 0 or not solos else idle_solos
            if not idle:
                phase.skipped += 1  # every conversation still waiting: the system stalls
                continue
            pair = idle.pop(0)
            if pair.direct is not None:
                coro = twin_slot(pair, counted, rng.random() < 0.5)
            else:
                coro = solo_slot(pair, counted)
            tasks.append(asyncio.create_task(coro))
        await asyncio.gather(*tasks)
        phase.wall = loop.time() - t0
        if cpu0 is not None and pid:
            phase.cpu_s = _tree_cpu_seconds(pid) - cpu0
        return phase


def _summarize(system: str, phases: list[Phase], args: argparse.Namespace) -> dict[str, Any]:
    pairs = [p for ph in phases for p in ph.pairs]
    routed = [r.ttft for r, _ in pairs]
    direct = [d.ttft for _, d in pairs]
    diffs = [r.ttft - d.ttft for r, d in pairs]
    routed_sent = sum(ph.routed_sent for ph in phases)
    direct_sent = sum(ph.direct_sent for ph in phases)
    solo = [x.ttft for ph in phases for x in ph.solo]
    errors = [e for ph in phases for e in ph.errors]
    in_flight = [n for ph in phases for n in ph.in_flight]
    wall = sum(ph.wall for ph in phases)
    cpus = [ph.cpu_s for ph in phases]
    cpu = None if any(c is None for c in cpus) else sum(c or 0.0 for c in cpus)
    routed_done = sum(ph.routed_ok for ph in phases)

    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 1) if xs else None

    def cached(kind: int) -> float | None:
        prompt = sum(p[kind].prompt_tokens for p in pairs)
        return round(sum(p[kind].cached_tokens for p in pairs) / prompt, 4) if prompt else None

    workers = {r.worker for r, _ in pairs}
    if args.workers == 1:
        direct_to = "the one worker (same worker, exact)"
    elif workers and "" not in workers:
        direct_to = "the worker the router chose for the twin's previous turn (x-kvroute-worker)"
    else:
        direct_to = "a fixed worker per twin pair (the router does not say where it sent)"
    lag = [x for ph in phases for x in ph.send_lag]
    return {
        "system": system,
        "pairs": len(pairs),
        "routed_requests": routed_sent,
        "direct_requests": direct_sent,
        "errors": len(errors),
        "error_examples": errors[:3],
        "slots": sum(ph.slots for ph in phases),
        "slots_skipped": sum(ph.skipped for ph in phases),
        "direct_ttft_p50_ms": _ms(_pct(direct, 0.5)),
        "direct_ttft_p99_ms": _ms(_pct(direct, 0.99)),
        "routed_ttft_p50_ms": _ms(_pct(routed, 0.5)),
        "routed_ttft_p99_ms": _ms(_pct(routed, 0.99)),
        "routed_alone_ttft_p50_ms": _ms(_pct(solo, 0.5)),
        "routed_alone_ttft_p99_ms": _ms(_pct(solo, 0.99)),
        "added_p50_ms": _ms(_pct(diffs, 0.5)),
        "added_p99_ms": _ms(_pct(diffs, 0.99)),
        "added_mean_ms": _ms(sum(diffs) / len(diffs)) if diffs else None,
        "added_dist_p50_ms": _ms(_pct(routed, 0.5) - _pct(direct, 0.5)),
        "added_dist_p99_ms": _ms(_pct(routed, 0.99) - _pct(direct, 0.99)),
        "pairing": "paired: routed TTFT - its twin's direct TTFT in the same arrival slot",
        "direct_to": direct_to,
        "prompt_tokens_mean": mean([float(r.prompt_tokens) for r, _ in pairs]),
        "prompt_tokens_min": min((r.prompt_tokens for r, _ in pairs), default=None),
        "prompt_tokens_max": max((r.prompt_tokens for r, _ in pairs), default=None),
        "cached_fraction_routed": cached(0),
        "cached_fraction_direct": cached(1),
        "in_flight_mean": round(sum(in_flight) / len(in_flight), 2) if in_flight else None,
        "in_flight_max": max(in_flight, default=0),
        "send_lag_p99_ms": _ms(_pct(lag, 0.99)),
        "routed_rps": round(routed_done / wall, 1) if wall else None,
        "router_cpu_s": None if cpu is None else round(cpu, 3),
        "router_cpu_util": None if cpu is None or not wall else round(cpu / wall, 3),
        "requests_per_cpu_s": round(routed_done / cpu, 1) if cpu else None,
    }


def _p5_checks(row: dict[str, Any], smg: dict[str, Any] | None) -> dict[str, bool]:
    """P5's three checks for one system's row against smg's row of the same run (None: smg
    missing or failed, and the checks that need it fail)."""
    p50, p99 = row.get("added_p50_ms"), row.get("added_p99_ms")
    s50 = None if smg is None else smg.get("added_p50_ms")
    s99 = None if smg is None else smg.get("added_p99_ms")
    return {
        "p50_le_1ms": p50 is not None and p50 <= P5_P50_MS,
        "p50_le_smg": p50 is not None and s50 is not None and p50 <= s50,
        "p99_le_2x_smg": p99 is not None and s99 is not None and p99 <= P5_P99_VS_SMG * s99,
    }


# -- P6 (proxy throughput per CPU-second) -------------------------------------------------------


async def _throughput(
    url: str, model: str, pid: int | None, args: argparse.Namespace
) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": model,
            "max_tokens": 64,
            "stream": True,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Say something."}],
        }
    ).encode()
    done = 0
    errors = 0
    stop = time.monotonic() + args.throughput_seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal done, errors
            while time.monotonic() < stop:
                try:
                    async with session.post(
                        url + "/v1/chat/completions",
                        data=body,
                        headers={"content-type": "application/json"},
                    ) as resp:
                        await resp.read()
                        if resp.status == 200:
                            done += 1
                        else:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1

        cpu0 = _tree_cpu_seconds(pid) if pid else 0.0
        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.monotonic() - t0
        cpu = (_tree_cpu_seconds(pid) - cpu0) if pid else 0.0
    return {
        "rps": round(done / wall, 1),
        "cpu_s": round(cpu, 2) if pid else None,
        "rps_per_cpu_s": round(done / cpu, 1) if cpu else None,
        "cpu_ms_per_req": round(cpu * 1e3 / done, 3) if done and cpu else None,
        "errors": errors,
    }


def _per_process(stack: Stack, name: str, args: argparse.Namespace) -> dict[int, float] | None:
    """Requests each kvroute process has sent upstream so far ({pid: n}), with several
    processes on the port (None otherwise): what shows that they share the load."""
    if name != KVROUTE or args.gateway_processes < 2:
        return None
    return {pid: n for pid, n in stack.process_counter("kvroute_requests_total").items()}


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Router:
    system: str
    url: str
    pid: int | None
    peer: Peer | None = None
    note: str = ""


#: kvroute's counters read around its P5 phases (``_count_ratios``)
_COUNTERS = {
    "requests": "kvroute_requests_total",
    "reads": "kvroute_event_reads",
    "entries": "kvroute_event_entries_read",
    "overlapped": "kvroute_tokenization_overlapped_total",
    "held": "kvroute_tokenization_overlap_wait_seconds_count",
    "held_s": "kvroute_tokenization_overlap_wait_seconds_sum",
    "held_0": 'kvroute_tokenization_overlap_wait_seconds_bucket|le="0.0"',
    "prepared": "kvroute_tokenization_seconds_count",
    "prepared_s": "kvroute_tokenization_seconds_sum",
}


def _counters(stack: Stack) -> dict[str, float]:
    out = {}
    for k, series in _COUNTERS.items():
        name, _, label = series.partition("|")
        out[k] = stack.metric_sum(name, label=label)
    return out


def _count_ratios(counts: dict[str, float]) -> dict[str, float | None]:
    """What kvroute's own counters say of its P5 phases (warm-ups included; the events are
    the worker's, of the direct twins' requests too): KV-event reads (round trips to Redis)
    per routed request and entries per read, and the share of requests routed before their
    prompt was encoded (``tokenize_overlap_chats``, ``tokenize_overlap_cold``); of those, the
    share whose first chunk waited for the exact ids and the mean wait over all of them
    (``kvroute_tokenization_overlap_wait_seconds``); the mean time a request's preparation
    took on the loop before it was routed (``kvroute_tokenization_seconds``: render, encode
    and keys, or as far as an overlapped prompt is encoded before it is routed)."""

    def ratio(a: str, b: str) -> float | None:
        return round(counts[a] / counts[b], 3) if counts.get(b) else None

    return {
        "event_reads_per_request": ratio("reads", "requests"),
        "entries_per_event_read": ratio("entries", "reads"),
        "overlapped_fraction": ratio("overlapped", "requests"),
        "overlap_held_fraction": (
            round(1 - counts["held_0"] / counts["held"], 3) if counts.get("held") else None
        ),
        "overlap_wait_mean_ms": (
            round(1e3 * counts["held_s"] / counts["held"], 3) if counts.get("held") else None
        ),
        "prepare_mean_ms": (
            round(1e3 * counts["prepared_s"] / counts["prepared"], 3)
            if counts.get("prepared")
            else None
        ),
    }


def _systems(args: argparse.Namespace) -> list[str]:
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in names:
        if s != KVROUTE and not is_peer(s):
            raise SystemExit(f"--systems: unknown system {s!r}")
    return names


def _start_routers(
    stack: Stack, names: list[str]
) -> tuple[dict[str, Router], dict[str, str], dict[str, str]]:
    """kvroute (the stack's gateway) and every named peer, started and ready; peers that are
    not installed under ``missing``, peers that fail to start under ``failed``."""
    routers: dict[str, Router] = {}
    missing: dict[str, str] = {}
    failed: dict[str, str] = {}
    pool = pool_from_stack(stack)
    for name in names:
        if name == KVROUTE:
            pids = stack.gateway_pids(0)
            proc = stack.gateways[0]
            # several processes: the supervisor, whose process tree holds them all
            pid = pids[0] if len(pids) == 1 else proc.pid
            note = "policy ttft" + (f", {len(pids)} processes" if len(pids) > 1 else "")
            routers[name] = Router(name, stack.gateway_urls[0], pid, note=note)
            continue
        try:
            peer = launch(name, pool, stack.log_dir)
        except PeerNotInstalled as exc:
            missing[name] = str(exc)
            continue
        stack.add_process(peer.proc)
        try:
            peer.wait_ready()
        except Exception as exc:  # one peer failing must not end the benchmark
            failed[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
            peer.stop()
            continue
        routers[name] = Router(name, peer.url, peer.proc.pid, peer, peer_spec(name).note)
    return routers, missing, failed


@contextlib.contextmanager
def _client_heap_frozen() -> Iterator[None]:
    """This client's heap out of its collector's view while a phase measures.

    The client is Python too: a full collection of its heap paused it for 27-40 ms, 3-4
    times a phase, and a request in flight then reads its first chunk late whatever router
    served it. The pause is the client's, not the router's. Unfrozen and collected after
    the phase, so nothing is kept."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


async def _p5(
    stack: Stack,
    routers: dict[str, Router],
    args: argparse.Namespace,
    failed: dict[str, str],
    counts: dict[str, float],
) -> dict[str, list[Phase]]:
    """Every system's phases; a system whose phase fails (its router died, say) is named in
    ``failed`` and skipped from then on, with the phases it completed kept. ``counts``:
    kvroute's counters over its own phases (``_COUNTERS``)."""
    phases: dict[str, list[Phase]] = {name: [] for name in routers}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
    ) as session:
        runner = P5Runner(args, list(stack.worker_urls), stack.config.model, session)
        for rnd in range(args.rounds):
            order = list(routers.items())
            for name, router in order if rnd % 2 == 0 else order[::-1]:  # ABC CBA ...
                if name in failed:
                    continue
                seed = f"{args.seed}-{rnd}-{name}"
                before = _counters(stack) if name == KVROUTE else {}
                try:
                    with _client_heap_frozen():
                        phase = await runner.run_phase(name, router.url, router.pid, seed)
                except (RuntimeError, OSError, aiohttp.ClientError) as exc:
                    failed[name] = f"round {rnd}: {type(exc).__name__}: {str(exc)[:500]}"
                    continue
                for k, v in (_counters(stack) if before else {}).items():
                    counts[k] = counts.get(k, 0.0) + v - before[k]
                phases[name].append(phase)
    return {name: ph for name, ph in phases.items() if ph}


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = _systems(args)
    log_dir = Path(args.log_dir) if args.log_dir else None
    try:
        pool_settings = parse_params(args.pool_set)
    except ValueError as exc:
        raise SystemExit(f"--pool-set: {exc}") from None
    known = {f.name for f in dataclasses.fields(PoolSettings) if f.init}
    unknown = sorted(set(pool_settings) - known)
    if unknown:  # refused here, not by a gateway that fails to start
        raise SystemExit(f"--pool-set: unknown pool setting(s) {', '.join(unknown)}")
    if args.shared_words < 0 or (args.shared_words and args.mode not in ("cold", "rag")):
        raise SystemExit("--shared-words: a number of words >= 0, with --mode cold or rag only")
    cfg = StackConfig(
        pool_settings=pool_settings,
        workers=args.workers,
        speedup=args.speedup,
        kv_blocks=args.kv_blocks,
        max_model_len=65536,
        log_dir=log_dir,
        gateway_processes=args.gateway_processes,
    )
    t_start = time.monotonic()
    with Stack(cfg) as stack:
        routers, missing, failed = _start_routers(stack, names)
        counts: dict[str, float] = {}
        phases = _run_async(_p5(stack, routers, args, failed, counts))
        p6: dict[str, Any] = {}
        if args.throughput_seconds > 0:
            for name, router in routers.items():
                if name in failed:
                    continue
                before = _per_process(stack, name, args)
                p6[name] = _run_async(_throughput(router.url, cfg.model, router.pid, args))
                if before is not None:
                    after = _per_process(stack, name, args) or {}
                    p6[name]["requests_per_process"] = {
                        str(pid): after.get(pid, 0) - before.get(pid, 0) for pid in after
                    }
            p6["direct"] = _run_async(_throughput(stack.worker_urls[0], cfg.model, None, args))
        for router in routers.values():
            if router.peer is not None:
                router.peer.stop()
        stall: dict[str, Any] = {}
        if args.stall_seconds > 0 and KVROUTE in routers:
            stall = _stall.run_stall(stack, _run_async, args)
            stall["new_conversation"] = _stall.new_conversation_cost(
                stack.tokenizer_path(), cfg.chat_template, args.stall_long_words
            )
        log_dir_used = str(stack.log_dir)

    rows = {name: _summarize(name, ph, args) for name, ph in phases.items()}
    for name, router in routers.items():
        if name in rows:
            rows[name]["note"] = router.note
    if KVROUTE in rows:
        rows[KVROUTE].update(_count_ratios(counts))
    smg_row = rows.get(SMG)
    if smg_row is not None and smg_row["pairs"] < MIN_PAIRS:
        smg_row = None
    for row in rows.values():
        row["checks"] = _p5_checks(row, smg_row)
        row["ok"] = all(row["checks"].values())
    kv = rows.get(KVROUTE)
    sane = (
        kv is not None
        and kv["pairs"] >= MIN_PAIRS
        and kv["errors"] == 0
        and kv["slots_skipped"] <= MAX_SKIPPED * kv["slots"]
        and (kv["direct_ttft_p50_ms"] or 0) > 0
    )
    targets = kv["checks"] if kv is not None else dict.fromkeys(_p5_checks({}, None), False)
    if smg_row is None:
        reason = missing.get(SMG) or failed.get(SMG) or f"{SMG} not measured"
        targets_note = f"checks against smg fail: {reason}"
    else:
        targets_note = ""
    if args.mode != "chat":  # P5 is worded for chats' new turns: its bounds, on other requests
        other = (
            "new chats, each with a new document (P5 is on new turns of chats)"
            if args.mode == "rag"
            else "completions (P5 is on chats)"
        )
        targets_note = "; ".join(filter(None, [targets_note, f"P5's bounds applied to {other}"]))

    result: dict[str, Any] = {
        "benchmark": NAME,
        "config": {k: getattr(args, k) for k in CONFIG_KEYS},
        "systems": rows,
        "missing": missing,
        "failed": failed,
        "added_latency_p50_ms": kv["added_p50_ms"] if kv else None,
        "added_latency_p99_ms": kv["added_p99_ms"] if kv else None,
        "smg_added_latency_p50_ms": rows[SMG]["added_p50_ms"] if SMG in rows else None,
        "smg_added_latency_p99_ms": rows[SMG]["added_p99_ms"] if SMG in rows else None,
        "targets": targets,
        "targets_note": targets_note,
        "sane": sane,
        "log_dir": log_dir_used,
        "seconds": round(time.monotonic() - t_start, 1),
    }
    if p6:
        kv6, sg6 = p6.get(KVROUTE, {}), p6.get(SMG, {})
        a, b = kv6.get("rps_per_cpu_s"), sg6.get("rps_per_cpu_s")
        result["p6"] = {
            "runs": p6,
            "rps_per_cpu_s_vs_smg": round(a / b, 3) if a and b else None,
            "ok": bool(a and b and a >= b),
        }
    if stall:
        result["stall"] = stall
    if args.tokenize_repeats > 0:
        from loadtest.benchmarks import tokenize as tok_bench

        tok = tok_bench.run(
            argparse.Namespace(
                tokens=8000,
                repeats=args.tokenize_repeats,
                template="deepseek-v3",
                reply_words=200,
                user_words=60,
                seed=7,
                turns=0,
                idle_ms=0.0,
            )
        )
        result["tokenize_followup_ratio"] = tok["tokenize_followup_ratio"]
    result["ok"] = bool(sane and all(targets.values()))
    result["table"] = (
        [
            {
                "system": name,
                "pairs": r["pairs"],
                "direct TTFT p50 ms": r["direct_ttft_p50_ms"],
                "added p50 ms": r["added_p50_ms"],
                "added p99 ms": r["added_p99_ms"],
                "dist p50/p99 ms": f"{r['added_dist_p50_ms']}/{r['added_dist_p99_ms']}",
                "req/CPU-s": r["requests_per_cpu_s"],
                "P6 req/CPU-s": p6.get(name, {}).get("rps_per_cpu_s"),
                "P5 ok": r["ok"],
            }
            for name, r in rows.items()
        ]
        + [
            {"system": name, "P5 ok": f"{why}: {msg[:60]}"}
            for why, names in (("missing", missing), ("failed", failed))
            for name, msg in names.items()
            if name not in rows
        ]
        + [
            {
                "system": f"kvroute stall: {phase}",
                "P5 ok": f"short chats added p50/p99 {r['added_p50_ms']}/{r['added_p99_ms']} ms",
            }
            for phase, r in stall.get("phases", {}).items()
        ]
        + [
            {
                "system": "kvroute new conversation (P4)",
                "P5 ok": f"{nc['new_conversation_cpu_ms']} ms under the known prompt, "
                f"{nc['short_system_cpu_ms']} under a short one; pays only its new text: "
                f"{nc['pays_only_new_text']}",
            }
            for nc in filter(None, [stall.get("new_conversation")])
        ]
    )
    json.dumps(result)
    return result
