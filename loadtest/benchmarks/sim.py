"""``kvroute bench sim``: what the engine simulator costs, so load tests know it is not their
bottleneck.

* ``live``: ``kvroute sim --workers 8`` runs as a child process (``--speedup`` high, so
  simulated GPU time is negligible and the simulator's own CPU is what limits it); this
  process drives it closed-loop with ``--concurrency`` streamed completions of
  ``--prompt-tokens`` token ids (groups sharing a prefix, so the cache hits) and
  ``--max-tokens`` outputs, spread round robin over the workers, with KV events on.
  ``req_per_s`` is the rate one simulator process sustained; ``cpu_ms_per_req`` its CPU
  time (user + system, from /proc) per request, which also bounds the rate on one core.
  Rows are given for streaming and non-streaming requests.
* ``core``: the engine core alone in virtual time (what the offline cluster simulator
  runs), ``core_us_per_req`` of CPU per request on the same workload shape.

No target names the simulator (it is a test tool); ``ok`` means every request of every
scenario was answered and the core served its requests from cache as the workload allows
(hit rate > 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.enginesim.config import CacheConfig, SchedulerConfig
from loadtest.enginesim.scheduler import EngineCore
from loadtest.enginesim.timing import timing_model
from loadtest.harness import ChildProcess

NAME = "sim"
HELP = "engine simulator cost: requests/s one process sustains for 8 workers, CPU per request"

_WORKER_LINE = re.compile(r"worker (\d+): http=(\S+)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--requests", type=int, default=2000, help="requests per live scenario")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--groups", type=int, default=16, help="distinct shared prefixes")
    p.add_argument("--speedup", type=float, default=1000.0)
    p.add_argument("--flavor", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--core-requests", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)


def _prompts(args: argparse.Namespace, n: int) -> list[list[int]]:
    """Prompts of ``--prompt-tokens`` ids: a group prefix (3/4) and a unique tail."""
    rng = random.Random(args.seed)
    shared = args.prompt_tokens * 3 // 4
    prefixes = [[rng.randrange(1, 100_000) for _ in range(shared)] for _ in range(args.groups)]
    tail = args.prompt_tokens - shared
    return [
        rng.choice(prefixes) + [rng.randrange(1, 100_000) for _ in range(tail)] for _ in range(n)
    ]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(
    urls: list[str], prompts: list[list[int]], args: argparse.Namespace, stream: bool
) -> int:
    """Closed loop: ``concurrency`` clients, each sending its share of the prompts."""
    done = 0
    queue = list(enumerate(prompts))
    conn = aiohttp.TCPConnector(limit=0)

    async def client(s: aiohttp.ClientSession) -> None:
        nonlocal done
        while queue:
            i, p = queue.pop()
            body = {"prompt": p, "max_tokens": args.max_tokens, "stream": stream}
            async with s.post(urls[i % len(urls)] + "/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"simulator answered {r.status}")
            done += 1

    async with aiohttp.ClientSession(connector=conn) as s:
        await asyncio.gather(*(client(s) for _ in range(args.concurrency)))
    return done


def _live(args: argparse.Namespace, urls: list[str], pid: int, stream: bool) -> dict[str, Any]:
    prompts = _prompts(args, args.requests)
    cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
    n = asyncio.run(_drive(urls, prompts, args, stream))
    wall, cpu = time.perf_counter() - t0, _cpu_seconds(pid) - cpu0
    return {
        "scenario": "live, streamed" if stream else "live, non-streamed",
        "requests": n,
        "req_per_s": round(n / wall, 1),
        "cpu_ms_per_req": round(1000 * cpu / n, 3),
        "sim_cpu_util": round(cpu / wall, 2),
    }


def _core(args: argparse.Namespace) -> dict[str, Any]:
    """The core alone, virtual time, same prompt shape, arrivals at 90% of its capacity."""
    core = EngineCore(
        CacheConfig(kv_blocks=16384, block_size=16),
        SchedulerConfig(),
        timing_model("mocker"),
        record_events=False,
    )
    prompts = [bytes(memoryview(_pack(p))) for p in _prompts(args, min(args.core_requests, 2000))]
    rng = random.Random(args.seed)
    t, n = 0.0, args.core_requests
    cpu0 = time.process_time()
    for i in range(n):
        t += rng.expovariate(40.0)
        core.advance(t)
        core.add_request(prompts[i % len(prompts)], args.max_tokens, t)
    core.advance(float("inf"))
    cpu = time.process_time() - cpu0
    hit = core.stats.cache_hits / max(1, core.stats.cache_queries)
    return {
        "scenario": "core only, virtual time",
        "requests": n,
        "req_per_s": round(n / cpu, 1),
        "cpu_ms_per_req": round(1000 * cpu / n, 4),
        "sim_cpu_util": 1.0,
        "hit_rate": round(hit, 3),
    }


def _pack(tokens: list[int]) -> bytes:
    from loadtest.enginesim.kvcache import pack_tokens

    return pack_tokens(tokens)


def run(args: argparse.Namespace) -> dict[str, Any]:
    argv = [
        "sim", "--workers", str(args.workers), "--base-port", "0", "--tokenizer", "none",
        "--speedup", str(args.speedup), "--flavor", args.flavor,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-sim-") as logs:
        child = ChildProcess.kvroute(argv, "sim", Path(logs)).start()
        try:
            child.wait_for_log("sim ready", timeout=60)
            urls = [m.group(2) for m in _WORKER_LINE.finditer(child.log_path.read_text())]
            assert child.proc is not None
            rows = [_live(args, urls, child.proc.pid, stream) for stream in (True, False)]
        finally:
            child.stop()
    rows.append(_core(args))
    live = rows[0]
    answered = all(r["requests"] == args.requests for r in rows[:2])
    return {
        "benchmark": NAME,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "speedup": args.speedup,
        "req_per_s": live["req_per_s"],
        "cpu_ms_per_req": live["cpu_ms_per_req"],
        "core_us_per_req": round(1000 * rows[-1]["cpu_ms_per_req"], 1),
        "all_answered": answered,
        "ok": answered and rows[-1]["hit_rate"] > 0,
        "table": rows,
    }
