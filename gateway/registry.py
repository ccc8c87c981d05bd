"""Worker registry: which workers exist, which pool each serves, and whether it is healthy.

Workers come from the agents' registrations on the event bus (via the consumer) and from
the pools' optional static lists. A registration is accepted only if its URL is an http(s)
URL whose host is in the configured allow-list (when one is set): a bad entry in Redis must
not be able to point the gateway at an arbitrary address. Upstream URLs come only from here,
never from a client request. A registration whose seed fingerprint differs from the
gateway's is refused too: that agent keys blocks with another hash seed, so routing to it on
cache affinity would be blind (docs/protocol.md, section 6). Every refusal is logged once
and reported (``on_reject``) with a reason code for the metric.

Health is a circuit breaker per worker (passive: request outcomes) plus, for static workers,
an active probe result. Only unhealthy workers are looked at per request, so computing a
pool's exclusions costs nothing in the normal case.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.circuit import Circuit, CircuitState
from gateway.config import CircuitSettings
from gateway.contract.wire import WorkerInfo
from gateway.pool import Pool
from gateway.routing.policy import Decision
from gateway.trust import TrustBook

__all__ = ["Registry", "WorkerEntry", "check_upstream_url"]

log = logging.getLogger(__name__)


@dataclass
class WorkerEntry:
    worker_id: str
    url: str
    pool: Pool
    circuit: Circuit
    static: bool = False
    probe_ok: bool = True  # static workers: result of the last active health probe
    info: WorkerInfo | None = None
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def role(self) -> str:
        """ "prefill", "decode" or "" (whole requests)."""
        return self.info.role if self.info is not None else ""


def check_upstream_url(url: str, allowed: list[str]) -> str | None:
    """Why ``url`` may not be used as an upstream (None: it may)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "not a URL"
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme!r} is not http or https"
    host = parts.hostname
    if not host:
        return "no host"
    if parts.username or parts.password:
        return "credentials in the URL"
    if parts.query or parts.fragment:
        return "a query or fragment in the URL"
    if not allowed:
        return None
    try:
        addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    for rule in allowed:
        if addr is not None and "/" in rule:
            try:
                if addr in ipaddress.ip_network(rule, strict=False):
                    return None
            except ValueError:
                continue
        elif (rule.startswith("*.") and host.endswith(rule[1:])) or host == rule:
            return None
    return f"host {host!r} is not in security.allowed_upstreams"


def _check_rank(info: WorkerInfo) -> str | None:
    """Why a registration's data-parallel rank cannot be pinned to, or its role is unknown
    (None: it can be routed to)."""
    if info.role not in ("", "prefill", "decode"):
        return f"unknown role {info.role!r} (prefill, decode or empty)"
    rank = info.dp_rank
    if rank is None or 0 <= rank < info.dp_size:
        return None
    return f"dp_rank {rank} is out of range [0, {info.dp_size})"


