"""``kvroute agent``: run the worker agent beside one engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from gateway.contract.redis_bus import RedisBus
from gateway.contract.settings import ConfigError, load_config, parse_assignments
from worker_agent.agent import Agent
from worker_agent.config import ENV_PREFIX, AgentConfig

__all__ = ["add_arguments", "build_config", "run"]

# flag -> dotted setting
_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--engine": ("engine.kind", str, "vllm or sglang"),
    "--engine-url": ("engine.url", str, "engine HTTP base URL (discovery, /metrics)"),
    "--redis": ("redis.url", str, "redis:// or rediss:// URL (AUTH via the URL)"),
    "--redis-sentinels": ("redis.sentinels", str, "host:port,... of Redis Sentinels"),
    "--redis-sentinel-master": ("redis.sentinel_master", str, "the primary's name (Sentinel)"),
    "--worker-id": ("worker_id", str, "this worker's id (unique in the deployment)"),
    "--model": ("model", str, "served model name"),
    "--pool": ("pool", str, "pool name (default: the model)"),
    "--worker-url": ("worker_url", str, "URL the gateway routes to (default: engine URL)"),
    "--role": ("role", str, "prefill or decode (disaggregation; default: both)"),
    "--bootstrap-port": ("bootstrap_port", int, "SGLang prefill: disaggregation bootstrap port"),
    "--events": ("engine.events", str, "tcp://HOST:PORT of the engine's KV event PUB"),
    "--replay": ("engine.replay", str, "tcp://HOST:PORT of the engine's replay socket"),
    "--topic": ("engine.topic", str, "KV event topic"),
    "--dp-size": ("engine.dp_size", int, "data-parallel ranks (ports base + rank)"),
    "--block-size": ("block_size", int, "canonical block size of the pool"),
    "--engine-block-size": ("engine.block_size", int, "engine block size, if not discovered"),
    "--hash-seed": ("hash_seed", str, "deployment key seed (must equal the gateway's)"),
    "--kv-capacity-blocks": ("kv_capacity_blocks", int, "KV capacity in canonical blocks"),
    "--metrics-port": ("metrics_port", int, "serve the agent's Prometheus metrics here"),
    "--log-level": ("log_level", str, "DEBUG, INFO, WARNING"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file with agent settings")
    for flag, (path, typ, help_text) in _FLAGS.items():
        parser.add_argument(flag, type=typ, dest=_dest(flag), help=f"{help_text} [{path}]")
    parser.add_argument(
        "--redis-cluster",
        action="store_const",
        const=True,
        dest="opt_redis_cluster",
        help="the Redis at --redis is a Redis Cluster [redis.cluster]",
    )
    parser.add_argument("--label", action="append", metavar="K=V", help="worker label (repeatable)")
    parser.add_argument(
        "--set",
        action="append",
        metavar="PATH=VALUE",
        help="any setting, e.g. publish.snapshot_interval=5",
    )


def build_config(args: argparse.Namespace, env: dict[str, str] | None = None) -> AgentConfig:
    overrides = parse_assignments(args.set)
    for flag, (path, _, _) in _FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            overrides[path] = value
    if getattr(args, "opt_redis_cluster", None):
        overrides["redis.cluster"] = True
    for item in args.label or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--label expects K=V, got {item!r}")
        overrides[f"labels.{key}"] = value
    cfg = load_config(
        AgentConfig,
        file=args.config,
        env=os.environ if env is None else env,
        env_prefix=ENV_PREFIX,
        overrides=overrides,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        cfg = build_config(args)
    except ConfigError as exc:
        print(f"kvroute agent: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(_main(cfg))


async def _main(cfg: AgentConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bus = RedisBus(
        cfg.redis.url,
        prefix=cfg.redis.prefix,
        password=cfg.redis.password,
        max_stream_len=cfg.redis.max_stream_len,
        cluster=cfg.redis.cluster,
        sentinels=cfg.redis.sentinels,
        sentinel_master=cfg.redis.sentinel_master,
    )
    try:
        await Agent(cfg, bus).run(stop)
    finally:
        await bus.close()
    return 0


def _dest(flag: str) -> str:
    return "opt_" + flag.lstrip("-").replace("-", "_")
