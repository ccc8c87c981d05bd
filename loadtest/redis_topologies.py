"""Private Redis Cluster and Sentinel deployments on loopback, for tests and benchmarks.

``LocalCluster``: ``primaries`` cluster-mode ``redis-server`` processes (each with
``replicas`` replicas) joined by ``redis-cli --cluster create``; ``LocalSentinel``: one
primary, one replica and three sentinels. Both are started and waited for by polling what
the servers say (``CLUSTER INFO``, ``INFO replication``, ``SENTINEL ...``) against a
deadline, and both kill every process they started on ``close()``. Short node and down-after
timeouts make a failover take a couple of seconds.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from loadtest.harness import HarnessError, RedisServer, free_ports

__all__ = ["LocalCluster", "LocalSentinel", "poll"]


def poll(cond: Callable[[], Any], within: float, what: str, every: float = 0.05) -> Any:
    """Call ``cond`` until it returns something truthy (errors count as not yet); raise
    ``HarnessError`` naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    last: BaseException | None = None
    while True:
        try:
            got = cond()
            if got:
                return got
        except (redis.RedisError, OSError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {within}s waiting for {what} (last: {last})")
        time.sleep(every)


def _owner(shards: list[Any], slot: int) -> int | None:
    """The primary's port serving ``slot`` in a ``CLUSTER SLOTS`` reply (None: nobody)."""
    for s in shards:
        if int(s[0]) <= slot <= int(s[1]):
            return int(s[2][1])
    return None


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1)


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _info(port: int, section: str) -> dict[str, Any]:
    with _client(port) as r:
        return dict(r.info(section))


@dataclass
class LocalCluster:
    """A Redis Cluster on loopback: ``primaries`` shards of one primary + ``replicas``."""

    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    workdir: Path | None = None
    nodes: list[RedisServer] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvroute-cluster-"))

    @property
    def url(self) -> str:
        """A seed node: the cluster client discovers the others from it."""
        return self.nodes[0].url

    def start(self, within: float = 60.0) -> LocalCluster:
        try:
            return self._start(within)
        except BaseException:
            self.close()
            raise

    def _start(self, within: float) -> LocalCluster:
        assert self.workdir is not None
        count = self.primaries * (1 + self.replicas)
        ports = free_ports(2 * count)  # a client port and a cluster bus port each
        for i, (port, bus_port) in enumerate(zip(ports[:count], ports[count:], strict=True)):
            wd = self.workdir / f"node{i}"
            wd.mkdir(parents=True, exist_ok=True)
            node = RedisServer(
                port=port,
                workdir=wd,
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(bus_port),
                    "--cluster-config-file", str(wd / "nodes.conf"),
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    # a replica may take over however stale it is (tests kill primaries)
                    "--cluster-replica-validity-factor", "0",
                ],
            )  # fmt: skip
            self.nodes.append(node)
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise HarnessError("redis-cli not found (Debian package redis-tools)")
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        cmd = [cli, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas)]
        subprocess.run([*cmd, "--cluster-yes"], check=True, capture_output=True, timeout=within)
        poll(self.healthy, within, "the cluster to be ok with every replica in sync")
        return self

    def healthy(self) -> bool:
        """Every live node says ``cluster_state:ok``, sees all nodes, and each shard has its
        replicas linked to its primary."""
        live = [n for n in self.nodes if n.proc is not None]
        for n in live:
            info = self._cluster_info(n.port)
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
                return False
        primaries = self.shard_primaries()
        if len(primaries) != self.primaries:
            return False
        return all(
            _info(n.port, "replication").get("master_link_status") == "up"
            for n in live
            if n.port not in primaries
        )

    def _cluster_info(self, port: int) -> dict[str, str]:
        with _client(port) as r:
            info = r.execute_command("CLUSTER INFO")
        if isinstance(info, dict):  # redis-py parses the reply
            return {_str(k): _str(v) for k, v in info.items()}
        return dict(line.split(":", 1) for line in _str(info).splitlines() if ":" in line)

    def shard_primaries(self) -> list[int]:
        """Ports of the live primaries that serve slots, as a live node sees them."""
        live = [n for n in self.nodes if n.proc is not None]
        with _client(live[0].port) as r:
            shards = r.execute_command("CLUSTER SLOTS")
        return sorted({int(s[2][1]) for s in shards})

    def primary_for(self, key: str) -> int:
        """Port of the live primary serving ``key``'s slot."""
        live = [n for n in self.nodes if n.proc is not None]
        with _client(live[0].port) as r:
            slot = int(r.execute_command("CLUSTER KEYSLOT", key))
            shards = r.execute_command("CLUSTER SLOTS")
        owner = _owner(shards, slot)
        if owner is None:
            raise HarnessError(f"slot {slot} of {key!r} is not served")
        return owner

    def slot_views(self, slot: int) -> dict[int, int | None]:
        """Every live node's own answer to who serves ``slot`` (node port -> primary port,
        None where the node says nobody, or cannot be asked): after a failover the nodes
        can disagree until the news has reached them all."""
        out: dict[int, int | None] = {}
        for n in self.nodes:
            if n.proc is None:
                continue
            try:
                with _client(n.port) as r:
                    out[n.port] = _owner(r.execute_command("CLUSTER SLOTS"), slot)
            except redis.RedisError:
                out[n.port] = None
        return out

    def replica_of(self, primary_port: int) -> int:
        """Port of a live replica of ``primary_port``."""
        for n in self.nodes:
            if n.proc is None or n.port == primary_port:
                continue
            info = _info(n.port, "replication")
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == primary_port:
                return n.port
        raise HarnessError(f"no live replica of {primary_port}")

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def fail_primary(self, primary_port: int, within: float = 30.0) -> int:
        """SIGKILL ``primary_port`` and wait until its replica serves its slots (automatic
        failover after ``node_timeout_ms``); returns the new primary's port."""
        replica = self.replica_of(primary_port)
        self.node(primary_port).kill()

        def promoted() -> bool:
            if _info(replica, "replication").get("role") != "master":
                return False
            return all(
                self._cluster_info(n.port).get("cluster_state") == "ok"
                for n in self.nodes
                if n.proc is not None
            )

        poll(promoted, within, f"replica {replica} to take over from {primary_port}")
        return replica

    def cpu_seconds(self) -> dict[int, float]:
        """``used_cpu_sys + used_cpu_user`` of every live node, by port."""
        out = {}
        for n in self.nodes:
            if n.proc is not None:
                info = _info(n.port, "cpu")
                out[n.port] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return out

    def close(self) -> None:
        for n in self.nodes:
            n.stop()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