class Registry:
    def __init__(
        self,
        pools: list[Pool],
        circuit: CircuitSettings,
        allowed_upstreams: list[str],
        seed_fingerprint: str = "",
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.pools = pools
        self._by_model: dict[str, Pool] = {}
        for p in pools:
            for name in [p.settings.model, *p.settings.aliases]:
                self._by_model[name] = p
        self.circuit_settings = circuit
        self.allowed = allowed_upstreams
        self.workers: dict[str, WorkerEntry] = {}
        self._unhealthy: set[str] = set()  # workers whose circuit is not closed or probe failed
        self.rejected: dict[str, str] = {}  # registrations refused, and why
        #: this gateway's seed fingerprint; empty: registrations are not checked
        self.seed_fingerprint = seed_fingerprint
        #: called with a reason code (seed_mismatch, unknown_model, upstream_not_allowed)
        #: each time a worker's registration becomes refused
        self.on_reject = on_reject
        #: accepted workers whose registration carries no seed fingerprint (older agents)
        self.unverified: set[str] = set()
        #: refusals found after a registration was accepted (its engine's tokenizer differs),
        #: per worker: (the agent run's epoch, reason code, why); a new run is judged afresh
        self._vetoed: dict[str, tuple[int, str, str]] = {}
        #: whose index entries to believe, and the precision measured per worker
        self.trust = TrustBook()
        #: called with (pool, worker, predicted, agreed) tokens of each served request
        self.on_precision: Callable[[str, str, int, int], None] | None = None

    # -- pools ------------------------------------------------------------------------------

    def pool_for(self, model: str | None) -> Pool | None:
        if model is None:
            return self.pools[0] if len(self.pools) == 1 else None
        return self._by_model.get(model)

    def models(self) -> list[str]:
        return list(self._by_model)

    # -- membership -------------------------------------------------------------------------

    def add_static(self) -> None:
        for pool in self.pools:
            for i, sw in enumerate(pool.settings.static_workers):
                wid = sw.worker_id or f"{pool.name}-static-{i}"
                self._add(wid, sw.url, pool, static=True)

    def sync(self, infos: dict[str, WorkerInfo]) -> tuple[list[str], list[str]]:
        """Make the registered (non-static) workers equal ``infos``; returns (added, removed)."""
        added, removed = [], []
        for wid in [w for w, e in self.workers.items() if not e.static and w not in infos]:
            self._remove(wid)
            removed.append(wid)
        for wid in [w for w in self.rejected if w not in infos]:
            del self.rejected[wid]  # lapsed: bounded by the registrations in Redis
        for wid in [w for w in self._vetoed if w not in infos]:
            del self._vetoed[wid]
        for wid, info in infos.items():
            entry = self.workers.get(wid)
            if entry is not None and entry.static:
                continue
            pool = self._pool_of(info)
            refusal = self._refusal(info, pool)
            if refusal is not None:
                reason, why = refusal
                if self.rejected.get(wid) != why:
                    log.warning(
                        "refusing the registration of worker %s (%s): %s", wid, info.url, why
                    )
                    if self.on_reject is not None:
                        self.on_reject(reason)
                self.rejected[wid] = why
                if entry is not None:
                    self._remove(wid)
                    removed.append(wid)
                continue
            assert pool is not None
            self.rejected.pop(wid, None)
            if entry is not None and (
                entry.url != info.url or entry.pool is not pool or entry.role != info.role
            ):
                self._remove(wid)
                removed.append(wid)
                entry = None
            if entry is None:
                self._add(wid, info.url, pool, info=info)
                added.append(wid)
            else:
                entry.info = info
        self._set_engine_block_sizes()
        self.unverified = {
            w for w, e in self.workers.items()
            if self.seed_fingerprint and e.info is not None and not e.info.seed_fingerprint
        }  # fmt: skip
        return added, removed

    def veto(self, wid: str, epoch: int, reason: str, why: str) -> bool:
        """Refuse a registered worker for the rest of its agent run ``epoch`` (a check made
        after it was accepted failed); True if it was removed."""
        entry = self.workers.get(wid)
        if entry is None or entry.static or entry.info is None or entry.info.epoch != epoch:
            return False
        self._vetoed[wid] = (entry.info.epoch, reason, why)
        log.warning("refusing worker %s (%s): %s", wid, entry.url, why)
        if self.on_reject is not None:
            self.on_reject(reason)
        self.rejected[wid] = why
        self._remove(wid)
        self._set_engine_block_sizes()
        return True

    def _refusal(self, info: WorkerInfo, pool: Pool | None) -> tuple[str, str] | None:
        """(reason code, explanation) when ``info`` must not be routed to; None: accept."""
        vetoed = self._vetoed.get(info.worker_id)
        if vetoed is not None and vetoed[0] == info.epoch:
            return vetoed[1], vetoed[2]
        if pool is None:
            return "unknown_model", f"serves model {info.model!r}, which no pool serves"
        theirs, ours = info.seed_fingerprint, self.seed_fingerprint
        if ours and theirs and theirs != ours:
            return "seed_mismatch", (
                f"its hash seed differs from this gateway's (seed fingerprint {theirs}, "
                f"ours {ours}), so none of its block keys can match: give the agent the "
                "gateway's index.hash_seed (--hash-seed / KVROUTE_AGENT_HASH_SEED)"
            )
        why = check_upstream_url(info.url, self.allowed)
        if why is not None:
            return "upstream_not_allowed", why
        why = _check_rank(info)
        if why is not None:
            return "bad_topology", why
        return None

    def _set_engine_block_sizes(self) -> None:
        """Each pool's engine block size, from its workers' registrations: the engines reuse
        whole engine blocks only, and an agent learns its engine's size after it registers
        (vLLM says it in ``/metrics``). A pool's engines share one size; take the coarsest."""
        for pool in self.pools:
            size = max(
                (e.info.engine_block_size for e in self.workers.values()
                 if e.pool is pool and e.info is not None),
                default=1,
            )  # fmt: skip
            pool.router.engine_block_size = pool.decode_router.engine_block_size = size

    def _pool_of(self, info: WorkerInfo) -> Pool | None:
        return self._by_model.get(info.pool) or self._by_model.get(info.model)

    def _add(
        self, wid: str, url: str, pool: Pool, static: bool = False, info: WorkerInfo | None = None
    ) -> None:
        c = self.circuit_settings
        self.workers[wid] = WorkerEntry(
            wid,
            url.rstrip("/"),
            pool,
            Circuit(c.failure_threshold, c.open_seconds),
            static=static,
            info=info,
            labels=dict(info.labels) if info else {},
        )
        pool.router_for(info.role if info else "").add_worker(wid)

    def _remove(self, wid: str) -> None:
        self.trust.forget(wid)
        entry = self.workers.pop(wid, None)
        if entry is not None:
            entry.pool.router_for(entry.role).remove_worker(wid)
        self._unhealthy.discard(wid)

    # -- health -----------------------------------------------------------------------------

    def observe(self, pool: str, decision: Decision, cached: int | None, now: float) -> None:
        """A served request: the tokens the index predicted cached against the ``cached``
        tokens the engine reported reusing (None: it reported no usage, nothing to learn)."""
        if cached is None:
            return
        wid, predicted = decision.worker, decision.matched_tokens
        agreed = self.trust.observe(wid, predicted, cached, now)
        if self.on_precision is not None:
            self.on_precision(pool, wid, predicted, agreed)

    def exclude(self, pool: Pool, now: float, also: Iterable[str] = ()) -> frozenset[str]:
        """Workers of ``pool`` not to route to now (open circuits, failed probes) + ``also``."""
        out = set(also)
        for wid in self._unhealthy:
            e = self.workers.get(wid)
            if e is None or e.pool is not pool:
                continue
            if not e.probe_ok or not e.circuit.allows(now):
                out.add(wid)
        return frozenset(out)

    def on_send(self, wid: str) -> None:
        e = self.workers.get(wid)
        if e is not None:
            e.circuit.on_send()

    def on_success(self, wid: str) -> None:
        e = self.workers.get(wid)
        if e is not None and e.circuit.state is not CircuitState.CLOSED:
            e.circuit.on_success()
            self._refresh(wid, e)
        elif e is not None:
            e.circuit.failures = 0

    def on_failure(self, wid: str, now: float, fatal: bool) -> None:
        e = self.workers.get(wid)
        if e is None:
            return
        e.circuit.on_failure(now, fatal and self.circuit_settings.open_on_connect_error)
        self._refresh(wid, e)

    def set_probe(self, wid: str, ok: bool) -> None:
        e = self.workers.get(wid)
        if e is not None:
            e.probe_ok = ok
            self._refresh(wid, e)

    def healthy(self, wid: str, now: float) -> bool:
        e = self.workers.get(wid)
        return e is not None and e.probe_ok and e.circuit.allows(now)

    def _refresh(self, wid: str, e: WorkerEntry) -> None:
        if e.probe_ok and e.circuit.state is CircuitState.CLOSED:
            self._unhealthy.discard(wid)
        else:
            self._unhealthy.add(wid)
