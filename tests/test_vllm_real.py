"""Real vLLM (the CPU build, random weights) in the loop: Redis + two vLLM engines + agents +
gateway, real processes on loopback.

What is checked is the engine contract kvroute depends on, against vLLM itself:

* the gateway's index equals, per worker and by key digest, the canonical keys of the blocks
  vLLM's own KV events say it holds (replayed from the engine's replay socket and folded by
  a plain model here), through stores, evictions and a prefix-cache reset;
* for every request the gateway's predicted cached tokens equal vLLM's
  ``usage.prompt_tokens_details.cached_tokens``, before and after eviction, and follow-up
  turns land on the worker that holds their conversation;
* the gateway's token ids equal vLLM's ``/tokenize`` for chats with tools, content parts,
  special-token text and CJK/emoji, under every bundled chat template;
* load comes from vLLM's real ``/metrics``; an agent restart and an engine restart recover
  exactly; the openai SDK streams and non-streams through the gateway.

The engines need ``scripts/install-vllm`` (run by ``scripts/setup``); they take a minute or two
to start on this machine, so one stack serves the whole module.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import zmq

from gateway.contract.wire import key_digest
from gateway.routing.keys import BlockKeyer
from gateway.tokenization import TEMPLATES_DIR, Tokenizer, bundled_templates
from loadtest.enginesim.config import CacheConfig, SchedulerConfig
from loadtest.enginesim.scheduler import EngineCore
from loadtest.enginesim.timing import timing_model
from loadtest.harness import ChildProcess, post_json
from loadtest.stack import Stack, StackConfig, port_block, wait_for
from worker_agent.engines.decode import AllCleared, BlockRemoved, BlockStored, decode_batch

pytestmark = pytest.mark.slow

MODEL = "vllm-cpu-model"
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
ENGINE_BLOCKS = 64  # 32-token blocks per engine: a few conversations fill it


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = StackConfig(
        workers=2,
        engine="vllm-cpu",
        model=MODEL,
        vllm_blocks=ENGINE_BLOCKS,
        max_model_len=2048,
        log_dir=tmp_path_factory.mktemp("vllm-stack"),
        start_timeout=600,
        # no torch.compile: the same engine, started in a fraction of the time; nothing here
        # is about its speed
        vllm_args=["--enforce-eager"],
    )
    with Stack(cfg) as s:
        yield s


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="none", max_retries=0)


def engine_keys(replay_endpoint: str, keyer: BlockKeyer) -> set[int]:
    """The canonical keys of the blocks an engine holds, from its own KV events.

    The whole history is replayed from seq 0 (the replay buffer holds it in a test this
    short) and folded by a plain model: engine hash -> (parent, tokens); a block's keys are
    those of its full token prefix that end inside it."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    blocks: dict[Any, tuple[Any, list[int]]] = {}
    try:
        sock.connect(replay_endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            frames = sock.recv_multipart()
            seq, payload = frames[-2], frames[-1]
            if seq == b"\xff" * 8 or not payload:
                break
            for ev in decode_batch(payload).events:
                if isinstance(ev, AllCleared):
                    blocks.clear()
                elif isinstance(ev, BlockRemoved):
                    for h in ev.hashes:
                        blocks.pop(h, None)
                elif isinstance(ev, BlockStored):
                    parent = ev.parent
                    for i, h in enumerate(ev.hashes):
                        toks = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
                        blocks[h] = (parent, toks)
                        parent = h
    finally:
        sock.close(linger=0)
        ctx.term()
    keys: set[int] = set()
    for h in blocks:
        chain: list[list[int]] = []
        cur: Any = h
        while cur is not None and cur in blocks:
            parent, toks = blocks[cur]
            chain.append(toks)
            cur = parent
        if cur is not None:  # an ancestor is gone: the engine cannot serve this block
            continue
        prefix = [t for toks in reversed(chain) for t in toks]
        n_own = len(chain[0]) // keyer.block_size
        keys.update(keyer.keys(prefix)[-n_own:])
    return keys


def agent_removed(stack: Stack, i: int) -> float:
    """Canonical keys agent ``i`` published as removed (from its /metrics)."""
    url = f"http://127.0.0.1:{stack.agent_ports[i]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith('kvroute_agent_canonical_blocks_total{op="removed"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def index_matches_engines(stack: Stack) -> bool:
    keyer = BlockKeyer(stack.config.hash_seed, stack.config.block_size)
    index = stack.index()
    for i in range(stack.config.workers):
        want = key_digest(engine_keys(stack.engines[i].replay_endpoint, keyer))
        got = index.get(stack.worker_id(i), {}).get("digest", key_digest(()))
        if got != want:
            return False
    return True


def idle(stack: Stack) -> bool:
    """The gateway sees every worker idle and trusted (nothing in flight, its engine's last
    report empty), so a decision depends on the index alone: on a loaded CPU a stale report
    of the previous request would otherwise tip a follow-up elsewhere."""
    for w in stack.workers():
        rep = w["engine_report"] or {}
        if w["inflight"] or w["load"]["running"] or w["load"]["queued_prefill_tokens"]:
            return False
        if rep.get("running") or rep.get("waiting") or not w["trusted"]:
            return False
    return True


def converge(stack: Stack) -> None:
    assert wait_for(lambda: index_matches_engines(stack), 30) is not None, (
        stack.index(),
        [stack.mirror(i) for i in range(stack.config.workers)],
    )
    assert wait_for(lambda: idle(stack), 30) is not None, stack.workers()


def chat_turns(
    stack: Stack, rng: random.Random, conversations: int, turns: int, system_words: int
) -> list[tuple[str, int, int, int, int]]:
    """(worker, conversation, predicted, reported cached, prompt tokens) per request."""
    c = client(stack)
    chats = [[{"role": "system", "content": text(rng, system_words)}] for _ in range(conversations)]
    rows = []
    for _ in range(turns):
        for n, msgs in enumerate(chats):
            msgs.append({"role": "user", "content": text(rng, rng.randint(10, 40))})
            converge(stack)
            r = c.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=msgs,  # type: ignore[arg-type]
                max_tokens=4,
                temperature=0,
            )
            comp = r.parse()
            assert comp.usage and comp.usage.prompt_tokens_details
            rows.append(
                (
                    r.headers["x-kvroute-worker"],
                    n,
                    int(r.headers["x-kvroute-matched-tokens"]),
                    comp.usage.prompt_tokens_details.cached_tokens or 0,
                    comp.usage.prompt_tokens,
                )
            )
            msgs.append({"role": "assistant", "content": comp.choices[0].message.content or ""})
    return rows


