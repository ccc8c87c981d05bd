"""The load driver's accounting of requests the run's end cuts off."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from loadtest.driver import CUT, DriverConfig, run_load
from loadtest.harness import free_port
from loadtest.workloads import Segment, WorkItem


async def test_a_request_cut_after_its_first_token_keeps_its_ttft() -> None:
    """Past capacity a run ends with requests still running. One cut after its first token
    has a measured TTFT: the TTFT figures and goodput count it (a system whose slow requests
    are still running at the cut is not credited with dropping them from its percentiles),
    while it stays failed and out of the completed requests' figures. One cut before its
    first token has no TTFT and counts against goodput."""
    release = asyncio.Event()

    async def completion(request: web.Request) -> web.StreamResponse:
        prompt = (await request.json())["prompt"]
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        token = {"choices": [{"index": 0, "text": "t", "finish_reason": None}]}
        if prompt != "never":
            await resp.write(b"data: " + json.dumps(token).encode() + b"\n\n")
        if prompt != "fast":  # held until the driver's cut closes the connection
            try:
                await asyncio.wait_for(release.wait(), 20.0)
            except TimeoutError:
                pass
            return resp
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode())
        await resp.write(b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    items = [
        WorkItem(i, 0.0, f"s{i}", [Segment(p, "text", p)], max_tokens=4)
        for i, p in enumerate(["fast", "first-then-held", "never"])
    ]
    cfg = DriverConfig(
        base_url=f"http://127.0.0.1:{port}",
        model="m",
        max_duration=1.0,
        drain_timeout=1.0,
        slo_ttft_ms=10_000,
        progress=False,
    )
    try:
        result = await run_load(items, cfg)
    finally:
        release.set()
        await runner.cleanup()
    fast, held, never = result.records
    assert fast.ok and fast.timed
    assert held.error == CUT and held.ttft is not None and held.timed and not held.ok
    assert never.error == CUT and never.ttft is None and not never.timed
    s = result.summary
    assert s["failed"] == 2 and s["ok"] == 1
    assert s["ttft_mean_ms"] == round((fast.ttft + held.ttft) / 2 * 1000, 2)
    assert s["goodput"] == round(2 / 3, 4)  # both first tokens within 10 s; "never" had none
    assert s["e2e_p50_ms"] == round(fast.e2e * 1000, 2)  # completed requests only
