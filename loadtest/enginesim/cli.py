"""``kvroute sim``: run N simulated vLLM/SGLang workers in this process until SIGINT/SIGTERM.

Prints one line per worker (its HTTP URL, KV event and replay endpoints), then a line with
``sim ready``. Settings: flags below, ``--set path=value`` for any other, ``--config`` for a
YAML file and ``KVROUTE_SIM_*`` variables (see ``loadtest.enginesim.config``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

import zmq

from gateway.contract.settings import ConfigError, parse_assignments
from loadtest.enginesim.config import SimConfig, load_sim_config
from loadtest.enginesim.timing import ATTENTION, PRESETS

__all__ = ["add_arguments", "build_config", "run"]

# flag dest -> dotted config path
_FLAGS: dict[str, str] = {
    "workers": "workers",
    "dp_size": "dp_size",
    "base_port": "base_port",
    "host": "host",
    "admin_port": "admin_port",
    "flavor": "flavor",
    "model": "model",
    "tokenizer": "tokenizer",
    "chat_template": "chat_template",
    "kv_blocks": "cache.kv_blocks",
    "block_size": "cache.block_size",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "max_model_len": "scheduler.max_model_len",
    "timing": "timing.preset",
    "speedup": "timing.speedup",
    "attention": "timing.attention",
    "events_encoding": "events.encoding",
    "hash_format": "events.hash_format",
    "replay_layout": "events.replay_layout",
    "topic": "events.topic",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--workers", type=int, help="number of simulated workers (default 1)")
    a("--dp-size", type=int, help="data-parallel ranks per worker (default 1)")
    a("--base-port", type=int, help="worker i: HTTP P+i, events P+N+i, replay P+2N+i (0: any)")
    a("--host", help="address to listen on (default 127.0.0.1)")
    a("--admin-port", type=int, help="cluster admin API port (faults by worker index)")
    a("--flavor", choices=["vllm", "sglang"], help="which engine to imitate (default vllm)")
    a("--model", help="served model name")
    a("--tokenizer", help="tokenizer.json or model dir; 'none' for token ids only")
    a("--chat-template", help="bundled template name or .jinja path")
    a("--kv-blocks", type=int, help="KV pool size in blocks (default 16384)")
    a("--block-size", type=int, help="tokens per block / SGLang page size (default 16)")
    a("--max-num-seqs", type=int, help="max running sequences (default 256)")
    a("--max-num-batched-tokens", type=int, help="token budget per step (default 8192)")
    a("--max-model-len", type=int, help="context length limit (default 32768)")
    a("--timing", choices=sorted(PRESETS), help="timing preset (default mocker)")
    a("--speedup", type=float, help="divide every step time by this (default 1)")
    a(
        "--attention",
        choices=list(ATTENTION),
        help="what a step's quadratic prefill term is paid on: the batch's tokens together"
        " or each sequence's chunk against its own context (default batch)",
    )
    a("--events-encoding", choices=["map", "array"], help="KV event encoding (default map)")
    a("--hash-format", choices=["int", "bytes"], help="vLLM event hashes (default int)")
    a("--replay-layout", choices=["auto", "legacy", "topic"], help="replay reply frames")
    a("--topic", help="ZMQ topic of KV events (default empty)")
    a("--no-events", action="store_true", help="do not publish KV events")
    a("--config", help="YAML file with SimConfig settings")
    a(
        "--set",
        action="append",
        metavar="PATH=VALUE",
        help="any setting, e.g. cache.cache_outputs=false",
    )


def build_config(args: argparse.Namespace) -> SimConfig:
    """Defaults < --config file < KVROUTE_SIM_* < --set < named flags."""
    overrides: dict[str, Any] = parse_assignments(getattr(args, "set", None))
    for dest, path in _FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[path] = value
    if getattr(args, "no_events", False):
        overrides["events.enabled"] = False
    return load_sim_config(getattr(args, "config", None), overrides=overrides)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(config))
    except (OSError, zmq.ZMQError) as exc:  # a port in use, a missing tokenizer
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(config: SimConfig) -> None:
    from loadtest.enginesim.cluster import SimCluster

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with SimCluster(config) as cluster:
        for w in cluster.workers:
            print(
                f"worker {w.index}: http={w.http_url} events={w.events_endpoint} "
                f"replay={w.replay_endpoint}",
                flush=True,
            )
        if cluster.admin_url:
            print(f"admin: {cluster.admin_url}", flush=True)
        print(f"sim ready: {len(cluster.workers)} {config.flavor} workers", flush=True)
        await stop.wait()