def test_predicted_reuse_equals_vllms_and_follow_ups_stay(stack: Stack) -> None:
    rng = random.Random(1)
    rows = chat_turns(stack, rng, conversations=3, turns=3, system_words=120)
    assert [r[2] for r in rows] == [r[3] for r in rows], rows
    assert sum(r[3] for r in rows) > 0
    for n in range(3):  # a conversation stays where its prefix is
        assert len({r[0] for r in rows if r[1] == n}) == 1, rows
    converge(stack)


def test_eviction_keeps_index_and_predictions_exact(stack: Stack) -> None:
    """Enough new conversations to overflow both engines' 64-block pools."""
    rng = random.Random(2)
    before = sum(agent_removed(stack, i) for i in range(stack.config.workers))
    rows = chat_turns(stack, rng, conversations=8, turns=2, system_words=700)
    after = sum(agent_removed(stack, i) for i in range(stack.config.workers))
    assert after > before, "no eviction happened"
    assert [r[2] for r in rows] == [r[3] for r in rows], rows
    converge(stack)


def test_token_ids_equal_vllms_for_every_bundled_template(stack: Stack) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    chats: list[dict[str, Any]] = [
        {
            "messages": [
                {"role": "user", "content": "héllo wörld 你好，世界 🌍🚀 ｜ <｜User｜> text"}
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "part one"},
                        {"type": "text", "text": "part two"},
                    ],
                },
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21°C"},
            ],
            "tools": tools,
        },
    ]
    # two conversations under one long system prompt: the second starts from the ids
    # remembered under the first message, cut at a chunk boundary inside it
    system = " ".join(f"Rule {i}: réponds brièvement, 你好 (no. {i * 7})." for i in range(60))
    for question in ("What is a prefix cache?", "And a block table, then?"):
        chats.append(
            {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ]
            }
        )
    checked, reused = 0, []
    for name in bundled_templates():
        source = (TEMPLATES_DIR / f"{name}.jinja").read_text()
        ours = Tokenizer.load(stack.tokenizer_path(), name)
        for chat in chats:
            body = {"model": MODEL, "chat_template": source, "add_generation_prompt": True, **chat}
            req = urllib.request.Request(
                stack.worker_urls[0] + "/tokenize",
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    theirs = json.loads(resp.read())["tokens"]
            except urllib.error.HTTPError as exc:  # a template vLLM cannot take
                pytest.fail(f"{name}: vLLM refused: {exc.read()[:300]!r}")
            mine = ours.encode_chat(chat["messages"], tools=chat.get("tools"))
            assert mine == theirs, (name, chat)
            checked += 1
        reused.append(ours.stats.prefix_hits)
    assert checked == len(bundled_templates()) * len(chats)
    assert min(reused) > 0  # every template reused the shared system prompt


def test_every_engine_gets_the_stacks_engine_arguments(stack: Stack) -> None:
    """``StackConfig.vllm_args`` reach each engine: vLLM logs the configuration it runs."""
    for engine in stack.engines:
        log = (stack.log_dir / f"{engine.name}.log").read_text(errors="replace")
        assert "enforce_eager=True" in log, engine.name


def test_load_comes_from_vllms_metrics(stack: Stack) -> None:
    """Block size and capacity learned from ``vllm:cache_config_info``; load reports from
    vLLM's gauges, fresh."""
    ws = {w["worker_id"]: w for w in stack.workers()}
    assert set(ws) == {stack.worker_id(i) for i in range(stack.config.workers)}
    for w in ws.values():
        assert w["healthy"] and w["engine_block_size"] == 32
        # vLLM reports its pool without the null block
        assert w["kv_capacity_blocks"] in {
            (n * 32) // 16 for n in (ENGINE_BLOCKS, ENGINE_BLOCKS - 1)
        }
        rep = w["engine_report"]
        assert rep is not None and 0.0 <= rep["kv_usage"] <= 1.0 and rep["ts"] > 0


def test_streaming_and_not_through_the_gateway(stack: Stack) -> None:
    c = client(stack)
    msgs = [{"role": "user", "content": "count to three"}]
    comp = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)  # type: ignore[arg-type]
    assert comp.usage and comp.usage.completion_tokens == 5
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert any(ch.choices and ch.choices[0].delta.content for ch in chunks)
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 5
    done = c.completions.create(model=MODEL, prompt="one two three", max_tokens=3)
    assert done.usage and done.usage.completion_tokens == 3


