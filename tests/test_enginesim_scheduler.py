"""Engine core: continuous batching, chunked prefill, prefix hits, waiting under pool
exhaustion, timing presets, and the decode fast-forward the offline simulator relies on."""

from __future__ import annotations

import random

import pytest

from loadtest.enginesim.config import CacheConfig, SchedulerConfig
from loadtest.enginesim.kvcache import BlocksRemoved, BlocksStored
from loadtest.enginesim.scheduler import EngineCore, RequestState, RequestTooLarge
from loadtest.enginesim.timing import PRESETS, timing_model


def make_core(
    blocks: int = 4096,
    bs: int = 16,
    preset: str = "mocker",
    **sched: int | bool,
) -> EngineCore:
    return EngineCore(
        CacheConfig(kv_blocks=blocks, block_size=bs),
        SchedulerConfig(**sched),  # type: ignore[arg-type]
        timing_model(preset),
    )


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 100_000) for _ in range(n)]


def run_all(core: EngineCore) -> None:
    core.advance(float("inf"))
    assert not core.has_work()


# -- timing ----------------------------------------------------------------------------------


def test_seed_preset_matches_published_figures() -> None:
    seed = PRESETS["seed-70b"]
    assert seed.prefill_ms(6144) == pytest.approx(1240, rel=0.01)
    assert seed.prefill_ms(16) == pytest.approx(42, rel=0.02)  # a hit recomputes one block
    assert seed.decode_ms(0.0) == pytest.approx(22)
    assert seed.decode_ms(1.0) > seed.decode_ms(0.5) > seed.decode_ms(0.0)


def test_mocker_preset_is_the_published_formula() -> None:
    m = PRESETS["mocker"]
    t = 3000
    assert m.prefill_ms(t) == pytest.approx(4.21e-7 * t * t + 1.518e-2 * t + 16.5)
    assert m.decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    c = m.prefill_ms(0)
    assert (m.prefill_ms(8000) - c) / (m.prefill_ms(4000) - c) > 2  # superlinear
    assert m.scaled(10).step_seconds(t, 0, 0.0) == pytest.approx(m.prefill_ms(t) / 10_000)


def test_ttft_of_a_hit_is_a_fraction_of_a_miss() -> None:
    core = make_core(preset="seed-70b")
    p = prompt(6144)
    cold = core.add_request(p, 4, now=0.0)
    run_all(core)
    assert cold.first_token_time is not None and cold.finish_time is not None
    assert cold.first_token_time - cold.arrival == pytest.approx(1.240, rel=0.01)
    decode = (cold.finish_time - cold.first_token_time) / 3
    assert decode == pytest.approx(0.022, rel=0.1)
    hit = core.add_request(p, 4, now=10.0)
    run_all(core)
    assert hit.cached_tokens == 6128  # all but the last block, as vLLM recomputes it
    assert hit.first_token_time is not None
    assert hit.first_token_time - hit.arrival == pytest.approx(0.042, rel=0.02)


def _seq_core(preset: str = "seed-70b", **sched: int) -> EngineCore:
    return EngineCore(
        CacheConfig(kv_blocks=4096, block_size=16),
        SchedulerConfig(**sched),  # type: ignore[arg-type]
        timing_model(preset, attention="sequence"),
    )


def test_sequence_attention_charges_each_chunk_its_own_context() -> None:
    """``attention: sequence``: a step's quadratic term is paid per sequence on its own
    context, not on the batch's tokens together; linear and per-step terms are unchanged."""
    t = timing_model("seed-70b", attention="sequence")
    a, b, c = t.prefill_a, t.prefill_b, t.prefill_c
    # four 2,048-token prompts in one step: a quarter of "batch"'s quadratic term
    core = _seq_core()
    reqs = [core.add_request(prompt(2048, i), 2, now=0.0) for i in range(4)]
    res = core.step(0.0)
    assert res.prefill_tokens == 8192 and res.scheduled == reqs
    assert res.duration == pytest.approx((a * 4 * 2048**2 + b * 8192 + c) / 1000)
    batch = timing_model("seed-70b").step_seconds(8192, 0, 0.0)
    assert res.duration < batch
    # a 200-token turn after its 6,016 cached tokens attends to them
    core = _seq_core()
    p = prompt(6016, 9)
    core.add_request(p, 1, now=0.0)
    run_all(core)
    turn = core.add_request([*p, *prompt(200, 10)], 1, now=core.free_at + 1.0)
    res = core.step(turn.arrival)
    ctx = turn.cached_tokens
    new = 6216 - ctx
    assert ctx == 6016 and res.prefill_tokens == new  # the first turn's whole prompt
    assert res.duration == pytest.approx((a * new * (new + 2 * ctx) + b * new + c) / 1000)


