"""The simulator's configuration: one dataclass tree, loaded by ``gateway.config``.

Precedence is the project's: defaults < YAML file < environment (``KVROUTE_SIM_*``, e.g.
``KVROUTE_SIM_CACHE__KV_BLOCKS=4096``) < command-line flags. The engine core reads only
``CacheConfig`` and ``SchedulerConfig``; the rest is for the live server.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gateway.contract.settings import load_config

__all__ = [
    "ENV_PREFIX",
    "CacheConfig",
    "EventsConfig",
    "SchedulerConfig",
    "SimConfig",
    "TimingConfig",
    "load_sim_config",
]

ENV_PREFIX = "KVROUTE_SIM_"


def _positive(where: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{where}.{name} must be > 0, got {value}")


@dataclass
class CacheConfig:
    """The KV pool: ``kv_blocks`` blocks of ``block_size`` tokens (SGLang: the page size)."""

    kv_blocks: int = 16384
    block_size: int = 16
    # "block": trim the LRU leaf block by block (vLLM); "node": evict whole leaf nodes
    # (SGLang); "auto": by flavor.
    eviction: Literal["auto", "block", "node"] = "auto"
    # Cache full blocks of generated tokens when a request finishes (both engines do).
    cache_outputs: bool = True

    def __post_init__(self) -> None:
        _positive("cache", kv_blocks=self.kv_blocks, block_size=self.block_size)


@dataclass
class SchedulerConfig:
    """Continuous batching limits (vLLM's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    max_model_len: int = 32768
    default_max_tokens: int = 64  # when a request does not say

    def __post_init__(self) -> None:
        _positive(
            "scheduler",
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            default_max_tokens=self.default_max_tokens,
        )


@dataclass
class TimingConfig:
    preset: str = "mocker"  # see timing.PRESETS
    speedup: float = 1.0  # divides every step time

    def __post_init__(self) -> None:
        _positive("timing", speedup=self.speedup)


@dataclass
class EventsConfig:
    """KV events as the engine of ``SimConfig.flavor`` publishes them."""

    enabled: bool = True
    # "map": vLLM >= 0.24 / SGLang >= 0.5.20 (fields of vLLM 0.33 / SGLang 0.5.23);
    # "array": older tagged arrays (fields of vLLM 0.23 / SGLang 0.5.15).
    encoding: Literal["map", "array"] = "map"
    hash_format: Literal["int", "bytes"] = "int"  # vLLM only: uint64 (default) or raw digest
    # Replay reply frames: "topic" = [topic, seq, payload] (vLLM >= 0.26, SGLang >= 0.5.22),
    # "legacy" = [seq, payload]; "auto" follows the encoding (map -> topic).
    replay_layout: Literal["auto", "legacy", "topic"] = "auto"
    topic: str = ""
    buffer_steps: int = 10000  # replay buffer, in batches
    hwm: int = 100000

    def __post_init__(self) -> None:
        _positive("events", buffer_steps=self.buffer_steps, hwm=self.hwm)

    @property
    def replay_topic_frame(self) -> bool:
        if self.replay_layout == "auto":
            return self.encoding == "map"
        return self.replay_layout == "topic"


@dataclass
class SimConfig:
    """``workers`` simulated engines in one process.

    Ports: with ``base_port`` P and N workers, worker i serves HTTP on P+i, publishes KV
    events on P+N+i and answers replay on P+2N+i. ``base_port`` 0 picks free ports.
    """

    workers: int = 1
    host: str = "127.0.0.1"
    base_port: int = 0
    admin_port: int | None = None  # cluster admin API (faults by worker index); 0 = any port
    flavor: Literal["vllm", "sglang"] = "vllm"
    model: str = "kvroute-sim"
    tokenizer: str | None = None  # tokenizer.json; None = the bundled test tokenizer
    chat_template: str | None = None  # name or path; None = the tokenizer's own or deepseek-v3
    tokenizer_cache_tokens: int = 4_000_000  # the incremental tokenizer cache's bound (token ids)
    output_text: str = " the"  # what generated tokens spell, repeated
    max_body_bytes: int = 32 * 1024 * 1024
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    events: EventsConfig = field(default_factory=EventsConfig)

    def __post_init__(self) -> None:
        _positive(
            "sim",
            workers=self.workers,
            max_body_bytes=self.max_body_bytes,
            tokenizer_cache_tokens=self.tokenizer_cache_tokens,
        )
        if not 0 <= self.base_port <= 65535 - 3 * self.workers:
            raise ValueError(
                f"base_port {self.base_port} leaves no room for {self.workers} workers"
            )

    @property
    def evict_whole_nodes(self) -> bool:
        if self.cache.eviction == "auto":
            return self.flavor == "sglang"
        return self.cache.eviction == "node"


def load_sim_config(
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SimConfig:
    """``SimConfig`` from a YAML file, ``KVROUTE_SIM_*`` variables and dotted overrides."""
    return load_config(
        SimConfig,
        file=file,
        env=os.environ if env is None else env,
        env_prefix=ENV_PREFIX,
        overrides=overrides,
    )
