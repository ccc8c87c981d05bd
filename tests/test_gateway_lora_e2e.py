"""LoRA adapters end to end: sim workers serving adapters + agents + real Redis + gateway.

A request names an adapter as its ``model``; the gateway keys it on the adapter's chain (so
it matches only blocks computed with that adapter) and prefers workers that have the adapter
loaded. Real processes on loopback (``loadtest.stack``), plain HTTP.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from loadtest.stack import ADMIN_KEY, Stack, StackConfig, wait_for

MODEL = "sim-model"
ADAPTERS = ["sql", "chat"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = StackConfig(
        workers=3,
        speedup=20,
        log_dir=tmp_path_factory.mktemp("stack-lora"),
        # every engine serves both adapters, one GPU slot each (vLLM's default --max-loras),
        # a 1 s adapter load (50 ms at this speed-up)
        sim_args=[
            *("--set", f"lora.adapters=[{','.join(ADAPTERS)}]"),
            *("--set", "lora.max_loras=1"),
            *("--set", "lora.load_ms=1000"),
        ],
    )
    with Stack(cfg) as s:
        assert wait_for(lambda: set(ADAPTERS) <= set(models(s)), 20.0) is not None
        yield s


def request(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def models(stack: Stack) -> dict[str, Any]:
    with urllib.request.urlopen(stack.gateway_urls[0] + "/v1/models", timeout=10) as resp:
        return {m["id"]: m.get("parent") for m in json.loads(resp.read())["data"]}


def prompt(seed: int, words: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "rho"]) for _ in range(words))


def complete(stack: Stack, model: str, text: str) -> tuple[str, int, int]:
    """(worker, tokens the gateway predicted cached, tokens the engine reports cached)."""
    status, headers, body = request(
        stack.gateway_urls[0] + "/v1/completions",
        {"model": model, "prompt": text, "max_tokens": 2},
    )
    assert status == 200, body
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return headers["x-kvroute-worker"], int(headers["x-kvroute-matched-tokens"]), cached


def indexed(stack: Stack, worker: str) -> int:
    with urllib.request.urlopen(
        urllib.request.Request(
            stack.gateway_urls[0] + "/debug/index",
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        ),
        timeout=10,
    ) as resp:
        return int(json.loads(resp.read())["workers"].get(worker, {}).get("blocks", 0))


def test_adapters_are_listed_with_their_base_model(stack: Stack) -> None:
    listed = models(stack)
    assert listed[MODEL] is None
    assert {a: listed[a] for a in ADAPTERS} == {"sql": MODEL, "chat": MODEL}


def test_an_adapter_follows_its_cache_and_the_base_model_does_not_see_it(stack: Stack) -> None:
    text = prompt(1)
    first, predicted, cached = complete(stack, "sql", text)
    assert predicted == 0 and cached == 0
    # the agent publishes the adapter's blocks; the gateway's index equals its mirror
    assert wait_for(lambda: indexed(stack, first) > 0 and not stack.diverged(), 10.0) is not None
    again, predicted, cached = complete(stack, "sql", text + " and more")
    assert again == first
    assert cached > 0 and predicted == cached  # the engine reused what the index predicted
    # the same prompt for the base model: the adapter's blocks are not its cache
    _, predicted, cached = complete(stack, MODEL, text)
    assert predicted == 0 and cached == 0


def test_an_adapter_no_worker_has_is_an_openai_404(stack: Stack) -> None:
    status, _, body = request(
        stack.gateway_urls[0] + "/v1/chat/completions",
        {"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 404
    err = body["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "no-such-adapter" in err["message"] and err["type"]


def test_equal_caches_prefer_the_worker_with_the_adapter_loaded(stack: Stack) -> None:
    """Fresh prompts (no cache anywhere) on an idle cluster: every "chat" request after the
    first goes where the first loaded "chat", rather than paying an adapter load elsewhere.

    Each request waits until the gateway has every worker's load report from after the
    previous one ended: a report scraped while a request ran shows its worker busy for one
    report period, which rightly sends the next request elsewhere (not what this tests)."""
    workers = []
    for i in range(6):
        workers.append(complete(stack, "chat", prompt(100 + i, 40))[0])
        ended = time.time()
        assert wait_for(lambda t=ended: idle_since(stack, t), 10.0) is not None
    assert len(set(workers)) == 1, workers
    status, listing = get_json(stack.gateway_urls[0] + "/workers", ADMIN_KEY)
    assert status == 200
    shown = {w["worker_id"]: w for w in listing["workers"]}
    assert shown[workers[0]]["adapters"] == ["chat", "sql"]
    assert "chat" in shown[workers[0]]["adapters_loaded"]


def idle_since(stack: Stack, ended: float) -> bool:
    """Every worker idle in the gateway's view, by engine reports taken after ``ended``."""
    _, listing = get_json(stack.gateway_urls[0] + "/workers", ADMIN_KEY)
    return all(
        w["inflight"] == 0
        and (rep := w["engine_report"]) is not None
        and rep["ts"] > ended
        and rep["running"] == rep["waiting"] == 0
        for w in listing["workers"]
    )


