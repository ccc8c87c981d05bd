"""Peer routers run side by side with kvroute on the same sim workers (the bench extra).

``sglang-router`` (Rust, PyPI ``sglang-router``) is started with ``launch --worker-urls ...
--policy cache_aware|round_robin|power_of_two``; it probes the workers' ``/health`` and
``/server_info``, which the engine simulator answers.
"""

from __future__ import annotations

import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from loadtest.harness import ChildProcess, HarnessError, free_port, wait_for_port

__all__ = ["sglang_router", "sglang_router_binary"]


def sglang_router_binary() -> str:
    """Path of the ``sglang-router`` command (next to this interpreter first)."""
    local = Path(sys.executable).with_name("sglang-router")
    if local.exists():
        return str(local)
    found = shutil.which("sglang-router")
    if found is None:
        raise HarnessError("sglang-router is not installed (pip install 'kvroute[bench]')")
    return found


def sglang_router(
    worker_urls: list[str], policy: str, log_dir: Path, name: str = ""
) -> tuple[ChildProcess, str]:
    """A started sglang-router process (not yet waited for) and its base URL."""
    port, metrics = free_port(), free_port()
    args = [
        sglang_router_binary(), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
        "--log-level", "warn", "--worker-urls", *worker_urls,
    ]  # fmt: skip
    return ChildProcess(args, name or f"sglang-{policy}", log_dir), f"http://127.0.0.1:{port}"


def wait_router_ready(proc: ChildProcess, url: str, workers: int, timeout: float = 60.0) -> None:
    """Until the router listens and has every worker in its pool."""
    port = int(url.rsplit(":", 1)[1])
    wait_for_port(port, timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise HarnessError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200 and _workers_known(url) >= workers:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise HarnessError(f"{proc.name} not ready in {timeout}s:\n{proc.tail()}")


def _workers_known(url: str) -> int:
    import json

    for path in ("/workers", "/list_workers"):
        try:
            with urllib.request.urlopen(url + path, timeout=2) as resp:
                data = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            continue
        if isinstance(data, dict):
            for key in ("workers", "urls"):
                if isinstance(data.get(key), list):
                    return len(data[key])
            if isinstance(data.get("total"), int):
                return int(data["total"])
        if isinstance(data, list):
            return len(data)
    return 10**9  # cannot tell: health is all we have
