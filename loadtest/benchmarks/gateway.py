"""``kvroute bench gateway``: what the gateway costs (targets P4, P5, P6), beside sglang-router.

Real processes on loopback: Redis, simulated workers (fast timing), agents, one kvroute
gateway process and one sglang-router on the same workers.

* ``added_latency_p50_ms`` / ``_p99_ms`` (P5): TTFT through the router minus TTFT sent
  straight to the worker that holds the prompt, for 8,000-token chat prompts with warm caches
  (every conversation sent once before measuring). Direct and routed requests alternate so
  both see the same machine; the figures are differences of the two distributions'
  percentiles. Requests are paced at ``--rate`` per second.
* ``tokenize_followup_ratio`` (P4): from ``kvroute bench tokenize``.
* ``proxy_rps_per_core`` (P6): short prompts, 64 streamed tokens each, ``--concurrency``
  clients closed-loop for ``--seconds``; requests completed per CPU second of the router
  process (from /proc). The simulated workers and the client share the same two cores, so
  wall-clock req/s says more about the machine than the proxy; CPU seconds do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.peers import sglang_router, wait_router_ready
from loadtest.stack import Stack, StackConfig
from loadtest.workloads import WORDS

NAME = "gateway"
HELP = "gateway cost: added latency, tokenization follow-up ratio, proxy throughput (P4-P6)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pairs", type=int, default=150, help="direct/routed request pairs per router")
    p.add_argument(
        "--rate", type=float, default=100.0, help="paced requests/s for the latency test"
    )
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=15.0, help="per throughput run")
    p.add_argument("--no-sglang", action="store_true", help="skip sglang-router")
    p.add_argument("--log-dir", default="")


def _text(rng: random.Random, n: int) -> str:
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _ttft(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.read())[:200]!r}")
        async for line in resp.content:
            if line.startswith(b"data:") and b'"content"' in line:
                ttft = time.perf_counter() - t0
                await resp.read()
                return ttft
    raise RuntimeError(f"{url}: stream without a token")


async def _added_latency(
    worker_urls: list[str], routers: dict[str, str], model: str, args: argparse.Namespace
) -> dict[str, Any]:
    rng = random.Random(1)
    convs = [
        [
            {"role": "system", "content": _text(rng, args.prompt_tokens - 100)},
            {"role": "user", "content": _text(rng, 60)},
        ]
        for _ in range(8)
    ]
    body = {"model": model, "max_tokens": 2, "stream": True, "temperature": 0}
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        for name, url in routers.items():
            # warm: each conversation once through the router; learn where it lives
            home: dict[int, str] = {}
            for i, msgs in enumerate(convs):
                async with session.post(
                    url + "/v1/chat/completions", json={**body, "stream": False, "messages": msgs}
                ) as resp:
                    await resp.read()
                    home[i] = resp.headers.get("x-kvroute-worker", "")
            direct_samples, routed_samples = [], []
            gap = 1.0 / args.rate
            for k in range(args.pairs):
                i = k % len(convs)
                msgs = convs[i]
                target = worker_urls[int(home[i].rsplit("-", 1)[1])] if home[i] else None
                t0 = time.perf_counter()
                if target is not None:
                    direct_samples.append(await _ttft(session, target, {**body, "messages": msgs}))
                routed_samples.append(await _ttft(session, url, {**body, "messages": msgs}))
                await asyncio.sleep(max(0.0, 2 * gap - (time.perf_counter() - t0)))
            if not direct_samples:  # a peer without the worker header: direct to every worker
                for k in range(args.pairs):
                    direct_samples.append(
                        await _ttft(
                            session,
                            worker_urls[k % len(worker_urls)],
                            {**body, "messages": convs[k % len(convs)]},
                        )
                    )
            q = statistics.quantiles
            d50, r50 = statistics.median(direct_samples), statistics.median(routed_samples)
            d99, r99 = q(direct_samples, n=100)[98], q(routed_samples, n=100)[98]
            out[name] = {
                "direct_ttft_p50_ms": round(d50 * 1e3, 3),
                "routed_ttft_p50_ms": round(r50 * 1e3, 3),
                "added_latency_p50_ms": round((r50 - d50) * 1e3, 3),
                "added_latency_p99_ms": round((r99 - d99) * 1e3, 3),
            }
    return out


async def _throughput(
    url: str, model: str, pid: int | None, args: argparse.Namespace
) -> dict[str, Any]:
    body = {
        "model": model,
        "max_tokens": 64,
        "stream": True,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Say something."}],
    }
    done = 0
    errors = 0
    stop = time.monotonic() + args.seconds
    cpu0 = _cpu_seconds(pid) if pid else 0.0
    t0 = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal done, errors
            while time.monotonic() < stop:
                try:
                    async with session.post(url + "/v1/chat/completions", json=body) as resp:
                        await resp.read()
                        if resp.status == 200:
                            done += 1
                        else:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    wall = time.monotonic() - t0
    cpu = (_cpu_seconds(pid) - cpu0) if pid else 0.0
    return {
        "rps": round(done / wall, 1),
        "cpu_s": round(cpu, 2),
        "rps_per_core": round(done / cpu, 1) if cpu else None,
        "cpu_ms_per_req": round(cpu * 1e3 / done, 3) if done and cpu else None,
        "errors": errors,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from loadtest.benchmarks import tokenize as tok_bench

    log_dir = Path(args.log_dir) if args.log_dir else None
    cfg = StackConfig(
        workers=args.workers, speedup=200.0, kv_blocks=65536, max_model_len=65536, log_dir=log_dir
    )
    result: dict[str, Any] = {}
    with Stack(cfg) as stack:
        gw = stack.gateway_urls[0]
        gw_pid = stack.gateways[0].proc.pid if stack.gateways[0].proc else None
        routers = {"kvroute": gw}
        sg_pid = None
        if not args.no_sglang:
            proc, url = sglang_router(
                stack.worker_urls, "cache_aware", stack.log_dir, name="sglang-bench"
            )
            stack.add_process(proc)
            wait_router_ready(proc, url, len(stack.worker_urls))
            routers["sglang-cache_aware"] = url
            sg_pid = proc.proc.pid if proc.proc else None
        lat = asyncio.run(_added_latency(stack.worker_urls, routers, cfg.model, args))
        tput = {"kvroute": asyncio.run(_throughput(gw, cfg.model, gw_pid, args))}
        if "sglang-cache_aware" in routers:
            tput["sglang-cache_aware"] = asyncio.run(
                _throughput(routers["sglang-cache_aware"], cfg.model, sg_pid, args)
            )
        tput["direct"] = asyncio.run(_throughput(stack.worker_urls[0], cfg.model, None, args))
    tok = tok_bench.run(
        argparse.Namespace(
            tokens=8000, repeats=9, template="deepseek-v3", reply_words=200, user_words=60, seed=7
        )
    )
    kv, sg = lat["kvroute"], lat.get("sglang-cache_aware")
    result = {
        "added_latency_p50_ms": kv["added_latency_p50_ms"],
        "added_latency_p99_ms": kv["added_latency_p99_ms"],
        "tokenize_followup_ratio": tok["tokenize_followup_ratio"],
        "proxy_rps": tput["kvroute"]["rps"],
        "proxy_rps_per_core": tput["kvroute"]["rps_per_core"],
        "sglang_added_latency_p50_ms": sg["added_latency_p50_ms"] if sg else None,
        "sglang_added_latency_p99_ms": sg["added_latency_p99_ms"] if sg else None,
        "sglang_proxy_rps": tput.get("sglang-cache_aware", {}).get("rps"),
        "sglang_proxy_rps_per_core": tput.get("sglang-cache_aware", {}).get("rps_per_core"),
        "latency": lat,
        "throughput": tput,
    }
    if result["sglang_proxy_rps_per_core"] and result["proxy_rps_per_core"]:
        result["rps_per_core_vs_sglang"] = round(
            result["proxy_rps_per_core"] / result["sglang_proxy_rps_per_core"], 3
        )
    result["table"] = [
        {
            "router": name,
            "added p50 (ms)": v["added_latency_p50_ms"],
            "added p99 (ms)": v["added_latency_p99_ms"],
            "direct TTFT p50 (ms)": v["direct_ttft_p50_ms"],
            "req/s": tput.get(name, {}).get("rps"),
            "req/s per core": tput.get(name, {}).get("rps_per_core"),
        }
        for name, v in lat.items()
    ]
    result["ok"] = True
    json.dumps(result)
    return result