def get_json(url: str, token: str) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, json.loads(resp.read())


def test_a_worker_whose_slot_another_adapters_stream_holds_is_left_out(stack: Stack) -> None:
    """Every engine keeps one adapter loaded at once (``max_loras=1``) and reports it. While a
    "sql" stream runs on the only worker holding two "chat" prompts, vLLM would keep a
    "chat" request there waiting for the stream to end: the gateway sends "chat" elsewhere,
    whatever that worker's cache, and sends it back there once the stream has ended."""
    home, url = stack.worker_id(0), stack.worker_urls[0]
    text, other, sql = prompt(7, 6000), prompt(9, 400), prompt(11, 6000)
    for model, seeded in (("chat", text), ("chat", other), ("sql", sql)):
        status, _, body = request(url + "/v1/completions", {"model": model, "prompt": seeded})
        assert status == 200, body  # straight to the engine: only ``home`` holds them

    def known() -> bool:
        chat, sqlr = route(stack, "chat", text), route(stack, "sql", sql)
        return chat["worker"] == sqlr["worker"] == home and chat["matched_tokens"] > 0

    assert wait_for(known, 10.0) is not None, json.dumps(
        [route(stack, "chat", text), route(stack, "sql", sql)]
    )
    ended = time.time()
    assert wait_for(lambda: idle_since(stack, ended), 10.0) is not None
    stream = open_stream(stack, "sql", sql + " and then")
    try:
        assert stream.headers["x-kvroute-worker"] == home  # drawn by its cache
        assert stream.read(1)  # the stream runs: its adapter holds home's one slot
        for _ in range(3):
            assert route(stack, "chat", text)["worker"] != home
        assert complete(stack, "chat", other)[0] != home
        assert route(stack, "sql", sql)["worker"] == home  # sql's requests share its slot
    finally:
        stream.close()  # the gateway ends it upstream: the slot frees
    assert wait_for(lambda: _inflight(stack, home) == 0, 10.0) is not None
    back = route(stack, "chat", text)
    assert back["worker"] == home and back["matched_tokens"] > 0, json.dumps(back)


def open_stream(stack: Stack, model: str, text: str) -> Any:
    """A streamed completion long enough to outlast the test's requests, opened, not read."""
    req = urllib.request.Request(
        stack.gateway_urls[0] + "/v1/completions",
        data=json.dumps(
            {"model": model, "prompt": text, "max_tokens": 4000, "stream": True}
        ).encode(),
        headers={"content-type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=30)


def route(stack: Stack, model: str, text: str) -> Any:
    """The gateway's decision for a completion of ``text`` (``/debug/route``, a dry run)."""
    req = urllib.request.Request(
        stack.gateway_urls[0] + "/debug/route",
        data=json.dumps({"model": model, "prompt": text, "max_tokens": 2}).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {ADMIN_KEY}"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _inflight(stack: Stack, worker: str) -> int:
    _, listing = get_json(stack.gateway_urls[0] + "/workers", ADMIN_KEY)
    return next(w["inflight"] for w in listing["workers"] if w["worker_id"] == worker)
