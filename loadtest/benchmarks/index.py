"""``kvroute bench index``: routing-core cost (targets P1, P2, P3).

Builds a shadow index shaped like a real fleet: ``--workers`` workers, each holding about
``--blocks / --workers`` blocks made of shared system prompts (held by many workers) and
per-conversation tails, then routes ``--tokens``-token prompts over all workers:

* ``route_p50_us`` / ``route_p99_us``: lookup + scoring (keys precomputed), the P1 figure;
* ``speculate_p50_us``: the speculative insert that follows a real decision;
* ``keys_p50_us``: canonical keys for the whole prompt from a token list;
* ``apply_events_per_s``: canonical block events applied per second, in engine-sized batches
  (stores of 16 blocks, removes batched per worker), P2;
* ``bytes_per_entry``: traced memory per indexed (block, worker) entry, P3;
* ``baseline_dict_walk_p50_us``: the same lookups done the naive way (one dict probe per
  block, same content), measured in the same run, so the ratio survives machine noise.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from itertools import accumulate, repeat, takewhile
from operator import and_
from typing import Any

from tqdm import tqdm

from gateway.contract.wire import EngineReport
from gateway.routing.index import ShadowIndex
from gateway.routing.keys import BlockKeyer
from gateway.routing.policy import make_policy
from gateway.routing.router import Router

NAME = "index"
HELP = "routing core: decision latency, event apply rate, index memory (P1-P3)"

BS = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--tokens", type=int, default=8192, help="prompt length of routed requests")
    p.add_argument("--blocks", type=int, default=1_000_000, help="indexed (block, worker) entries")
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    workers = [f"w{i:03d}" for i in range(args.workers)]
    prompt_blocks = args.tokens // BS
    sys_blocks = min(128, prompt_blocks // 4)
    n_sys = 16
    keyer = BlockKeyer("bench", BS)

    # Key chains: shared system prompts, then conversations under them.
    def chain(n: int, parent: list[int] | None = None) -> list[int]:
        base = list(parent or [])
        return base + [rng.getrandbits(64) for _ in range(n)]

    systems = [chain(sys_blocks) for _ in range(n_sys)]
    per_worker = max(1, args.blocks // args.workers)
    convs: list[tuple[str, list[int]]] = []
    events: list[tuple[str, int | None, list[int]]] = []
    for w in workers:
        held = 0
        held_systems: set[int] = set()
        while held < per_worker:
            s = rng.randrange(n_sys)
            tail = rng.randrange(prompt_blocks // 4, prompt_blocks - sys_blocks + 1)
            keys = chain(tail, systems[s])
            start = 0 if s not in held_systems else sys_blocks
            held_systems.add(s)
            for i in range(start, len(keys), 16):
                events.append((w, keys[i - 1] if i else None, keys[i : i + 16]))
            held += len(keys) - start
            convs.append((w, keys))

    # -- apply rate and memory ------------------------------------------------------------
    gc.collect()
    tracemalloc.start()
    index = ShadowIndex()
    for w, parent, keys in tqdm(
        events, desc="index: stores", unit="ev", leave=False, mininterval=1
    ):
        index.stored(w, parent, keys)
    mem, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    entries = index.entries()

    fresh = ShadowIndex()
    t0 = time.perf_counter()
    for w, parent, keys in events:
        fresh.stored(w, parent, keys)
    store_s = time.perf_counter() - t0
    stored_blocks = sum(len(k) for _, _, k in events)
    # removals: evict the tails of a quarter of the conversations, tail first, 16 per call
    victims = rng.sample(convs, len(convs) // 4)
    removes: list[tuple[str, list[int]]] = []
    for w, conv in victims:
        evict = conv[sys_blocks:][::-1]
        removes.extend((w, evict[i : i + 16]) for i in range(0, len(evict), 16))
    t0 = time.perf_counter()
    for w, batch in removes:
        fresh.removed(w, batch)
    remove_s = time.perf_counter() - t0
    removed_blocks = sum(len(b) for _, b in removes)
    del fresh

    # -- routing ----------------------------------------------------------------------------
    router = Router(make_policy("ttft"), BS, index=index, rng=random.Random(args.seed))
    for w in workers:
        router.add_worker(w)
    for i, w in enumerate(workers):
        router.loads.report(w, EngineReport(running=i % 7, waiting=i % 3, kv_usage=0.5), now=0.0)
    queries: list[list[int]] = []
    for q in range(args.queries):
        kind = q % 3
        if kind == 0:  # follow-up turn of a known conversation
            _, keys = rng.choice(convs)
            keys = keys[:prompt_blocks]
        elif kind == 1:  # new conversation under a shared system prompt
            keys = chain(prompt_blocks - sys_blocks, rng.choice(systems))
        else:  # cold
            keys = chain(prompt_blocks)
        queries.append((keys + chain(prompt_blocks))[:prompt_blocks])
    route_us: list[float] = []
    dict_us: list[float] = []
    spec_us: list[float] = []
    match_us: list[float] = []
    flat: dict[int, int] = {}
    slot = {w: i for i, w in enumerate(workers)}
    for keys_run, mask in index.iter_runs():
        for k in keys_run:
            flat[k] = mask
    del slot
    now = 0.0
    for keys in tqdm(queries, desc="index: routing", unit="req", leave=False, mininterval=1):
        t0 = time.perf_counter()
        d = router.route(keys, args.tokens, now, dry_run=True)
        t1 = time.perf_counter()
        _dict_walk(flat, keys)
        t2 = time.perf_counter()
        index.match_levels(keys)
        t3 = time.perf_counter()
        index.speculate(d.worker, keys, now, start=d.matched_tokens // BS)
        t4 = time.perf_counter()
        router.tick(now)
        route_us.append((t1 - t0) * 1e6)
        dict_us.append((t2 - t1) * 1e6)
        match_us.append((t3 - t2) * 1e6)
        spec_us.append((t4 - t3) * 1e6)
        now += 0.01

    toks = [rng.randrange(128_000) for _ in range(args.tokens)]
    key_us = []
    for _ in range(200):
        t0 = time.perf_counter()
        keyer.keys(toks)
        key_us.append((time.perf_counter() - t0) * 1e6)

    route_p50 = statistics.median(route_us)
    route_p99 = _percentile(route_us, 0.99)
    apply_rate = (stored_blocks + removed_blocks) / (store_s + remove_s)
    bytes_per_entry = mem / max(entries, 1)
    dict_p50 = statistics.median(dict_us)
    result: dict[str, Any] = {
        "workers": args.workers,
        "tokens": args.tokens,
        "entries": entries,
        "distinct_keys": len(index),
        "nodes": index.node_count(),
        "route_p50_us": round(route_p50, 1),
        "route_p99_us": round(route_p99, 1),
        "match_p50_us": round(statistics.median(match_us), 1),
        "speculate_p50_us": round(statistics.median(spec_us), 1),
        "keys_p50_us": round(statistics.median(key_us), 1),
        "apply_events_per_s": round(apply_rate),
        "store_blocks_per_s": round(stored_blocks / store_s),
        "remove_blocks_per_s": round(removed_blocks / remove_s),
        "bytes_per_entry": round(bytes_per_entry, 1),
        "baseline_dict_walk_p50_us": round(dict_p50, 1),
        "route_vs_dict_walk": round(route_p50 / dict_p50, 3),
    }
    ok = route_p50 <= 50 and route_p99 <= 150 and apply_rate >= 500_000 and bytes_per_entry <= 150
    result["ok"] = ok
    result["table"] = [
        {"metric": "route p50 (us)", "value": result["route_p50_us"], "target": "<= 50"},
        {"metric": "route p99 (us)", "value": result["route_p99_us"], "target": "<= 150"},
        {
            "metric": "dict-walk baseline p50 (us)",
            "value": result["baseline_dict_walk_p50_us"],
            "target": "-",
        },
        {"metric": "index match p50 (us)", "value": result["match_p50_us"], "target": "-"},
        {"metric": "speculate p50 (us)", "value": result["speculate_p50_us"], "target": "-"},
        {
            "metric": f"keys for {args.tokens} tokens p50 (us)",
            "value": result["keys_p50_us"],
            "target": "-",
        },
        {
            "metric": "apply (block events/s)",
            "value": result["apply_events_per_s"],
            "target": ">= 500,000",
        },
        {
            "metric": "bytes per (block, worker)",
            "value": result["bytes_per_entry"],
            "target": "<= 150",
        },
    ]
    return result


def _dict_walk(flat: dict[int, int], keys: list[int]) -> list[int]:
    """The naive lookup: one dict probe per block, folded with AND until nobody is left."""
    return list(takewhile(bool, accumulate(map(flat.get, keys, repeat(0)), and_)))
