"""What the agent needs from an engine, behind one small base class.

An adapter knows one engine family's HTTP surface: where its KV event publishers are
(discovery), which media count as GPU, and how its Prometheus ``/metrics`` map onto an
``EngineReport``. Event *decoding* is shared (``engines.decode``): vLLM and SGLang use the
same framing and the decoder accepts every known layout of both.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.contract.wire import EngineReport

__all__ = [
    "DiscoveryError",
    "EngineAdapter",
    "EventSource",
    "Samples",
    "endpoint_for_rank",
    "parse_metrics",
    "rank_samples",
    "resolve_host",
]


class DiscoveryError(RuntimeError):
    """The engine did not say where its KV events are (and none were configured)."""


@dataclass(frozen=True)
class EventSource:
    """One engine publisher (one data-parallel rank)."""

    rank: int
    endpoint: str  # tcp://host:port of the PUB socket
    replay: str | None = None  # tcp://host:port of the replay ROUTER
    topic: str = ""


@dataclass
class Discovery:
    sources: list[EventSource]
    block_size: int | None = None
    bootstrap_port: int | None = None  # SGLang prefill (disaggregation)


#: metric name -> list of (labels text, value); only the names asked for are kept.
Samples = dict[str, list[tuple[str, float]]]


class EngineAdapter(ABC):
    kind: str = ""
    #: ``medium`` values that mean "in GPU memory" (None: engines that do not say).
    gpu_media: frozenset[str | None] = frozenset({None, "GPU"})
    #: the metrics label naming a data-parallel rank (vLLM: ``engine``, SGLang: ``dp_rank``)
    rank_label: str = "engine"

    @abstractmethod
    def discover(self, info: Any, engine_url: str) -> Discovery:
        """Event sources from the engine's discovery document (already fetched JSON)."""

    @property
    @abstractmethod
    def discovery_path(self) -> str: ...

    @property
    @abstractmethod
    def metric_names(self) -> tuple[str, ...]: ...

    @abstractmethod
    def report(self, samples: Samples, ts: float) -> EngineReport: ...

    @abstractmethod
    def capacity_tokens(self, samples: Samples) -> int | None:
        """KV cache capacity in tokens if the metrics say (for the registration)."""

    def block_size(self, samples: Samples) -> int | None:
        """The engine's KV block size if the metrics say (engines whose discovery document
        does not carry it: vLLM 0.32's ``/kv_event_sources``)."""
        return None


def resolve_host(endpoint: str, engine_url: str) -> str:
    """``tcp://*:5557`` → ``tcp://<engine host>:5557`` (also ``0.0.0.0`` and ``::``)."""
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    m = re.match(r"^(tcp://)(\*|0\.0\.0\.0|\[::\]|::)(:\d+)$", endpoint)
    return f"{m.group(1)}{host}{m.group(3)}" if m else endpoint


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The vLLM/SGLang data-parallel rule: TCP port + rank (port 0 and ipc left alone)."""
    m = re.match(r"^(tcp://.+:)(\d+)$", endpoint)
    if not m or int(m.group(2)) == 0:
        return endpoint
    return f"{m.group(1)}{int(m.group(2)) + rank}"


def parse_metrics(text: str, names: Iterable[str]) -> Samples:
    """Prometheus text → samples of ``names`` only (a fast line filter, no full parser)."""
    wanted = set(names)
    out: Samples = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            labels, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            name, labels, rest = line[:space], "", line[space:]
        if name not in wanted:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        out.setdefault(name, []).append((labels, value))
    return out


def rank_samples(samples: Samples, key: str, ranks: list[int]) -> dict[int, Samples] | None:
    """``samples`` split per data-parallel rank by the label ``key``, or None when no series
    carries it (an engine that reports per worker only)."""
    out: dict[int, Samples] = {r: {} for r in ranks}
    labelled = False
    for name, series in samples.items():
        for labels, value in series:
            raw = label(labels, key)
            if raw is None or not raw.isdigit():
                continue
            labelled = True
            if int(raw) in out:
                out[int(raw)].setdefault(name, []).append((labels, value))
    return out if labelled else None


def total(samples: Samples, name: str) -> float | None:
    vals = samples.get(name)
    return None if not vals else sum(v for _, v in vals)


def mean(samples: Samples, name: str) -> float | None:
    vals = samples.get(name)
    return None if not vals else sum(v for _, v in vals) / len(vals)


def label(labels: str, key: str) -> str | None:
    m = re.search(rf'(?:^|,){re.escape(key)}="([^"]*)"', labels)
    return m.group(1) if m else None
