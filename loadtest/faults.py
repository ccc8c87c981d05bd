"""Fault injection against the real system: one scenario per fault, each bounded in time.

Every scenario runs on a live stack (Redis, sim workers, agents, gateway) under a steady
background load, injects one fault, lets the system recover, and reports:

* ``requests`` / ``failed``: client requests sent during the scenario and those that failed
  and should not have (a stream already under way when its worker dies is allowed to end
  with an error event; it is counted as ``broken_streams``, not as failed);
* ``lost``: workers whose shadow-index entry differs from their agent's mirror after
  recovery (compared by key digest, exactly);
* ``recovery_s``: from the end of the fault to the index equal to the mirrors again (or the
  scenario's own recovery condition).

Used by ``kvroute bench faults`` (docs/reliability.md) and by the tests.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from loadtest.driver import DriverConfig, RequestRecord, run_load
from loadtest.stack import Stack, wait_for
from loadtest.workloads import ChatWorkload, WorkItem

__all__ = ["FAULTS", "FaultResult", "failed_attempts", "run_fault"]


@dataclass
class FaultResult:
    fault: str
    injected: str
    requests: int = 0
    failed: int = 0
    broken_streams: int = 0
    lost: int = 0
    recovery_s: float | None = None
    ok: bool = False
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def clean(self) -> bool:
        """No client request failed that should not have, and nothing diverged."""
        return self.failed == 0 and self.lost == 0

    def recovered_within(self, seconds: float) -> bool:
        return self.recovery_s is not None and self.recovery_s <= seconds


class BackgroundLoad:
    """Chat traffic at ``rate`` req/s for ``seconds``, in its own thread and event loop."""

    def __init__(
        self, stack: Stack, rate: float, seconds: float, max_tokens: int = 16, seed: int = 3
    ) -> None:
        turns = 4.0
        wl = ChatWorkload(
            conversations=int(rate * seconds / turns) + 5,
            turns=(3, 5),
            system_prompts=4,
            system_tokens=400,
            user_tokens=(20, 80),
            assistant_tokens=(max_tokens, max_tokens),
            think_time=1.0,
            rate=rate / turns,
            seed=seed,
        )
        self.items: list[WorkItem] = [it for it in wl.items() if it.at <= seconds]
        self.cfg = DriverConfig(
            stack.gateway_urls[0],
            stack.config.model,
            "chat",
            max_duration=seconds,
            drain_timeout=60.0,
            request_timeout=60.0,
            progress=False,
        )
        self.records: list[RequestRecord] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = 0.0

    def _run(self) -> None:
        result = asyncio.run(run_load(self.items, self.cfg))
        self.records = result.records

    def __enter__(self) -> BackgroundLoad:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(timeout=180)

    def at(self, t: float) -> None:
        """Sleep until ``t`` seconds after the load started (scenario timeline)."""
        time.sleep(max(0.0, self.t0 + t - time.monotonic()))

    def tally(self, result: FaultResult) -> None:
        sent = [r for r in self.records if r.error != "not sent: beyond max_duration"]
        result.requests = len(sent)
        for r in sent:
            if r.ok:
                continue
            if r.ttft is not None:  # the stream had started: it must end with an error event
                result.broken_streams += 1
                if not (r.error or "").startswith("stream error"):
                    result.failed += 1  # ... and not with a hang or a cut connection
            else:
                result.failed += 1
        result.detail["errors"] = sorted({(r.error or "")[:120] for r in sent if not r.ok})[:5]


def _busiest(stack: Stack) -> int:
    """The worker with the most requests in flight, then the most indexed blocks: a fault
    aimed there meets traffic and state (a fault on an idle worker proves nothing)."""
    ws = stack.workers()
    best = max(ws, key=lambda w: (w["inflight"], w["index_blocks"]))
    return int(best["worker_id"].rsplit("-", 1)[1])


def _converged(stack: Stack) -> bool:
    return not stack.diverged()


def _settle(stack: Stack, result: FaultResult, since: float, timeout: float = 30.0) -> None:
    """Record recovery time (from ``since``) and what still diverges after ``timeout``."""
    took = wait_for(lambda: _converged(stack), timeout)
    result.recovery_s = None if took is None else round(time.monotonic() - since, 2)
    result.lost = len(stack.diverged()) if took is None else 0


def _gateway_counter(stack: Stack, name: str, worker: str, **labels: str) -> float:
    """Sum of a gateway counter's samples for ``worker`` (and ``labels``)."""
    with urllib.request.urlopen(stack.gateway_urls[0] + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    want = [f'worker="{worker}"', *(f'{k}="{v}"' for k, v in labels.items())]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


#: the gateway's log line for an attempt on a worker that failed before the client saw a byte
#: (the logging format of ``kvroute gateway``: "%(asctime)s %(levelname)s %(name)s: ...")
_RETRY_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+: retrying request away from (\S+?): "
)