def test_sequence_attention_keeps_a_lone_prompts_cost() -> None:
    """One prompt alone pays ``a·T²`` whichever way it is chunked (its chunks tile the
    triangle), so a lone cold prefill costs what the preset was fitted on, plus ``c`` per
    extra step; ``cold_prefill_seconds`` (the capacity yardstick) agrees with the engine."""
    t = timing_model("seed-70b", attention="sequence")
    for budget in (8192, 1024):
        core = _seq_core(max_num_batched_tokens=budget)
        r = core.add_request(prompt(6144, 1), 1, now=0.0)
        run_all(core)
        assert r.first_token_time is not None
        steps = -(-6144 // budget)
        expected = (PRESETS["seed-70b"].prefill_ms(6144) + (steps - 1) * t.prefill_c) / 1000
        assert r.first_token_time == pytest.approx(expected)
        assert t.cold_prefill_seconds(6144, budget) == pytest.approx(expected)
    assert t.cold_prefill_seconds(0, 8192) == 0.0
    batch = timing_model("seed-70b")
    assert batch.cold_prefill_seconds(6144, 1024) == pytest.approx(
        6 * batch.step_seconds(1024, 0, 0.0)
    )


def test_an_unknown_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="attention must be one of batch, sequence"):
        timing_model("seed-70b", attention="tokens")


# -- batching --------------------------------------------------------------------------------


def test_continuous_batching_admits_into_a_decoding_batch() -> None:
    core = make_core()
    a = core.add_request(prompt(100, 1), 50, now=0.0)
    core.step(0.0)  # a's prefill
    assert a.state == RequestState.DECODE
    core.step(core.free_at)
    b = core.add_request(prompt(100, 2), 5, now=core.free_at)
    res = core.step(core.free_at)
    assert res.scheduled == [b] and res.decode_seqs == 1 and res.prefill_tokens == 100
    assert b in res.first_token
    assert core.num_running == 2
    run_all(core)
    assert b.finish_time is not None and a.finish_time is not None
    assert b.finish_time < a.finish_time  # b joined a's batch and left before it
    assert core.output_len(a) == 50 and core.output_len(b) == 5


def test_chunked_prefill_respects_the_token_budget() -> None:
    core = make_core(max_num_batched_tokens=512)
    d = core.add_request(prompt(10, 3), 100, now=0.0)
    core.step(0.0)
    assert d.state == RequestState.DECODE
    long = core.add_request(prompt(1200, 4), 3, now=core.free_at)
    chunks = []
    while long.state == RequestState.WAITING or long.state == RequestState.PREFILL:
        res = core.step(core.free_at)
        chunks.append(res.prefill_tokens)
        assert res.prefill_tokens + res.decode_seqs <= 512
    assert chunks == [511, 511, 178]
    assert long.first_token_time == res.end


def _commit_core(on_schedule: bool, budget: int = 8192) -> EngineCore:
    return EngineCore(
        CacheConfig(kv_blocks=4096, block_size=16),
        SchedulerConfig(max_num_batched_tokens=budget),
        timing_model("mocker"),
        commit_on_schedule=on_schedule,
    )