def test_agent_restart_recovers_exactly(stack: Stack) -> None:
    rng = random.Random(3)
    chat_turns(stack, rng, conversations=1, turns=1, system_words=80)
    stack.agents[1].stop()
    stack.start_agent(1)
    stack.wait_ready()
    converge(stack)  # the new agent relearned the engine's cache by replay


def test_engine_restart_clears_and_recovers_exactly(stack: Stack) -> None:
    rng = random.Random(4)
    chat_turns(stack, rng, conversations=2, turns=1, system_words=80)
    stack.restart_engine(0)  # a new vLLM: empty cache, sequence from 0
    stack.wait_ready()
    converge(stack)
    rows = chat_turns(stack, rng, conversations=2, turns=2, system_words=80)
    assert [r[2] for r in rows] == [r[3] for r in rows], rows


def test_a_prefix_scheduled_beside_its_first_computation_is_reused(stack: Stack) -> None:
    """Two prompts sharing a new 384-token prefix, sent in one batch to an idle engine.

    vLLM commits a request's full blocks to its prefix cache when it schedules them
    (``KVCacheManager.allocate_slots``) and matches each waiting request after the earlier
    ones of the step were allocated, so the second prompt reuses the 12 shared blocks
    whether it is admitted in the same step as the first or later (which of the two
    happened is not visible from outside). The simulator's vLLM engine core, given both
    at the same instant (so admitted in one step), reuses exactly as many; committing
    blocks only once computed, as it did before, it reused none."""
    url = stack.worker_urls[0]
    converge(stack)
    assert post_json(url + "/reset_prefix_cache", {}) is not None
    rng = random.Random(11)
    shared = [rng.randrange(100, 5000) for _ in range(384)]
    prompts = [shared + [rng.randrange(100, 5000) for _ in range(32)] for _ in range(2)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 0}
    answer = post_json(url + "/v1/completions", body)
    # a batch's usage: the prompt tokens of both, the cached tokens of the last one
    assert answer["usage"]["prompt_tokens"] == 2 * 416
    real_second = answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    def simulated(on_schedule: bool) -> list[int]:
        core = EngineCore(
            CacheConfig(kv_blocks=ENGINE_BLOCKS, block_size=32),
            SchedulerConfig(),
            timing_model("mocker"),
            commit_on_schedule=on_schedule,
        )
        reqs = [core.add_request(p, 1, now=0.0) for p in prompts]
        res = core.step(0.0)
        assert res.scheduled == reqs  # one step
        core.advance(float("inf"))
        return [r.cached_tokens for r in reqs]

    assert real_second == 384
    assert simulated(True) == [0, real_second]
    assert simulated(False) == [0, 0]