def failed_attempts(stack: Stack, worker: str, gateway: int = 0) -> list[float]:
    """Wall-clock times (``time.time()``, to the millisecond) at which gateway ``gateway``
    gave up an attempt on ``worker`` and retried elsewhere: one per attempt, from its log.
    The same attempts as ``kvroute_retries_total{worker=...}``, but each with its time."""
    out = []
    for line in stack.gateways[gateway].log_lines():
        m = _RETRY_LINE.match(line)
        if m is not None and m.group(2) == worker:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def _agent_counter(stack: Stack, i: int, prefix: str) -> float:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{stack.agent_ports[i]}/metrics", timeout=10
    ) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


# -- scenarios ------------------------------------------------------------------------------------


def redis_outage(stack: Stack, outage_s: float = 30.0, rate: float = 4.0) -> FaultResult:
    """R1: Redis killed under load for ``outage_s``, then restarted."""
    assert stack.redis is not None
    res = FaultResult(
        "redis_outage", f"redis-server SIGKILL for {outage_s:g}s under {rate:g} req/s"
    )
    with BackgroundLoad(stack, rate, outage_s + 20.0) as load:
        load.at(5.0)
        stack.redis.kill()
        load.at(5.0 + outage_s)
        stack.redis.start()
        back = time.monotonic()
        _settle(stack, res, back)
    load.tally(res)
    res.ok = res.clean and res.recovered_within(5.0)
    return res


def agent_restart(stack: Stack, rate: float = 4.0) -> FaultResult:
    """R2: an agent killed (SIGKILL) and started again: new epoch, stale entries dropped."""
    res = FaultResult("agent_restart", "the busiest worker's agent SIGKILL, restarted 2s later")
    with BackgroundLoad(stack, rate, 20.0) as load:
        load.at(5.0)
        worker = _busiest(stack)
        stack.agents[worker].kill()
        load.at(7.0)
        stack.start_agent(worker)
        back = time.monotonic()
        _settle(stack, res, back)
    load.tally(res)
    res.ok = res.clean and res.recovered_within(5.0)
    return res


def engine_restart(stack: Stack, rate: float = 4.0) -> FaultResult:
    """R2: the engine restarts (sequence back to 0, cache empty): stale entries gone in 2s."""
    res = FaultResult(
        "engine_restart", "the busiest worker's engine restarts (sequence reset, empty cache)"
    )
    with BackgroundLoad(stack, rate, 20.0) as load:
        load.at(6.0)
        worker = _busiest(stack)
        wid = stack.worker_id(worker)
        old = stack.index().get(wid, {}).get("blocks", 0)
        stack.restart_engine(worker)
        t = time.monotonic()
        # every pre-restart block must leave the index; the fresh engine's new blocks may
        # arrive meanwhile, so "gone" is the first moment the count fell below the old one
        # and the entry equals the agent's mirror of the fresh engine
        gone = wait_for(
            lambda: stack.index().get(wid, {}).get("blocks", 0) < old and not stack.diverged(), 10.0
        )
        res.detail.update(
            worker=wid, blocks_before=old, stale_gone_s=None if gone is None else round(gone, 2)
        )
        _settle(stack, res, t)
    load.tally(res)
    res.ok = res.clean and old > 0 and gone is not None and gone <= 2.0
    return res