@pytest.mark.parametrize("on_schedule", [True, False])
def test_a_prefix_scheduled_in_the_same_step_is_reused_as_vllm_does(on_schedule: bool) -> None:
    """Two requests sharing a new 640-token prefix, admitted in one step. vLLM commits a
    request's full blocks when it schedules them (``allocate_slots``) and matches the next
    waiting request after that: the second reuses the 40 blocks at once. Committed only
    once computed (SGLang), the second computes them again."""
    core = _commit_core(on_schedule)
    shared = prompt(640, 1)
    a = core.add_request(shared + prompt(30, 2), 4, now=0.0)
    b = core.add_request(shared + prompt(30, 3), 4, now=0.0)
    res = core.step(0.0)
    assert res.scheduled == [a, b]
    assert a.cached_tokens == 0
    assert b.cached_tokens == (640 if on_schedule else 0)
    assert res.prefill_tokens == 670 + (30 if on_schedule else 670)
    stored = [len(ev.block_ids) for ev in res.events if isinstance(ev, BlocksStored)]
    assert sum(stored) == 41 + 1  # a's 41 full blocks, then b's own 41st
    run_all(core)
    c = core.add_request(shared + prompt(30, 2), 4, now=core.free_at)  # a's prompt again
    run_all(core)
    assert c.cached_tokens == 656  # 41 blocks either way, once computed


@pytest.mark.parametrize("on_schedule", [True, False])
def test_chunk_by_chunk_the_scheduled_blocks_are_reusable(on_schedule: bool) -> None:
    """A 1,200-token prompt prefilled in 512-token chunks; a request sharing its first 1,000
    tokens is admitted beside the last chunk. Committed as scheduled, the first two chunks'
    blocks and the last's are in the cache when it is matched: 62 blocks (992 tokens)."""
    core = _commit_core(on_schedule, budget=512)
    shared = prompt(1200, 4)
    a = core.add_request(shared, 2, now=0.0)
    assert core.step(0.0).prefill_tokens == 512
    b = core.add_request(shared[:1000] + prompt(20, 5), 2, now=core.free_at)
    res = core.step(core.free_at)  # a's second chunk takes the whole budget
    assert res.scheduled == [] and b.state == RequestState.WAITING
    res = core.step(core.free_at)  # a's last 176 tokens, then b
    assert res.scheduled == [b] and a.first_token_time == res.end
    assert b.cached_tokens == (992 if on_schedule else 0)
    run_all(core)


def test_without_chunking_a_long_prompt_runs_alone() -> None:
    core = make_core(max_num_batched_tokens=512, chunked_prefill=False)
    d = core.add_request(prompt(10, 5), 3, now=0.0)
    long = core.add_request(prompt(1200, 6), 3, now=0.0)
    first = core.step(0.0)
    assert first.scheduled == [d]  # the long one does not fit the remaining budget
    run_all(core)
    assert long.first_token_time is not None and long.state == RequestState.FINISHED


def test_max_num_seqs_queues_the_rest() -> None:
    core = make_core(max_num_seqs=2)
    reqs = [core.add_request(prompt(50, i), 10, now=0.0) for i in range(3)]
    core.step(0.0)
    assert core.num_running == 2 and core.num_waiting == 1
    run_all(core)
    assert reqs[2].scheduled_time is not None and reqs[0].finish_time is not None
    assert reqs[2].scheduled_time >= reqs[0].finish_time


def test_pool_exhaustion_makes_requests_wait_not_fail() -> None:
    core = make_core(blocks=40, bs=16)  # 640 tokens of KV
    a = core.add_request(prompt(400, 7), 100, now=0.0)  # needs 32 blocks
    b = core.add_request(prompt(300, 8), 50, now=0.0)  # needs 22: only 8 left
    res = core.step(0.0)
    assert res.scheduled == [a] and core.num_waiting == 1
    assert core.kv_usage == pytest.approx(32 / 40)
    run_all(core)
    assert a.finish_time is not None and b.scheduled_time is not None
    assert b.scheduled_time >= a.finish_time
    assert b.state == RequestState.FINISHED
    assert core.allocator.num_free + core.cache.cached_blocks == 40
    with pytest.raises(RequestTooLarge):
        core.add_request(prompt(600, 9), 100, now=1.0)


