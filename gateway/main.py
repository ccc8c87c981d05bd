"""``kvroute gateway``: run the gateway (one process, or N replicas on one port).

With ``--workers N`` (``server.workers``) a supervisor starts N processes that each bind the
same port with SO_REUSEPORT; the kernel spreads connections over them. Each is an
independent replica (its own index from the bus, its own load accounting), exactly like
separate gateway pods; Prometheus metrics are aggregated across them. The supervisor
restarts a process that dies and stops them all on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from gateway.config import GatewayConfig
from gateway.contract.settings import ConfigError, load_config, parse_assignments

__all__ = ["add_arguments", "run"]

log = logging.getLogger("kvroute.gateway")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML configuration file")
    p.add_argument("--host", help="listen address (server.host)")
    p.add_argument("--port", type=int, help="listen port (server.port)")
    p.add_argument("--workers", type=int, help="processes on the port (server.workers)")
    p.add_argument("--redis", help="event bus URL, redis:// or rediss:// (redis.url)")
    p.add_argument(
        "--redis-cluster",
        action="store_const",
        const=True,
        help="the Redis at --redis is a Redis Cluster (redis.cluster)",
    )
    p.add_argument("--redis-sentinels", help="host:port,... of Redis Sentinels (redis.sentinels)")
    p.add_argument("--redis-sentinel-master", help="primary's name (redis.sentinel_master)")
    p.add_argument(
        "--set",
        action="append",
        metavar="PATH=VALUE",
        help="any setting, e.g. --set proxy.max_retries=3",
    )
    p.add_argument("--log-level", help="debug, info, warning (log.level)")
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    overrides: dict[str, Any] = parse_assignments(args.set)
    for flag, path in (
        ("host", "server.host"),
        ("port", "server.port"),
        ("workers", "server.workers"),
        ("redis", "redis.url"),
        ("redis_cluster", "redis.cluster"),
        ("redis_sentinels", "redis.sentinels"),
        ("redis_sentinel_master", "redis.sentinel_master"),
        ("log_level", "log.level"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[path] = value
    cfg = load_config(GatewayConfig, file=args.config, env=os.environ, overrides=overrides)
    cfg.validate()
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        _request_log_path(cfg, args.worker_index)
    except ConfigError as exc:
        print(f"kvroute gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log.level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if cfg.server.workers > 1 and args.worker_index is None:
        return _supervise(cfg)
    try:
        _run_loop(serve(cfg, reuse_port=args.worker_index is not None, freeze_heap=True))
    except KeyboardInterrupt:
        pass
    return 0


def _request_log_path(cfg: GatewayConfig, worker_index: int | None) -> None:
    """One request log file per process (``<path>.<i>``), checked writable before serving."""
    rl = cfg.request_log
    if not rl.path:
        return
    from gateway.request_log import RequestLogError, process_path

    if worker_index is not None:
        rl.path = process_path(rl.path, worker_index)
    # the supervisor of N processes checks the first process's file
    first = process_path(rl.path, 0) if cfg.server.workers > 1 and worker_index is None else rl.path
    try:
        with open(first, "ab"):
            pass
    except OSError as exc:
        raise RequestLogError(
            f"request_log.path: cannot append to {first}: {exc.strerror or exc}"
        ) from None


def _run_loop(main: Any) -> None:
    """Run on uvloop where available: a libuv event loop costs a fraction of asyncio's own
    per request (measured on the gateway: see docs/benchmarks.md)."""
    try:
        import uvloop
    except ImportError:  # not on this platform: the standard loop works, only slower
        asyncio.run(main)
        return
    uvloop.run(main)


def make_bus(cfg: GatewayConfig) -> Any:
    if not cfg.redis.enabled:
        return None
    from gateway.contract.redis_bus import RedisBus

    extra: dict[str, Any] = {}
    if cfg.redis.password:
        extra["password"] = cfg.redis.password
    if cfg.redis.tls_ca_file:
        extra["ssl_ca_certs"] = cfg.redis.tls_ca_file
    return RedisBus(
        cfg.redis.url,
        connect_timeout=cfg.redis.connect_timeout,
        cluster=cfg.redis.cluster,
        sentinels=cfg.redis.sentinels,
        sentinel_master=cfg.redis.sentinel_master,
        **extra,
    )


async def serve(
    cfg: GatewayConfig,
    reuse_port: bool = False,
    stop: asyncio.Event | None = None,
    freeze_heap: bool = False,
) -> None:
    """Run one gateway process until SIGTERM/SIGINT (or ``stop`` is set).

    ``freeze_heap``: the process is the gateway's own (``run``), so what start-up built can
    leave the collector's view (:func:`_freeze_startup_heap`); not for a caller's process."""
    from aiohttp import web

    from gateway import warmup
    from gateway.server import Gateway, build_app, build_metrics_app

    loop = asyncio.get_running_loop()
    _dump_tasks_on_signal(loop)
    api_socks = _listen_or_exit(cfg.server.host, cfg.server.port, reuse_port)
    metrics_socks = (
        _listen_or_exit(cfg.server.host, cfg.server.metrics_port, reuse_port)
        if cfg.server.metrics_port
        else []
    )
    gw = Gateway(cfg, bus=make_bus(cfg))
    app = build_app(gw)
    warmup.attach(app, gw)  # hot prefixes' warm-ups (gateway/warmup.py)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=log if cfg.log.access_log else None,
        shutdown_timeout=cfg.server.shutdown_grace,
    )
    await runner.setup()
    for sock in api_socks:
        await web.SockSite(runner, sock).start()
    metrics_runner: web.AppRunner | None = None
    if metrics_socks:
        metrics_runner = web.AppRunner(build_metrics_app(gw), access_log=None)
        await metrics_runner.setup()
        for sock in metrics_socks:
            await web.SockSite(metrics_runner, sock).start()
    if freeze_heap:
        _freeze_startup_heap(cfg.server.gc_young_threshold)
    done = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, done.set)
    # one write: under PYTHONUNBUFFERED ``print`` writes the text and its newline apart, and
    # the replicas sharing a log then run their ready lines together
    sys.stdout.write(
        f"kvroute gateway ready on http://{cfg.server.host}:{cfg.server.port} (pid {os.getpid()})\n"
    )
    sys.stdout.flush()
    try:
        await done.wait()
        log.info(
            "draining: no new connections; requests in flight may finish for up to %gs",
            cfg.server.shutdown_grace,
        )
    finally:
        # closes the listening sockets, waits for the handlers up to shutdown_grace, then
        # cancels what is left (aiohttp's graceful shutdown)
        await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()


def _freeze_startup_heap(young_threshold: int) -> None:
    """Take what start-up built (tokenizer tables, compiled templates, the app) out of the
    cyclic collector's view, and set its young threshold for serving (0: leave Python's).

    Those objects live as long as the process; left in the oldest generation, every full
    collection walks them again (a 45-49 ms pause of the event loop on ``bench gateway``'s
    8,000-token chats, 8.5 ms after: docs/benchmarks.md, "Pauses of the event loop").
    Collected first, so no start-up garbage is kept; later objects are collected as usual,
    less often (``server.gc_young_threshold``)."""
    gc.collect()
    gc.freeze()
    if young_threshold:
        gc.set_threshold(young_threshold, *gc.get_threshold()[1:])


def listen(host: str, port: int, reuse_port: bool, backlog: int = 1024) -> list[socket.socket]:
    """Listening sockets for ``host:port``, one per address it resolves to (as asyncio's
    ``create_server`` binds them), bound here rather than by the event loop: uvloop resolves
    even a numeric host on libuv's thread pool, and a start-up must not wait on a thread
    pool's callback to open its port (a gateway was once seen to never reach its ready line
    while its other tasks ran)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:  # its IPv4 twin is a socket of its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def _listen_or_exit(host: str, port: int, reuse_port: bool) -> list[socket.socket]:
    """``listen``, before anything starts: a port that cannot be had ends the process with
    the reason, not a traceback."""
    try:
        return listen(host, port, reuse_port)
    except OSError as exc:
        raise SystemExit(
            f"kvroute gateway: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None


#: the last line of the asyncio tasks' dump (what a harness waits for)
TASKS_END = "-- end of asyncio tasks --"


def _dump_tasks_on_signal(loop: asyncio.AbstractEventLoop) -> None:
    """On ``STACKS_SIGNAL`` also list every asyncio task and where it waits: a start-up
    stuck on an ``await`` shows only the idle loop in the threads' stacks. The threads'
    dump (``faulthandler``) stays chained in front, for a loop blocked by a call that never
    returns, when this handler cannot run."""
    import faulthandler

    from gateway.cli import STACKS_SIGNAL

    def dump() -> None:
        tasks = asyncio.all_tasks(loop)
        print(f"asyncio tasks ({len(tasks)}):", file=sys.stderr)
        for task in tasks:
            print(f"task {task.get_name()}:", file=sys.stderr)
            for line in _awaits(task.get_coro()):
                print(f"  {line}", file=sys.stderr)
        print(TASKS_END, file=sys.stderr, flush=True)

    with contextlib.suppress(NotImplementedError):
        # faulthandler keeps the handler it replaced at its first registration (cli.main):
        # drop it, install the loop's, then chain faulthandler's in front of that one
        faulthandler.unregister(STACKS_SIGNAL)
        loop.add_signal_handler(STACKS_SIGNAL, dump)
        faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=True)


