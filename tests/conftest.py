"""Shared fixtures: a private redis-server per test (killable), temporary log folders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.harness import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server on a free loopback port; tests may kill() and start() it."""
    server = RedisServer(workdir=tmp_path / "redis")
    server.workdir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    """Folder for child-process logs (kept by pytest on failure for inspection)."""
    d = tmp_path / "logs"
    d.mkdir()
    return d