def test_eviction_makes_room_and_is_reported() -> None:
    core = make_core(blocks=40, bs=16)
    first = core.add_request(prompt(480, 10), 1, now=0.0)  # caches 30 blocks
    run_all(core)
    assert core.cache.cached_blocks == 30 and first.state == RequestState.FINISHED
    core.add_request(prompt(400, 11), 1, now=1.0)  # needs 25 blocks: 10 free + evictions
    res = core.advance(float("inf"))
    events = [e for r in res for e in r.events]
    removed = sum(len(e.block_ids) for e in events if isinstance(e, BlocksRemoved))
    stored = sum(len(e.block_ids) for e in events if isinstance(e, BlocksStored))
    assert removed == 15 and stored == 25
    assert core.lookup(prompt(480, 10)) == (30 - 15) * 16


def test_outputs_are_cached_for_the_next_turn() -> None:
    core = make_core(bs=4)
    p = prompt(10, 12)
    core.add_request(p, 9, now=0.0)
    run_all(core)
    follow = p + core.output_token_ids(0, 9) + [7, 7, 7]
    assert core.lookup(follow) == 16  # 10 + 8 computed tokens -> 4 full blocks


def test_outputs_not_cached_when_disabled() -> None:
    core = EngineCore(
        CacheConfig(kv_blocks=64, block_size=4, cache_outputs=False),
        SchedulerConfig(),
        timing_model("mocker"),
    )
    p = prompt(10, 12)
    core.add_request(p, 9, now=0.0)
    run_all(core)
    assert core.lookup(p + core.output_token_ids(0, 9) + [7]) == 8  # the prompt's blocks only


def test_abort_frees_everything() -> None:
    core = make_core(blocks=100)
    a = core.add_request(prompt(200, 13), 100, now=0.0)
    b = core.add_request(prompt(200, 14), 100, now=0.0)
    core.step(0.0)
    core.step(core.free_at)
    core.abort(a, core.free_at)
    core.abort(b, core.free_at)
    assert not core.has_work() and core.kv_usage == 0
    assert core.stats.aborted == 2 and a.num_output == 2
    assert core.allocator.num_free + core.cache.cached_blocks == 100


def test_reset_prefix_cache_refused_while_running() -> None:
    core = make_core()
    core.add_request(prompt(64, 15), 50, now=0.0)
    core.step(0.0)
    assert not core.reset_prefix_cache()
    run_all(core)
    assert core.reset_prefix_cache()
    assert core.cache.cached_blocks == 0


# -- fast-forward ----------------------------------------------------------------------------


def _workload(core: EngineCore, fast: bool) -> list[tuple[float | None, float | None, int]]:
    rng = random.Random(99)
    shared = prompt(300, 16)
    t = 0.0
    reqs = []
    for i in range(60):
        t += rng.expovariate(20.0)
        if fast:
            core.advance(t)
        else:
            while core.has_work() and core.free_at < t:
                core.step(core.free_at)
        tail = prompt(rng.randrange(1, 200), 100 + i)
        reqs.append(core.add_request(shared + tail, rng.randrange(1, 120), now=t))
    if fast:
        core.advance(float("inf"))
    else:
        while core.has_work():
            core.step(core.free_at)
    return [(r.first_token_time, r.finish_time, r.cached_tokens) for r in reqs]


def test_fast_forward_matches_step_by_step() -> None:
    slow_core, fast_core = make_core(blocks=300), make_core(blocks=300)
    slow = _workload(slow_core, fast=False)
    fast = _workload(fast_core, fast=True)
    assert len(slow) == len(fast)
    for (f1, e1, c1), (f2, e2, c2) in zip(slow, fast, strict=True):
        assert c1 == c2
        assert f1 == pytest.approx(f2, abs=1e-9) and e1 == pytest.approx(e2, abs=1e-9)
    assert fast_core.stats.steps == slow_core.stats.steps
    assert fast_core.stats.cache_hits == slow_core.stats.cache_hits > 0