SENTINEL_MASTER = "kvroute"


@dataclass
class LocalSentinel:
    """One primary, one replica and three sentinels (quorum 2) on loopback."""

    down_after_ms: int = 1000
    master: str = SENTINEL_MASTER
    workdir: Path | None = None
    primary: RedisServer | None = field(default=None, init=False)
    replica: RedisServer | None = field(default=None, init=False)
    sentinels: list[RedisServer] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvroute-sentinel-"))

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of every sentinel (``redis.sentinels``)."""
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def start(self, within: float = 60.0) -> LocalSentinel:
        try:
            return self._start(within)
        except BaseException:
            self.close()
            raise

    def _start(self, within: float) -> LocalSentinel:
        assert self.workdir is not None
        p_port, r_port, *s_ports = free_ports(5)
        self.primary = RedisServer(port=p_port, workdir=self.workdir / "primary")
        self.replica = RedisServer(
            port=r_port,
            workdir=self.workdir / "replica",
            extra_args=["--replicaof", "127.0.0.1", str(p_port)],
        )
        for server in (self.primary, self.replica):
            assert server.workdir is not None
            server.workdir.mkdir(parents=True, exist_ok=True)
            server.start()
        for port in s_ports:
            wd = self.workdir / f"sentinel{port}"
            wd.mkdir(parents=True, exist_ok=True)
            conf = wd / "sentinel.conf"
            conf.write_text(
                f"sentinel monitor {self.master} 127.0.0.1 {p_port} 2\n"
                f"sentinel down-after-milliseconds {self.master} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.master} 10000\n"
                f"sentinel parallel-syncs {self.master} 1\n"
            )
            s = RedisServer(port=port, workdir=wd, config_file=conf, extra_args=["--sentinel"])
            self.sentinels.append(s)
            s.start()
        poll(self.ready, within, "the sentinels to see the replica and each other")
        return self

    def _sentinel(self, port: int, *args: str) -> Any:
        with _client(port) as r:
            return r.execute_command("SENTINEL", *args)

    def ready(self) -> bool:
        """The replica is in sync and every sentinel knows it and the other sentinels."""
        assert self.replica is not None
        if _info(self.replica.port, "replication").get("master_link_status") != "up":
            return False
        for s in self.sentinels:
            if len(self._sentinel(s.port, "REPLICAS", self.master)) < 1:
                return False
            if len(self._sentinel(s.port, "SENTINELS", self.master)) < len(self.sentinels) - 1:
                return False
        return True

    def master_port(self) -> int:
        """The primary's port as the first live sentinel names it."""
        addr = self._sentinel(self.sentinels[0].port, "GET-MASTER-ADDR-BY-NAME", self.master)
        return int(addr[1])

    def fail_primary(self, within: float = 30.0) -> int:
        """SIGKILL the primary and wait until the sentinels promoted the replica (and it says
        it is a primary); returns its port."""
        assert self.primary is not None and self.replica is not None
        self.primary.kill()
        new = self.replica.port

        def promoted() -> bool:
            if _info(new, "replication").get("role") != "master":
                return False
            return all(
                int(self._sentinel(s.port, "GET-MASTER-ADDR-BY-NAME", self.master)[1]) == new
                for s in self.sentinels
            )

        poll(promoted, within, f"the sentinels to promote {new}")
        return new

    def close(self) -> None:
        for s in [*self.sentinels, self.replica, self.primary]:
            if s is not None:
                s.stop()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
