"""``kvroute agent``: settings from file < env < flags, and the real process end to end."""

from __future__ import annotations

import argparse
import asyncio
import signal
import urllib.request
from pathlib import Path

import pytest
import redis
from agent_helpers import FakeEngine, drive, running_consumer, wait_until

from gateway.contract.settings import ConfigError
from gateway.contract.wire import RedisLayout
from loadtest.harness import ChildProcess, RedisServer, free_port
from worker_agent.cli import add_arguments, build_config


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_settings_precedence(tmp_path: Path) -> None:
    cfg_file = tmp_path / "agent.yaml"
    cfg_file.write_text(
        "worker_id: from-file\nmodel: m\nblock_size: 32\nredis:\n  url: redis://file:1/0\n"
        "publish:\n  snapshot_interval: 7\n"
    )
    env = {"KVROUTE_AGENT_BLOCK_SIZE": "64", "KVROUTE_AGENT_REDIS__URL": "redis://env:2/0"}
    args = parse(
        ["--config", str(cfg_file), "--redis", "rediss://:pw@flag:3/0", "--dp-size", "2",
         "--label", "zone=a", "--set", "publish.max_entry_keys=99", "--engine", "sglang"]
    )  # fmt: skip
    cfg = build_config(args, env)
    assert cfg.worker_id == "from-file" and cfg.block_size == 64
    assert cfg.redis.url == "rediss://:pw@flag:3/0"
    assert cfg.engine.dp_size == 2 and cfg.engine.kind == "sglang"
    assert cfg.labels == {"zone": "a"}
    assert cfg.publish.snapshot_interval == 7 and cfg.publish.max_entry_keys == 99


def test_bad_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="worker_id"):
        build_config(parse(["--model", "m"]), {})
    with pytest.raises(ConfigError, match=r"engine\.kind"):
        build_config(parse(["--model", "m", "--worker-id", "w", "--engine", "trt"]), {})
    with pytest.raises(ConfigError, match="nope"):
        build_config(parse(["--model", "m", "--worker-id", "w", "--set", "nope=1"]), {})


async def test_agent_process_runs_and_deregisters_on_sigterm(
    redis_server: RedisServer, logs: Path
) -> None:
    engine = FakeEngine("vllm-0.23")
    metrics_port = free_port()
    proc = ChildProcess.kvroute(
        ["agent", "--engine", "vllm", "--engine-url", "http://127.0.0.1:9", "--worker-id", "cli1",
         "--model", "m", "--events", engine.events_url, "--replay", engine.replay_url,
         "--metrics-port", str(metrics_port), "--set", "heartbeat_interval=0.2"],
        "agent",
        logs,
        env={"KVROUTE_AGENT_REDIS__URL": redis_server.url},
    )  # fmt: skip
    try:
        async with running_consumer(redis_server.url) as consumer:
            proc.start()
            await wait_until(lambda: "cli1" in consumer.workers(), 20, "registration")
            await drive(engine, 5)
            await wait_until(lambda: len(consumer.index.worker_keys("cli1")) > 0, 10, "keys")
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read())
            assert b"kvroute_agent_frames_received_total" in body
            proc.signal(signal.SIGTERM)
            await wait_until(lambda: not proc.alive(), 10, "exit")
            assert proc.proc is not None and proc.proc.returncode == 0
            assert not redis.Redis.from_url(redis_server.url).exists(RedisLayout().worker("cli1"))
            await wait_until(lambda: "cli1" not in consumer.workers(), 5, "gone")
    finally:
        proc.stop()
        await engine.close()