def dropped_batches(stack: Stack, count: int = 5, rate: float = 4.0) -> FaultResult:
    """R2: event batches lost on the wire (a sequence gap): replay, then exact convergence."""
    res = FaultResult("dropped_batches", f"the busiest worker drops its next {count} event batches")
    with BackgroundLoad(stack, rate, 15.0) as load:
        load.at(4.0)
        worker = _busiest(stack)
        stack.fault(worker, "drop_events", count=count)
        load.at(10.0)
        _settle(stack, res, time.monotonic())
    load.tally(res)
    res.detail["agent_replays"] = _agent_counter(stack, worker, "kvroute_agent_replays_total")
    res.detail["agent_gaps"] = _agent_counter(stack, worker, "kvroute_agent_sequence_gaps_total")
    res.ok = res.clean and res.detail["agent_gaps"] > 0
    return res


def worker_killed(stack: Stack, rate: float = 6.0, observe_s: float = 10.0) -> FaultResult:
    """R3: a worker's engine process is SIGKILLed mid-load. Requests without a first byte are
    retried elsewhere, streams under way end with an error event, and from 1 s after the
    death is observable (process reaped, its port refusing connections) until the worker is
    restarted, the gateway sends it nothing.

    The worker runs in a simulator process of its own (one is added to the stack if it has
    none), so the fault is a real process dying, not a simulated one. Sends to it are counted
    two ways: ``kvroute_retries_total`` for the worker (every attempt on a dead worker fails
    and is retried), sampled at death + 1 s and at the restart; and the gateway's log line
    for each such attempt, with its time, which must agree with the counter."""
    res = FaultResult(
        "worker_killed",
        f"a worker's own simulator process SIGKILLed under load, restarted after {observe_s:g}s",
    )
    worker = min(stack.solo) if stack.solo else stack.add_worker()
    wid = stack.worker_id(worker)
    with BackgroundLoad(stack, rate, observe_s + 14.0, max_tokens=600) as load:  # long streams
        load.at(5.0)
        inflight = 0

        def busy() -> bool:  # a kill on an idle worker would prove little: wait for traffic
            nonlocal inflight
            inflight = next(w["inflight"] for w in stack.workers() if w["worker_id"] == wid)
            return inflight > 0

        wait_for(busy, 5.0)
        dead, dead_wall = stack.kill_worker(worker)
        # the 1 s is the thing under test: sample the gateway's count at exactly that time
        time.sleep(max(0.0, dead + 1.0 - time.monotonic()))
        at_1s = _gateway_counter(stack, "kvroute_retries_total", wid)
        time.sleep(max(0.0, dead + observe_s - time.monotonic()))
        before_restart = _gateway_counter(stack, "kvroute_retries_total", wid)
        times = [round(t - dead_wall, 3) for t in failed_attempts(stack, wid)]
        restart_at = time.monotonic()
        stack.restart_worker(worker)
        _settle(stack, res, time.monotonic())
    load.tally(res)
    # client side: requests sent from death + 1 s until the restart (send times are known
    # relative to the driver's start, which is at most a little after ``load.t0``: the
    # window is taken slightly inside)
    window = [
        r
        for r in load.records
        if r.error != "not sent: beyond max_duration"
        and dead + 1.0 <= load.t0 + r.sent < restart_at - 0.5
    ]
    res.detail.update(
        worker=wid,
        inflight_at_kill=inflight,
        # every failed attempt on the worker, in seconds from its death (in-flight requests
        # reset by the kill show up a few ms before the death was confirmed)
        attempt_times_s=times[:20],
        attempts_after_1s=before_restart - at_1s,
        logged_after_1s=len([t for t in times if t >= 1.0 - 0.001]),  # (the log has ms)
        log_matches_counter=len(times) == before_restart,
        requests_after_1s=len(window),
        served_by_dead_after_1s=sum(1 for r in window if r.worker == wid),
        failed_after_1s=sum(1 for r in window if not r.ok),
    )
    d = res.detail
    res.ok = (
        res.clean
        and inflight > 0
        and d["attempts_after_1s"] == 0
        and d["logged_after_1s"] == 0
        and d["log_matches_counter"]
        and d["requests_after_1s"] > 0
        and d["served_by_dead_after_1s"] == 0
        and d["failed_after_1s"] == 0
    )
    return res