def test_simulator_matches_vllm_request_by_request(stack: Stack) -> None:
    """The engine simulator, configured as engine 0 is (vLLM flavor, 32-token blocks, the same
    pool size, tokenizer and template), sent the same requests as a freshly reset vLLM:
    the same cached tokens per request and the same held blocks (from each one's own KV
    events), through evictions."""
    c = stack.config
    base = port_block(3)
    sim = ChildProcess.kvroute(
        [
            "sim", "--workers", "1", "--base-port", str(base), "--flavor", "vllm",
            "--model", MODEL, "--tokenizer", stack.tokenizer_path(),
            "--chat-template", c.chat_template, "--kv-blocks", str(ENGINE_BLOCKS),
            "--block-size", "32", "--max-model-len", "2016", "--speedup", "1000",
        ],
        "sim-vs-vllm",
        stack.log_dir,
    ).start()  # fmt: skip
    try:
        sim.wait_for_log("sim ready", timeout=60)
        real_url, sim_url = stack.worker_urls[0], f"http://127.0.0.1:{base}"
        assert post_json(real_url + "/reset_prefix_cache", {}) is not None
        keyer = BlockKeyer(c.hash_seed, c.block_size)
        rng = random.Random(5)
        chats = [[{"role": "system", "content": text(rng, 300)}] for _ in range(4)]
        rows = []
        for _ in range(3):
            for msgs in chats:
                msgs.append({"role": "user", "content": text(rng, rng.randint(10, 60))})
                # one output token: its KV is never computed, so only prompt blocks are cached
                # (the random-weight model and the simulator generate different tokens)
                body = {"model": MODEL, "messages": msgs, "max_tokens": 1, "temperature": 0}
                real = post_json(real_url + "/v1/chat/completions", body)
                simulated = post_json(sim_url + "/v1/chat/completions", body)
                rows.append(
                    (
                        real["usage"]["prompt_tokens"],
                        simulated["usage"]["prompt_tokens"],
                        real["usage"]["prompt_tokens_details"]["cached_tokens"],
                        simulated["usage"]["prompt_tokens_details"]["cached_tokens"],
                    )
                )
                # the same text follows, so both see the same next prompt
                msgs.append({"role": "assistant", "content": "ok"})
                real_keys = engine_keys(stack.engines[0].replay_endpoint, keyer)
                sim_keys = engine_keys(f"tcp://127.0.0.1:{base + 2}", keyer)
                assert real_keys == sim_keys, (len(real_keys), len(sim_keys), rows)
        assert [r[0] for r in rows] == [r[1] for r in rows], rows
        assert [r[2] for r in rows] == [r[3] for r in rows], rows
        assert sum(r[2] for r in rows) > 0
    finally:
        sim.stop()
