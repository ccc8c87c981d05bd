"""The agent's settings: one dataclass tree (YAML file < ``KVROUTE_AGENT_*`` env < flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from worker_agent.publisher import PublisherSettings

__all__ = ["AgentConfig", "EngineConfig", "RedisConfig"]

ENV_PREFIX = "KVROUTE_AGENT_"


@dataclass
class EngineConfig:
    kind: Literal["vllm", "sglang"] = "vllm"
    url: str = "http://127.0.0.1:8000"  # HTTP base: discovery and /metrics
    events: str | None = None  # tcp://HOST:PORT of rank 0's PUB (skips discovery)
    replay: str | None = None  # tcp://HOST:PORT of rank 0's replay ROUTER
    topic: str = ""
    dp_size: int | None = None  # ranks at port + rank (default: discovered, else 1)
    block_size: int | None = None  # engine block size for the registration (else discovered)
    metrics_path: str = "/metrics"
    discovery_timeout: float = 120.0  # keep asking the engine this long at start
    replay_timeout: float = 2.0


@dataclass
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"  # redis:// or rediss://, AUTH in the URL
    password: str | None = None
    prefix: str = "kvroute:"
    max_stream_len: int = 1_000_000
    #: Redis Cluster: ``url`` names any node (this worker's keys share one hash tag)
    cluster: bool = False
    #: Redis Sentinel: ``host:port`` of each sentinel, naming the primary ``sentinel_master``
    sentinels: list[str] = field(default_factory=list)
    sentinel_master: str = ""


#: worker roles: both halves of a request, or one of prefill/decode disaggregation
ROLES = ("", "prefill", "decode")


@dataclass
class AgentConfig:
    worker_id: str = ""
    model: str = ""
    pool: str = ""  # defaults to the model
    worker_url: str | None = None  # the URL the gateway routes to (default: engine.url)
    #: prefill/decode disaggregation: "prefill" or "decode" (empty: the engine serves both)
    role: str = ""
    #: SGLang prefill: the engine's disaggregation bootstrap port (decode engines pull from it)
    bootstrap_port: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    block_size: int = 16  # the pool's canonical block size
    hash_seed: str = "kvroute"  # the deployment's key seed: must equal the gateway's
    kv_capacity_blocks: int | None = None  # canonical blocks (default: from /metrics)
    heartbeat_interval: float = 1.0
    registration_ttl: float = 3.0
    report_interval: float = 0.25  # load reports (the gateway wants ≤ 0.5 s)
    adapters_interval: float = 5.0  # polls of the engine's /v1/models (LoRA adapters served)
    #: anti-entropy: stamp the mirror's digest on an entry (and snapshot) this often; 0: off
    digest_interval: float = 5.0
    metrics_port: int | None = None  # serve the agent's /metrics here
    metrics_host: str = "0.0.0.0"
    log_level: str = "INFO"
    engine: EngineConfig = field(default_factory=EngineConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    publish: PublisherSettings = field(default_factory=PublisherSettings)

    def validate(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id is required (--worker-id)")
        if not self.model:
            raise ValueError("model is required (--model)")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.role not in ROLES:
            raise ValueError(
                f"role must be one of {', '.join(map(repr, ROLES))}, got {self.role!r}"
            )
        if self.redis.cluster and self.redis.sentinels:
            raise ValueError("redis: cluster and sentinels exclude each other")
        if self.redis.sentinels and not self.redis.sentinel_master:
            raise ValueError("redis.sentinels: needs redis.sentinel_master (the primary's name)")
        if self.registration_ttl <= self.heartbeat_interval:
            raise ValueError("registration_ttl must exceed heartbeat_interval")
