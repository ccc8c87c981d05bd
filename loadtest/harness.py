"""Real processes on loopback for tests, benchmarks and the demo.

Starts a private ``redis-server`` on a free port (and can kill and restart it to inject
faults) and runs kvroute components as child processes whose output goes to log files.
Everything started here is stopped by ``close()`` / the context manager, also on errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ChildProcess",
    "HarnessError",
    "RedisServer",
    "free_port",
    "free_ports",
    "port_free",
    "post_json",
    "wait_for_port",
]


class HarnessError(RuntimeError):
    """A process did not start or stop as expected."""


def post_json(
    url: str, body: Any, timeout: float = 10.0, headers: dict[str, str] | None = None
) -> Any:
    """POST ``body`` as JSON to a process on loopback; its decoded JSON answer."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json", **(headers or {})},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def _listen_range() -> range:
    """Ports to hand to child servers: below the kernel's ephemeral range. A port the kernel
    picks for ``bind(0)`` is free only until an outgoing connection takes it, and a child
    binds it a second or more later (an agent's metrics port was lost that way in CI). Empty
    where the range cannot be read or leaves no room."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(10_000, low) if low > 12_000 else range(0)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind ``host:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", taken: frozenset[int] = frozenset()) -> int:
    """A TCP port that was free a moment ago, outside the kernel's ephemeral range when it can
    be (see :func:`_listen_range`), else one the kernel picks; never one of ``taken``."""
    ports = _listen_range()
    if ports:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.choice(ports)
            if port not in taken and port_free(port, host):
                return port
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            return port
    raise HarnessError("no free TCP port")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports."""
    out: list[int] = []
    for _ in range(n):
        out.append(free_port(host, frozenset(out)))
    return out


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
    """Block until something accepts TCP connections on ``host:port``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise HarnessError(f"nothing listening on {host}:{port} after {timeout}s") from None
            time.sleep(0.02)


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise HarnessError(
            "redis-server not found; run scripts/setup (installs the Debian package redis-server)"
        )
    return path


@dataclass
class RedisServer:
    """A private ``redis-server`` on loopback: no persistence, killable, restartable.

    ``password`` turns on ``requirepass``. The port stays the same across restarts so
    clients reconnect to the same URL.
    """

    port: int = 0
    password: str | None = None
    workdir: Path | None = None
    #: serve TLS only (a private CA and a certificate for 127.0.0.1 are generated)
    tls: bool = False
    #: more redis-server arguments (cluster mode, replicaof, ...)
    extra_args: list[str] = field(default_factory=list)
    #: a config file to start from (a sentinel needs one it can rewrite)
    config_file: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvroute-redis-"))

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> Path:
        """The CA certificate clients must trust (TLS servers only)."""
        assert self.workdir is not None
        return self.workdir / "tls" / "ca.crt"

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [
            redis_server_binary(),
            *([str(self.config_file)] if self.config_file is not None else []),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--protected-mode", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        if self.tls:
            tls = self._certificates()
            args[args.index("--port") + 1] = "0"
            args += [
                "--tls-port", str(self.port),
                "--tls-cert-file", str(tls / "server.crt"),
                "--tls-key-file", str(tls / "server.key"),
                "--tls-ca-cert-file", str(tls / "ca.crt"),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        assert self.workdir is not None
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_for_port(self.port, timeout=timeout)
        except HarnessError:
            self.kill()
            raise
        return self

    def _certificates(self) -> Path:
        """A throw-away CA and a server certificate for 127.0.0.1 (openssl CLI)."""
        assert self.workdir is not None
        tls = self.workdir / "tls"
        if (tls / "server.crt").exists():
            return tls
        tls.mkdir(parents=True, exist_ok=True)
        openssl = shutil.which("openssl")
        if openssl is None:
            raise HarnessError(
                "openssl is needed to make test certificates (Debian package openssl)"
            )
        (tls / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        steps = [
            [
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "2",
                "-subj",
                "/CN=kvroute-test-ca",
            ],
            [
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
            [
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.crt",
                "-days",
                "2",
                "-extfile",
                "ext.cnf",
            ],
        ]
        for step in steps:
            subprocess.run([openssl, *step], cwd=tls, check=True, capture_output=True)
        return tls

    def kill(self) -> None:
        """SIGKILL: the fault-injection way to lose Redis (nothing is saved)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class ChildProcess:
    """A kvroute component (or any command) run as a child process with a log file.

    Started in its own process group so ``stop()`` also reaches its children.
    """

    def __init__(
        self,
        args: Sequence[str],
        name: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.args = list(args)
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        #: size of the log when this run started: a restarted process appends to the same
        #: file, and only its own lines count (a ``ready`` of the previous run is stale)
        self.log_offset = 0
        #: started through ``kvroute``: it writes its stacks on ``STACKS_SIGNAL``
        self.is_kvroute = False

    @classmethod
    def kvroute(
        cls, argv: Sequence[str], name: str, log_dir: Path, env: dict[str, str] | None = None
    ) -> ChildProcess:
        """``kvroute ARGV...`` with this interpreter (no reliance on PATH)."""
        proc = cls([sys.executable, "-m", "gateway.cli", *argv], name, log_dir, env)
        proc.is_kvroute = True
        return proc

    def start(self) -> ChildProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.log_offset = log.seek(0, os.SEEK_END)
        self.proc = subprocess.Popen(
            self.args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_lines(self) -> list[str]:
        """This run's log lines (not those of an earlier run of the same name)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return []

    def wait_for_log(self, needle: str, timeout: float = 20.0, count: int = 1) -> str:
        """Block until ``needle`` has appeared ``count`` times in this run's log; return the
        line of the last of them."""
        deadline = time.monotonic() + timeout
        while True:
            # occurrences, not lines: processes sharing the log (a gateway's replicas) may
            # write theirs into one line
            found = 0
            for line in self.log_lines():
                found += line.count(needle)
                if found >= count:
                    return line
            if not self.alive():
                raise HarnessError(f"{self.name} exited before logging {needle!r}:\n{self.tail()}")
            if time.monotonic() > deadline:
                stacks = self.dump_stacks()
                raise HarnessError(
                    f"{self.name} logged {needle!r} {found} of {count} times"
                    f" in {timeout}s:\n{self.tail()}{stacks}"
                )
            time.sleep(0.02)

    def dump_stacks(self, timeout: float = 3.0) -> str:
        """A live kvroute process's thread stacks (``gateway.cli.STACKS_SIGNAL``) and, from
        a gateway whose loop still runs, its asyncio tasks, for the error that reports it
        stuck; "" for other commands, whose default action for that signal is to die."""
        if not self.is_kvroute or not self.alive():
            return ""
        from gateway.cli import STACKS_SIGNAL
        from gateway.main import TASKS_END

        before = len(self.log_lines())
        self.signal(STACKS_SIGNAL)
        deadline = time.monotonic() + timeout
        lines: list[str] = []
        while time.monotonic() < deadline:  # a blocked loop never writes the tasks' part
            lines = self.log_lines()[before:]
            if any(TASKS_END in line for line in lines):
                break
            time.sleep(0.05)
        return "\nits stacks:\n" + "\n".join(lines) if lines else "\n(no stacks written)"

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout=timeout)
        return self.proc.returncode


@contextlib.contextmanager
def children(*procs: ChildProcess) -> Iterator[tuple[ChildProcess, ...]]:
    """Start ``procs`` and stop all of them on exit, whatever happens."""
    started: list[ChildProcess] = []
    try:
        for p in procs:
            started.append(p.start())
        yield procs
    finally:
        for p in reversed(started):
            p.stop()