def _awaits(coro: Any) -> list[str]:
    """Where a coroutine waits, outermost first, down its chain of awaited coroutines
    (``Task.print_stack`` shows only the outermost one)."""
    out = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            out.append(f"awaiting {coro!r}")
            break
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out


def _supervise(cfg: GatewayConfig) -> int:
    """Start ``server.workers`` replicas on the port; restart any that dies; stop on signal."""
    metrics_dir = tempfile.mkdtemp(prefix="kvroute-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    # the children get the same arguments minus --workers (and its value)
    cleaned: list[str] = []
    skip = False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--workers":
            skip = True
            continue
        if a.startswith("--workers="):
            continue
        cleaned.append(a)
    argv = cleaned
    if argv and argv[0] == "gateway":
        argv = argv[1:]
    base = [
        sys.executable,
        "-m",
        "gateway.cli",
        "gateway",
        *argv,
        "--set",
        f"server.workers={cfg.server.workers}",
    ]
    procs: dict[int, subprocess.Popen[bytes]] = {}
    stopping = False

    def start(i: int) -> None:
        procs[i] = subprocess.Popen([*base, "--worker-index", str(i)], env=env)

    def stop_all(*_: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs.values():
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    for i in range(cfg.server.workers):
        start(i)
    try:
        while not stopping:
            for i, p in list(procs.items()):
                if p.poll() is not None and not stopping:
                    log.warning("gateway process %d exited with %s; restarting", i, p.returncode)
                    time.sleep(0.5)
                    start(i)
            time.sleep(0.2)
        deadline = time.monotonic() + cfg.server.shutdown_grace + 5
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0
