"""Peer routers run side by side with kvroute on the same sim workers (the bench extra).

Every peer is its own process on loopback, launched here behind one small interface::

    pool = Pool(worker_urls, model, tokenizer_json, block_size, event_sources)
    with launch("smg-cache_aware", pool, log_dir) as peer:   # started and ready
        url = peer.url                                          # OpenAI-compatible endpoint

A peer system is a name from ``PEERS`` (``<kind>-<setting>``); ``peer_spec`` resolves it. The
kinds, one class each:

* ``smg`` 1.13+ (PyPI ``smg``, the SGLang model gateway): ``python -m smg launch`` (the
  module form: ``sglang-router`` 0.3.2 installs an ``smg`` script of its own). Ready when
  ``GET /readiness`` says every worker is healthy (``/health`` is 200 with no worker at all).
  ``cache_aware`` gets the pool's ``tokenizer.json`` and its L0/L1 tokenizer caches, its best
  configuration for HTTP workers (in HTTP mode it still matches request text, not tokens).
* ``vllm-router`` 0.1.17+ (PyPI ``vllm-router``): it opens its port only once every worker
  answers ``/health``; ready when ``GET /list_workers`` lists them all. ``kv_aware`` is
  given each worker's ZMQ KV-event and replay endpoints (``--kv-event-source URL=tcp://...``),
  the engines' block size and the model name: it indexes the engines' own events, the same
  information as kvroute, and tokenizes through the workers' ``/v1/chat/completions/render``
  and ``/tokenize``.
* ``sglang-router`` 0.3.2 (PyPI ``sglang-router``): history only. Measured here, a streamed
  request's time to first token grows by a constant ~42-45 ms through it whatever the prompt
  size (non-streamed ~1 ms): a stall in its streaming path, not routing work. Never a
  reference for a target.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from loadtest.harness import ChildProcess, HarnessError, free_ports

if TYPE_CHECKING:
    from loadtest.stack import Stack

__all__ = [
    "HISTORICAL_NOTE",
    "PEERS",
    "SMG_TUNING",
    "Peer",
    "PeerNotInstalled",
    "PeerSpec",
    "PeerUnsupported",
    "Pool",
    "SglangRouterPeer",
    "SmgPeer",
    "VllmRouterPeer",
    "is_peer",
    "launch",
    "peer_spec",
    "pool_from_stack",
]

BENCH_EXTRA = "pip install 'kvroute[bench]' (scripts/setup installs it)"
HISTORICAL_NOTE = (
    "sglang-router 0.3.2 (historical): a streamed request's TTFT grows by a constant ~42-45 ms "
    "through it (a stall in its streaming path); never a reference for a target"
)


#: a peer's error when a port it was given is bound by the time it starts (smg, vllm-router
#: and sglang-router are Rust: the OS error's text)
PORT_TAKEN = "Address already in use"
#: starts of a peer that lost a port race, the first included (``Peer.wait_ready``)
PORT_ATTEMPTS = 3


class PeerNotInstalled(HarnessError):
    """The peer's package is missing from this environment (the bench extra)."""


class PeerUnsupported(HarnessError):
    """The peer cannot take this workload as it is sent (e.g. token-id prompts to smg)."""


@dataclass(frozen=True)
class PeerSpec:
    """One peer system: which router, which policy, which extra flags."""

    name: str  # the system name in reports, e.g. "smg-cache_aware"
    kind: str  # "smg" | "vllm-router" | "sglang-router"
    policy: str
    args: tuple[str, ...] = ()
    #: smg: route with the pool's tokenizer.json (and its L0/L1 caches)
    tokenizer: bool = False
    #: vllm-router: subscribe to every worker's KV events (static sources)
    kv_events: bool = False
    #: takes token-id prompts (``/v1/completions`` with a list of ids); smg's and
    #: sglang-router's OpenAI routes take text only
    token_ids: bool = False
    #: prefill/decode disaggregation: ``policy`` picks the prefill worker, this the decode one
    pd_decode_policy: str | None = None
    note: str = ""

    @property
    def pd(self) -> bool:
        return self.pd_decode_policy is not None

    @property
    def historical(self) -> bool:
        return self.kind == "sglang-router"


def _smg(name: str, policy: str, *args: str, tokenizer: bool = True, note: str = "") -> PeerSpec:
    return PeerSpec(name, "smg", policy, args, tokenizer=tokenizer, note=note)