def stuck_worker(stack: Stack, rate: float = 4.0) -> FaultResult:
    """A worker that accepts requests but never answers: first-byte timeouts retry them
    elsewhere and the circuit breaker isolates it. Run with the gateway's
    ``proxy.first_byte_timeout`` short (2s) so the scenario stays short."""
    res = FaultResult("stuck_worker", "the busiest worker paused (accepts, never answers) for 10s")
    with BackgroundLoad(stack, rate, 20.0) as load:
        load.at(4.0)
        worker = _busiest(stack)
        wid = stack.worker_id(worker)
        stack.fault(worker, "pause")
        load.at(14.0)
        res.detail.update(
            worker=wid,
            timed_out=_gateway_counter(
                stack, "kvroute_retries_total", wid, cause="first_byte_timeout"
            ),
        )
        circuit = next(w["circuit"] for w in stack.workers() if w["worker_id"] == wid)
        res.detail["circuit_during"] = circuit
        stack.fault(worker, "resume")
        _settle(stack, res, time.monotonic())
    load.tally(res)
    res.ok = res.clean and res.detail["timed_out"] > 0 and circuit != "closed"
    return res


def bad_events(stack: Stack, rate: float = 3.0) -> FaultResult:
    """R5: garbage frames, wrong types, unknown fields and parents, huge batches: counted,
    skipped, nothing crashes, and the index still equals the mirrors."""
    from loadtest.enginesim.worker import GARBAGE_KINDS

    res = FaultResult("bad_events", f"the busiest worker publishes {', '.join(GARBAGE_KINDS)}")
    with BackgroundLoad(stack, rate, 15.0) as load:
        load.at(3.0)
        worker = _busiest(stack)
        for kind in GARBAGE_KINDS:
            stack.fault(worker, "garbage", kind=kind)
        load.at(8.0)
        _settle(stack, res, time.monotonic())
    load.tally(res)
    res.detail["agent_bad_events"] = _agent_counter(stack, worker, "kvroute_agent_events_bad_total")
    res.detail["agent_alive"] = stack.agents[worker].alive()
    res.detail["gateway_alive"] = stack.gateways[0].alive()
    res.ok = (
        res.clean
        and res.detail["agent_alive"]
        and res.detail["gateway_alive"]
        and res.detail["agent_bad_events"] > 0
    )
    return res


FAULTS: dict[str, Callable[..., FaultResult]] = {
    "redis_outage": redis_outage,
    "agent_restart": agent_restart,
    "engine_restart": engine_restart,
    "dropped_batches": dropped_batches,
    "worker_killed": worker_killed,
    "stuck_worker": stuck_worker,
    "bad_events": bad_events,
}


def run_fault(name: str, stack: Stack, **params: Any) -> FaultResult:
    try:
        return FAULTS[name](stack, **params)
    except KeyError:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}") from None


def summary(results: list[FaultResult]) -> dict[str, Any]:
    return {
        "faults": [r.to_json() for r in results],
        "failed_requests": sum(r.failed for r in results),
        "lost": sum(r.lost for r in results),
        "ok": all(r.ok for r in results),
    }
