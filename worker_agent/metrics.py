"""The agent's own Prometheus metrics, in a registry of its own (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

__all__ = ["AgentMetrics"]


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "kvroute_agent_"
        self.frames = Counter(p + "frames_received", "Engine event frames received", registry=r)
        self.events = Counter(p + "events_decoded", "Engine events decoded", ["kind"], registry=r)
        self.bad = Counter(p + "events_bad", "Frames or events skipped", ["reason"], registry=r)
        self.dropped = Counter(
            p + "blocks_dropped", "Engine blocks not canonicalised", ["reason"], registry=r
        )
        self.blocks = Counter(
            p + "canonical_blocks", "Canonical keys published", ["op"], registry=r
        )
        self.gaps = Counter(p + "sequence_gaps", "Engine sequence gaps seen", registry=r)
        self.replays = Counter(p + "replays", "Replay requests by result", ["result"], registry=r)
        self.clears = Counter(p + "clears", "Clears published by reason", ["reason"], registry=r)
        self.entries = Counter(p + "entries_published", "Stream entries written", registry=r)
        self.publish_errors = Counter(p + "publish_errors", "Failed bus operations", registry=r)
        self.overflows = Counter(p + "buffer_overflows", "Buffers dropped for a resync", registry=r)
        self.snapshots = Counter(p + "snapshots", "Snapshots written", registry=r)
        self.scrape_errors = Counter(p + "scrape_errors", "Failed /metrics scrapes", registry=r)
        self.buffer_depth = Gauge(
            p + "buffer_depth", "Canonical events not yet published", registry=r
        )
        self.connected = Gauge(p + "redis_connected", "1 when the event bus answers", registry=r)
        self.heartbeats = Counter(
            p + "heartbeats", "Registration renewals by result (ok, error)", ["result"], registry=r
        )
        self.last_heartbeat = Gauge(
            p + "last_heartbeat_timestamp_seconds",
            "Unix time of the last registration renewal that reached the bus",
            registry=r,
        )
        self.mirror_blocks = Gauge(
            p + "mirror_blocks", "Canonical keys the worker holds", registry=r
        )

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (tests and logs), 0 when absent."""
        v = self.registry.get_sample_value("kvroute_agent_" + name, labels or None)
        return 0.0 if v is None else v

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
