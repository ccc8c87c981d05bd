"""Warm-ups end to end: Redis + sim workers + agents + gateway, real processes on loopback.

A prefix in steady demand warrants a second holder: the gateway sends that worker a
one-token warm-up carrying the prefix (off the request path, counted in its metrics), and the
requests that then go to the warmed worker find the prefix in its cache: none pays the cold
prefill there.
"""

from __future__ import annotations

import json
import random
import re
import urllib.request
from collections.abc import Iterator

import pytest

from loadtest.stack import Stack, StackConfig, wait_for

MODEL = "sim-model"
PREFIX_TOKENS = 1024


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = StackConfig(
        workers=2,
        speedup=20,
        log_dir=tmp_path_factory.mktemp("warmup"),
        # a small prefix at a test's rate: headroom so that it warrants both workers
        policy_params={"min_requests": 2, "replication": 200.0},
    )
    with Stack(cfg) as s:
        yield s


def complete(url: str, ids: list[int]) -> tuple[str, int, int]:
    """(worker, prompt tokens, cached tokens) of one completion of token ids."""
    body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        worker = resp.headers["x-kvroute-worker"]
        usage = json.loads(resp.read())["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return worker, usage["prompt_tokens"], cached


def metric(url: str, name: str) -> dict[str, float]:
    """worker -> value of a counter with a ``worker`` label."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{name}_total{{([^}}]*)}} (\S+)$", text, re.M):
        worker = re.search(r'worker="([^"]*)"', m.group(1))
        if worker:
            out[worker.group(1)] = out.get(worker.group(1), 0.0) + float(m.group(2))
    return out


def test_a_hot_prefix_is_warmed_then_served_from_cache(stack: Stack) -> None:
    url = stack.gateway_urls[0]
    rng = random.Random(3)
    prefix = [rng.randrange(1000, 20_000) for _ in range(PREFIX_TOKENS)]
    served: list[tuple[str, int, int]] = []

    def one() -> bool:
        served.append(complete(url, prefix + [rng.randrange(1000, 20_000) for _ in range(24)]))
        return bool(metric(url, "kvroute_warmups_sent"))

    assert wait_for(one, 30, step=0.0) is not None, served
    sent = metric(url, "kvroute_warmups_sent")
    assert len(sent) == 1 and sum(sent.values()) == 1, sent  # one warm-up, one new holder
    (warmed,) = sent
    assert metric(url, "kvroute_warmup_tokens") == {warmed: float(PREFIX_TOKENS)}
    first = served[0][0]
    assert warmed != first  # the second worker, not the first holder
    assert all(w == first for w, _, _ in served[:-1])  # no real request sent there cold
    # traffic then spills onto the warmed worker, every request with the prefix cached
    after: list[tuple[str, int, int]] = []

    def spilled() -> bool:
        after.append(complete(url, prefix + [rng.randrange(1000, 20_000) for _ in range(24)]))
        return sum(w == warmed for w, _, _ in after) >= 3

    assert wait_for(spilled, 30, step=0.0) is not None, after
    block = 16
    for w, prompt, cached in after:
        if w == warmed:
            assert cached >= PREFIX_TOKENS // block * block - block, (w, prompt, cached)
    assert not metric(url, "kvroute_warmups_failed")