PEERS: dict[str, PeerSpec] = {
    s.name: s
    for s in (
        _smg("smg-cache_aware", "cache_aware", note="smg's best HTTP configuration"),
        _smg("smg-cache_aware-notok", "cache_aware", tokenizer=False, note="without tokenizer"),
        # smg docs, "Tuning guidelines": a low cache threshold (0.1-0.2) for conversational
        # workloads; lower balance thresholds for bursty traffic
        _smg(
            "smg-cache_aware-affinity",
            "cache_aware",
            "--cache-threshold",
            "0.1",
            note="docs: cache threshold 0.1 (conversational workloads)",
        ),
        _smg(
            "smg-cache_aware-spill",
            "cache_aware",
            "--balance-abs-threshold",
            "8",
            "--balance-rel-threshold",
            "1.25",
            note="docs: lower balance thresholds (bursty traffic)",
        ),
        _smg("smg-prefix_hash", "prefix_hash"),
        _smg("smg-power_of_two", "power_of_two", tokenizer=False),
        _smg("smg-least_load", "least_load", tokenizer=False),
        _smg("smg-round_robin", "round_robin", tokenizer=False, note="load-blind baseline"),
        PeerSpec(
            "vllm-router-kv_aware",
            "vllm-router",
            "kv_aware",
            kv_events=True,
            token_ids=True,
            note="indexes the engines' KV events (static per-worker sources)",
        ),
        PeerSpec("vllm-router-cache_aware", "vllm-router", "cache_aware", token_ids=True),
        PeerSpec(
            "vllm-router-round_robin",
            "vllm-router",
            "round_robin",
            token_ids=True,
            note="load-blind baseline",
        ),
        # prefill/decode disaggregation (``Pool.roles``): smg speaks SGLang's protocol
        # (bootstrap host/port/room), vllm-router vLLM's NIXL connector protocol
        PeerSpec(
            "smg-pd-cache_aware",
            "smg",
            "cache_aware",
            tokenizer=True,
            pd_decode_policy="power_of_two",
            note="smg --pd-disaggregation: prefill by cache_aware, decode by power_of_two",
        ),
        PeerSpec(
            "smg-pd-round_robin",
            "smg",
            "round_robin",
            pd_decode_policy="round_robin",
            note="load-blind baseline (disaggregated)",
        ),
        # its kv_aware policy takes static --kv-event-source in regular mode only
        PeerSpec(
            "vllm-router-pd-cache_aware",
            "vllm-router",
            "cache_aware",
            token_ids=True,
            pd_decode_policy="power_of_two",
            note="vllm-router --vllm-pd-disaggregation --kv-connector nixl: prefill by "
            "cache_aware (its kv_aware takes static KV-event sources in regular mode only), "
            "decode by power_of_two",
        ),
        PeerSpec(
            "vllm-router-pd-round_robin",
            "vllm-router",
            "round_robin",
            token_ids=True,
            pd_decode_policy="round_robin",
            note="load-blind baseline (disaggregated)",
        ),
        PeerSpec(
            "sglang-router-cache_aware-historical",
            "sglang-router",
            "cache_aware",
            note=HISTORICAL_NOTE,
        ),
        PeerSpec(
            "sglang-router-round_robin-historical",
            "sglang-router",
            "round_robin",
            note=HISTORICAL_NOTE,
        ),
    )
}

#: smg settings tried for "smg at its best" (round robin is the floor, not a candidate)
SMG_TUNING = (
    "smg-cache_aware",
    "smg-cache_aware-notok",
    "smg-cache_aware-affinity",
    "smg-cache_aware-spill",
    "smg-prefix_hash",
    "smg-power_of_two",
    "smg-least_load",
)


def is_peer(system: str) -> bool:
    return system in PEERS


def peer_spec(system: str) -> PeerSpec:
    try:
        return PEERS[system]
    except KeyError:
        raise ValueError(f"unknown peer {system!r}; known: {', '.join(PEERS)}") from None


@dataclass
class Pool:
    """What a peer needs to know about the workers it fronts."""

    worker_urls: list[str]
    model: str
    tokenizer: str  # the model's tokenizer.json
    block_size: int  # the engines' KV block size
    #: per worker: (KV events endpoint, replay endpoint), e.g. "tcp://127.0.0.1:5557"
    event_sources: list[tuple[str, str | None]] = field(default_factory=list)
    #: per worker under prefill/decode disaggregation: "prefill" or "decode" (empty: none)
    roles: list[str] = field(default_factory=list)

    def with_role(self, role: str) -> list[str]:
        return [u for u, r in zip(self.worker_urls, self.roles, strict=True) if r == role]


