"""The gateway's configuration schema (``GatewayConfig``): one typed dataclass tree.

It is read like every component's settings (``gateway.contract.settings``: defaults < YAML <
environment ``KVROUTE_<SECTION>__<SETTING>`` < flags); unknown settings and wrong types are
errors that name the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.contract.settings import ConfigError
from gateway.routing.costmodel import CostParams
from gateway.trust import TrustSettings

__all__ = ["GatewayConfig", "PoolSettings", "RequestLogSettings"]


# -- the gateway's configuration schema --------------------------------------------------------


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    #: processes sharing the port (SO_REUSEPORT); each is an independent replica
    workers: int = 1
    max_body_bytes: int = 32 * 1024 * 1024
    #: drain on SIGTERM: stop accepting connections at once, let requests and streams in
    #: flight finish for up to this many seconds, then cut what is left and exit (keep the
    #: pod's terminationGracePeriodSeconds above it plus the preStop pause)
    shutdown_grace: float = 120.0
    #: serve /metrics on this port (same host) and not on the API port; 0: on the API port.
    #: /metrics takes no key: a port of its own lets a NetworkPolicy admit only Prometheus
    metrics_port: int = 0
    #: the cyclic collector's young-generation threshold once start-up is done (0: Python's
    #: default, 700). A routed chat turn allocates thousands of containers that reference
    #: counting frees; at 700 young collections walk each request in flight several times
    #: and promote it to older generations (docs/benchmarks.md, "The collector's young
    #: threshold, again": 69-83% less collector time at 10,000, largest young pause < 14 ms)
    gc_young_threshold: int = 10_000


@dataclass
class RedisSettings:
    #: redis:// or rediss:// URL (AUTH in the URL); empty: no registry, static workers only
    url: str = ""
    #: password (AUTH) when it is not in the URL; keep it in a secret (env KVROUTE_REDIS__PASSWORD)
    password: str = ""
    #: CA bundle for rediss:// when the server's certificate is not in the system store
    tls_ca_file: str = ""
    connect_timeout: float = 1.0
    #: Redis Cluster: ``url`` names any node, the client follows the slot map (a worker's
    #: keys share the hash tag ``{worker}``, so they live on one shard)
    cluster: bool = False
    #: Redis Sentinel: ``host:port`` of each sentinel; they name the primary of
    #: ``sentinel_master`` (``url`` is then unused)
    sentinels: list[str] = field(default_factory=list)
    sentinel_master: str = ""
    #: seconds from one read of the KV-event streams that returned entries to the next: the
    #: entries that arrive in between come in one round trip (it bounds the lag it adds)
    read_interval: float = 0.01

    @property
    def enabled(self) -> bool:
        return bool(self.url or self.sentinels)

    def validate(self) -> None:
        if self.cluster and self.sentinels:
            raise ConfigError("redis: cluster and sentinels exclude each other")
        if self.cluster and not self.url:
            raise ConfigError("redis.cluster: needs redis.url (any node of the cluster)")
        if self.sentinels and not self.sentinel_master:
            raise ConfigError("redis.sentinels: needs redis.sentinel_master (the primary's name)")
        if not 0.0 <= self.read_interval <= 1.0:
            raise ConfigError("redis.read_interval: must be between 0 and 1 (seconds)")


@dataclass
class StaticWorker:
    url: str
    worker_id: str = ""


@dataclass
class PoolSettings:
    """One served model: its tokenizer, block size and routing parameters."""

    model: str
    tokenizer: str
    aliases: list[str] = field(default_factory=list)
    #: template name shipped with kvroute, a .jinja path, or empty: from tokenizer_config.json
    chat_template: str = ""
    block_size: int = 16
    max_model_len: int = 131072
    policy: str = "ttft"
    policy_params: dict[str, Any] = field(default_factory=dict)
    #: prefill/decode disaggregation (workers registered with role "decode"): how the decode
    #: worker is chosen once the prefill worker is (by cache, with ``policy``); "ttft" weighs
    #: its load against the KV it already holds (less to transfer)
    decode_policy: str = "ttft"
    decode_policy_params: dict[str, Any] = field(default_factory=dict)
    cost: CostParams = field(default_factory=CostParams)
    #: strip trailing whitespace and normalise newlines in chat messages (and forward those)
    normalize_prompts: bool = False
    #: token ids kept by the incremental tokenization cache (about 20 bytes each)
    tokenizer_cache_tokens: int = 4_000_000
    #: a prompt whose uncached text has at least this many characters is encoded on a worker
    #: thread (``encode_batch`` releases the GIL), so one cold prompt cannot stall the other
    #: requests; 0 encodes everything on the event loop (``kvroute bench gateway --stall``)
    tokenize_thread_chars: int = 8_192
    #: a completion prompt whose uncached text has at least this many characters is routed on
    #: its ids before that text (its cached pieces: a known prefix) while the text is encoded
    #: on a worker thread, so the encode overlaps routing and sending; the exact ids still
    #: decide the context-length check (before the first byte reaches the client), the keys
    #: and the speculative insert. 0 (or ``tokenize_thread_chars: 0``): every prompt is
    #: encoded before it is routed
    tokenize_overlap_chars: int = 512
    #: ... and only when that uncached text is at most this fraction of the prompt's tokens
    #: (estimated), which bounds what the decision can miss: a worker's match on that text
    tokenize_overlap_fraction: float = 0.125
    #: a chat turn of a known conversation is routed on the ids its previous turn left
    #: (found by its messages, before the render) and sent while it is rendered and its new
    #: text encoded; the exact ids then complete the keys and the speculative insert and
    #: decide the context check before the first byte reaches the client (the same fraction
    #: bounds what the decision can miss). A chat whose new text is longer (a new
    #: conversation's pasted document, a tool's long output) is rendered first, then routed
    #: on its known first ids as a completion prompt is (the two settings below and above)
    tokenize_overlap_chats: bool = True
    #: a completion prompt (or rendered chat) with nothing cached (or too much new text for
    #: the fraction above) is routed on its first ids when no worker holds all of their
    #: blocks: its first uncached piece is encoded here, and if the index's longest match
    #: stops inside it the rest of the prompt cannot lengthen any worker's match, so the
    #: decision on those ids is the decision on all of them (only the count is estimated);
    #: the rest is encoded while the request is on its way. After a prefix some worker holds
    #: whole (a head every request shares), up to four more pieces are encoded here to find
    #: where the match stops
    tokenize_overlap_cold: bool = True
    #: ... and before a whole piece (~1 KB) is encoded here for that, the start of it up to
    #: this many characters (the next cut the tokenizer allows): when the index's match stops
    #: inside those ids the request is routed on them and the piece is encoded with the rest,
    #: off the loop. A prompt some worker holds the start of pays the short encode twice.
    #: 0: whole pieces only
    tokenize_probe_chars: int = 192
    static_workers: list[StaticWorker] = field(default_factory=list)
    #: LoRA adapters every worker of the pool serves (engines started with the same
    #: ``--lora-modules``); a request names one as its ``model``. Workers also register the
    #: adapters their engine lists in ``/v1/models``.
    adapters: list[str] = field(default_factory=list)
    #: seeds the pool's routing random source (cold picks, ties): reproducible decisions for
    #: tests and replays (``kvroute simulate --from-log --seed``); None: seeded by the OS.
    #: Leave it unset with several replicas, which would otherwise break ties alike
    seed: int | None = None


@dataclass
class IndexSettings:
    #: the deployment's secret block-key seed; must equal the agents' --hash-seed
    hash_seed: str = "kvroute"
    speculative_ttl: float = 5.0
    #: ask each new worker's engine to tokenize a probe text (``/tokenize``) and refuse the
    #: worker when its ids differ from the gateway's (gateway/tokencheck.py)
    verify_engine_tokenizer: bool = True


@dataclass
class ReplicaSettings:
    """Gateway replicas (processes behind one balancer, or ``server.workers``) sharing their
    placements over the bus (``gateway/placements.py``)."""

    #: publish this replica's speculative inserts and adopt the others' (needs Redis)
    share_placements: bool = True
    #: seconds between batches (one XADD per batch; every replica reads every batch)
    interval: float = 0.02
    #: a request's start is sent at once, not at the period's end (the others route on top
    #: of it until they count it), at most one such batch per ``start_gap`` seconds
    start_gap: float = 0.002
    #: placements kept for the next batch at most (the newest; the rest dropped, counted)
    max_pending: int = 10_000
    #: also share each request's start and end, and the prefix it shared: every replica's
    #: load views and prefix rates then count the others' requests (gateway/routing/remote.py)
    share_load: bool = True
    #: seconds after which another replica's request whose end was never heard stops counting
    remote_ttl: float = 300.0


@dataclass
class ProxySettings:
    connect_timeout: float = 2.0
    #: seconds until the upstream's first body byte (long prompts prefill for a while)
    first_byte_timeout: float = 120.0
    #: seconds between body chunks once streaming
    idle_timeout: float = 120.0
    max_retries: int = 2
    retry_backoff: float = 0.05
    retry_statuses: list[int] = field(default_factory=lambda: [429, 502, 503, 504])
    connections_per_worker: int = 256
    #: Authorization sent to workers (engines started with --api-key), never the client's
    upstream_api_key: str = ""


@dataclass
class WarmupSettings:
    """Warm-ups (gateway/warmup.py): one-token requests carrying a hot prefix to a new holder."""

    #: send the warm-ups the routing policy asks for (off: they are dropped and counted)
    enabled: bool = True
    #: warm-ups in flight at once per gateway process (more are dropped, counted, not queued)
    max_inflight: int = 4
    #: seconds a warm-up may take (a cold prefill of a long prefix on a busy worker)
    timeout: float = 120.0


@dataclass
class LimitSettings:
    #: requests in flight upstream at once (0: unlimited)
    max_concurrency: int = 0
    #: requests waiting for a slot beyond which new ones get 429
    queue_size: int = 1024
    #: seconds a request may wait for a slot before a 408
    queue_timeout: float = 30.0


@dataclass
class CircuitSettings:
    #: consecutive failures (timeouts, 5xx) that open a worker's circuit
    failure_threshold: int = 3
    #: a refused connection opens the circuit at once
    open_on_connect_error: bool = True
    #: seconds an open circuit waits before letting one probe request through
    open_seconds: float = 2.0


@dataclass
class ApiKey:
    key: str
    name: str = ""
    #: higher tiers are served first when requests queue for a slot
    priority: int = 0
    #: requests per second (0: unlimited), bursts up to twice that
    requests_per_s: float = 0.0
    #: prompt + completion tokens per second (0: unlimited)
    tokens_per_s: float = 0.0


@dataclass
class AuthSettings:
    #: client keys (Bearer); empty: no authentication on the API
    api_keys: list[ApiKey] = field(default_factory=list)
    #: key for /debug/route and /workers; empty: admin endpoints disabled
    admin_key: str = ""


@dataclass
class SecuritySettings:
    #: hosts or CIDRs registrations may point at; empty: any host (trusted Redis)
    allowed_upstreams: list[str] = field(default_factory=list)


@dataclass
class LogSettings:
    level: str = "info"
    #: log prompts and completions (off: never logged)
    log_prompts: bool = False
    access_log: bool = False


@dataclass
class RequestLogSettings:
    """The request log ``kvroute simulate --from-log`` replays (``gateway/request_log.py``).

    One JSON line per routed request: block keys re-hashed with ``salt``, lengths, the
    decision and the candidate workers; never text or token ids.
    """

    #: file to append to; empty: no request log. With ``server.workers`` N, process i
    #: writes ``<path>.<i>`` (one writer per file; the replay merges them by time)
    path: str = ""
    #: rotate when the file reaches this size (0: never); ``<path>.1`` .. ``.<backups>`` kept
    max_bytes: int = 256 * 1024 * 1024
    backups: int = 3
    #: fraction of requests logged (1.0: all; a replay of a sample under-states the load)
    sample: float = 1.0
    #: records waiting for the writer beyond which new ones are dropped (and counted)
    queue_size: int = 10_000
    #: secret of the keyed hash applied to block keys and session keys before they are
    #: written; empty: derived from ``index.hash_seed`` (see docs/architecture.md)
    salt: str = ""


@dataclass
class GatewayConfig:
    pools: list[PoolSettings] = field(default_factory=list)
    server: ServerSettings = field(default_factory=ServerSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    index: IndexSettings = field(default_factory=IndexSettings)
    replicas: ReplicaSettings = field(default_factory=ReplicaSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    warmup: WarmupSettings = field(default_factory=WarmupSettings)
    circuit: CircuitSettings = field(default_factory=CircuitSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    log: LogSettings = field(default_factory=LogSettings)
    request_log: RequestLogSettings = field(default_factory=RequestLogSettings)
    #: anti-entropy and precision: which workers' index entries routing believes
    trust: TrustSettings = field(default_factory=TrustSettings)
    #: headers carrying a session id, first present wins (the ``session`` policy's key)
    session_headers: list[str] = field(
        default_factory=lambda: ["x-session-affinity", "x-session-id"]
    )
    #: body fields carrying a session id when no header does ("a.b": field b of object a)
    session_fields: list[str] = field(
        default_factory=lambda: ["user", "prompt_cache_key", "metadata.user_id"]
    )
    #: one more session header, tried before ``session_headers`` (the former single setting)
    session_header: str = ""

    def validate(self) -> None:
        """Cross-field checks the types cannot express (raises ConfigError)."""
        if not self.pools:
            raise ConfigError("pools: at least one pool is required")
        names: set[str] = set()
        for i, p in enumerate(self.pools):
            for name in [p.model, *p.aliases, *p.adapters]:
                if name in names:
                    raise ConfigError(f"pools.{i}: model name {name!r} is served twice")
                names.add(name)
            if p.block_size < 1:
                raise ConfigError(f"pools.{i}.block_size: must be >= 1")
            if p.tokenize_thread_chars < 0:
                raise ConfigError(f"pools.{i}.tokenize_thread_chars: must be >= 0")
            if p.tokenize_overlap_chars < 0:
                raise ConfigError(f"pools.{i}.tokenize_overlap_chars: must be >= 0")
            if p.tokenize_probe_chars < 0:
                raise ConfigError(f"pools.{i}.tokenize_probe_chars: must be >= 0")
            if not 0.0 <= p.tokenize_overlap_fraction <= 1.0:
                raise ConfigError(f"pools.{i}.tokenize_overlap_fraction: must be in [0, 1]")
            if p.max_model_len < 1:
                raise ConfigError(f"pools.{i}.max_model_len: must be >= 1")
        self.redis.validate()
        if not self.redis.enabled and not any(p.static_workers for p in self.pools):
            raise ConfigError("redis.url is empty and no pool has static_workers: no workers")
        if self.server.workers < 1:
            raise ConfigError("server.workers: must be >= 1")
        if self.server.gc_young_threshold < 0:
            raise ConfigError("server.gc_young_threshold: must be >= 0 (0: Python's default)")
        if self.replicas.interval <= 0 or self.replicas.max_pending < 1:
            raise ConfigError("replicas: interval must be > 0 and max_pending >= 1")
        if self.replicas.remote_ttl <= 0:
            raise ConfigError("replicas: remote_ttl must be > 0")
        if not 0 <= self.replicas.start_gap <= self.replicas.interval:
            raise ConfigError("replicas: start_gap must be within [0, interval]")
        rl = self.request_log
        if not 0.0 <= rl.sample <= 1.0:
            raise ConfigError("request_log.sample: must be between 0 and 1")
        if rl.queue_size < 1 or rl.max_bytes < 0 or rl.backups < 0:
            raise ConfigError("request_log: queue_size >= 1, max_bytes and backups >= 0")
        if self.server.metrics_port and self.server.metrics_port == self.server.port:
            raise ConfigError("server.metrics_port: must differ from server.port (or be 0)")