def _pd_args(flag: str, pool: Pool, spec: PeerSpec, bootstrap: bool) -> list[str]:
    """``<flag> --prefill URL [PORT] ... --decode URL ...`` and the two policies. A
    simulated prefill worker's bootstrap port is its HTTP port (loadtest.enginesim.disagg)."""
    args = [flag]
    for url in pool.with_role("prefill"):
        args += ["--prefill", url]
        if bootstrap:
            args.append(url.rsplit(":", 1)[1])
    for url in pool.with_role("decode"):
        args += ["--decode", url]
    assert spec.pd_decode_policy is not None
    return [
        *args, "--policy", spec.policy,
        "--prefill-policy", spec.policy, "--decode-policy", spec.pd_decode_policy,
    ]  # fmt: skip


class Peer:
    """A peer router process: ``start``, ``wait_ready``, ``url``, ``stop`` (also a context
    manager that starts it and waits until it is ready)."""

    kind: ClassVar[str] = ""
    package: ClassVar[str] = ""  # PyPI distribution
    min_version: ClassVar[tuple[int, ...]] = ()

    def __init__(
        self,
        spec: PeerSpec,
        pool: Pool,
        log_dir: Path,
        label: str = "",
        extra_args: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.extra_args = tuple(extra_args)
        self._take_ports()
        self.proc = ChildProcess(self.args, label or spec.name, log_dir)
        #: times it was started again on new ports (:meth:`wait_ready`)
        self.relaunches = 0

    # -- per kind ---------------------------------------------------------------------------

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        """One readiness probe (True: serves requests and knows every worker)."""
        raise NotImplementedError

    @classmethod
    def check_installed(cls) -> None:
        """Raise ``PeerNotInstalled`` naming the bench extra when the package is missing or
        older than ``min_version``."""
        try:
            version = importlib.metadata.version(cls.package)
        except importlib.metadata.PackageNotFoundError:
            raise PeerNotInstalled(
                f"{cls.kind}: the {cls.package} package is not installed ({BENCH_EXTRA})"
            ) from None
        if _version_tuple(version) < cls.min_version:
            want = ".".join(map(str, cls.min_version))
            raise PeerNotInstalled(
                f"{cls.kind}: {cls.package} {version} is installed, {want} or newer is needed "
                f"({BENCH_EXTRA})"
            )

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.proc.name

    def start(self) -> Peer:
        self.proc.start()
        return self

    def alive(self) -> bool:
        return self.proc.alive()

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Poll ``ready()`` until it holds (seconds waited); fails fast if the process dies.

        A peer that exits because a port it was given is taken is started again on new
        ports (``url`` changes), ``PORT_ATTEMPTS`` times in all: its ports were free when
        picked, but a router takes port numbers, not sockets, and another process (a test in
        the other pytest worker) can bind one first (CI, 2026-12-07)."""
        t0 = time.monotonic()
        while True:
            if not self.proc.alive():
                if self._lost_a_port() and self.relaunches + 1 < PORT_ATTEMPTS:
                    self._relaunch()
                    continue
                raise HarnessError(f"{self.name} exited:\n{self.proc.tail()}")
            try:
                if self.ready():
                    return time.monotonic() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass  # not listening yet, or an answer that is not JSON
            if time.monotonic() - t0 > timeout:
                raise HarnessError(f"{self.name} not ready in {timeout:g}s:\n{self.proc.tail()}")
            time.sleep(0.05)

    def _lost_a_port(self) -> bool:
        return any(PORT_TAKEN in line for line in self.proc.log_lines())

    def _take_ports(self) -> None:
        """Two free ports (its API, its metrics) and the command line that uses them."""
        self.port, self.metrics_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [*self.command(), *self.spec.args, *self.extra_args]

    def _relaunch(self) -> None:
        """The same process object started again on new ports (a stack that holds it still
        stops it)."""
        self.relaunches += 1
        self._take_ports()
        self.proc.args = list(self.args)
        self.proc.start()

    def stop(self) -> None:
        self.proc.stop(timeout=10.0)

    def tail(self, lines: int = 40) -> str:
        return self.proc.tail(lines)

    def __enter__(self) -> Peer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers ----------------------------------------------------------------------------

    def _get_json(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 503 bodies are JSON too
            return json.loads(exc.read() or b"null")


class SmgPeer(Peer):
    """``smg launch`` (the SGLang model gateway 1.13+)."""

    kind = "smg"
    package = "smg"
    min_version = (1, 13)

    def command(self) -> list[str]:
        s, p = self.spec, self.pool
        workers = (
            _pd_args("--pd-disaggregation", p, s, bootstrap=True)
            if s.pd
            else ["--policy", s.policy, "--worker-urls", *p.worker_urls]
        )
        args = [
            sys.executable, "-m", "smg", "launch",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            *workers,
            "--shutdown-grace-period-secs", "2", "--worker-startup-check-interval", "1",
            "--log-level", "warn",
        ]  # fmt: skip
        if s.tokenizer:
            args += [
                "--tokenizer-path", p.tokenizer,
                "--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1",
            ]  # fmt: skip
        return args

    def ready(self) -> bool:
        body = self._get_json("/readiness")
        n = len(self.pool.worker_urls)
        return (
            isinstance(body, dict)
            and body.get("status") == "ready"
            and body.get("healthy_workers") == n
            and body.get("total_workers") == n
        )


class VllmRouterPeer(Peer):
    """``vllm-router`` 0.1.17+ (kv_aware: the engines' own KV events)."""

    kind = "vllm-router"
    package = "vllm-router"
    min_version = (0, 1, 17)

    def command(self) -> list[str]:
        s, p = self.spec, self.pool
        workers = (
            [*_pd_args("--vllm-pd-disaggregation", p, s, bootstrap=False), "--kv-connector", "nixl"]
            if s.pd
            else ["--policy", s.policy, "--worker-urls", *p.worker_urls]
        )
        args = [
            _binary("vllm-router", "vllm_router.launch_router"),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            *workers,
            "--worker-startup-check-interval", "1", "--log-level", "warning",
        ]  # fmt: skip
        if s.kv_events:
            if len(p.event_sources) != len(p.worker_urls):
                raise HarnessError(f"{s.name} needs every worker's KV event endpoints")
            for url, (events, replay) in zip(p.worker_urls, p.event_sources, strict=True):
                args += ["--kv-event-source", f"{url}={events}"]
                if replay:
                    args += ["--kv-event-replay-source", f"{url}={replay}"]
            args += ["--kv-event-block-size", str(p.block_size), "--kv-event-model", p.model]
        return args

    def ready(self) -> bool:
        body = self._get_json("/list_workers")
        urls = body.get("urls") if isinstance(body, dict) else None
        return isinstance(urls, list) and set(urls) == set(self.pool.worker_urls)


class SglangRouterPeer(Peer):
    """``sglang-router launch`` 0.3.2 (historical row only; see the module docstring)."""

    kind = "sglang-router"
    package = "sglang-router"
    min_version = (0, 3)

    def command(self) -> list[str]:
        s, p = self.spec, self.pool
        return [
            _binary("sglang-router", "sglang_router.launch_router"), "launch",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--policy", s.policy, "--log-level", "warn", "--worker-urls", *p.worker_urls,
        ]  # fmt: skip

    def ready(self) -> bool:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
            if resp.status != 200:
                return False
        body = self._get_json("/workers")
        workers = body.get("workers") if isinstance(body, dict) else None
        return isinstance(workers, list) and len(workers) >= len(self.pool.worker_urls)


KINDS: dict[str, type[Peer]] = {
    "smg": SmgPeer,
    "vllm-router": VllmRouterPeer,
    "sglang-router": SglangRouterPeer,
}


def launch(
    system: str | PeerSpec,
    pool: Pool,
    log_dir: Path,
    *,
    label: str = "",
    extra_args: tuple[str, ...] | list[str] = (),
) -> Peer:
    """A peer of ``system`` for ``pool``, checked installed but not yet started (``start`` +
    ``wait_ready``, or use it as a context manager)."""
    spec = system if isinstance(system, PeerSpec) else peer_spec(system)
    cls = KINDS[spec.kind]
    cls.check_installed()
    return cls(spec, pool, log_dir, label=label, extra_args=extra_args)


def pool_from_stack(stack: Stack) -> Pool:
    """The pool of a running ``loadtest.stack.Stack``: its sim workers, model, tokenizer,
    block size and each worker's KV event endpoints (from the simulator's admin API)."""
    if stack.vllm is not None:  # real engines: their own block size and event sockets
        engines = stack.engines
        return Pool(
            list(stack.worker_urls),
            stack.config.model,
            stack.tokenizer_path(),
            engines[0].config.block_size,
            [(e.events_endpoint, e.replay_endpoint) for e in engines],
        )
    states = stack.sim_state()
    sources = [(str(w["events_endpoint"]), w.get("replay_endpoint")) for w in states]
    return Pool(
        list(stack.worker_urls),
        stack.config.model,
        stack.tokenizer_path(),
        stack.config.block_size,
        sources if all(e for e, _ in sources) else [],
        [stack.role(i) for i in range(len(stack.worker_urls))],
    )


def _binary(script: str, module: str) -> str:
    """The console script next to this interpreter, else on PATH."""
    local = Path(sys.executable).with_name(script)
    if local.exists():
        return str(local)
    found = shutil.which(script)
    if found is None:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise PeerNotInstalled(f"{script} is not installed ({BENCH_EXTRA})")
        raise PeerNotInstalled(
            f"{script}: its command is missing from {Path(sys.executable).parent}"
        )
    return found


def _version_tuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)
