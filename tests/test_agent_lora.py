"""The agent keys LoRA blocks on their adapter's chain (vLLM and SGLang event formats)."""

from __future__ import annotations

import pytest
from agent_helpers import FLAVORS, batch_payload, removed_event, stored_event
from hypothesis import given, settings
from hypothesis import strategies as st
from test_agent_canonical import engine_blocks

from gateway.contract.wire import Event, Removed, Stored
from gateway.routing.keys import BlockKeyer
from worker_agent.canonical import RankCanonicaliser
from worker_agent.engines.decode import BlockRemoved, BlockStored, decode_batch
from worker_agent.metrics import AgentMetrics
from worker_agent.pipeline import EventPipeline

KEYER = BlockKeyer("test-seed", 16)
TOKENS = list(range(100, 164))  # 4 canonical blocks


def lora_fields(flavor: str, name: str, n: int) -> dict[str, object]:
    """What each engine version puts on a LoRA block (reference/engines.md §1.6, §2.1)."""
    if flavor.startswith("vllm"):
        # lora_id is deprecated but still set; extra_keys carry the name, one entry per block
        per_block = [name] if flavor == "vllm-0.33" else name
        return {"lora_id": 1, "lora_name": name, "extra_keys": [per_block] * n}
    return {"lora_name": name}  # SGLang 0.5.22+: lora_id always None


def pipeline() -> tuple[EventPipeline, list[Event]]:
    out: list[Event] = []
    return EventPipeline(KEYER, lambda evs, *_: out.extend(evs), AgentMetrics()), out


@pytest.mark.parametrize(
    ("flavor", "page"), [("vllm-0.33", 16), ("vllm-0.23", 32), ("sglang-0.5.23", 1)]
)
def test_lora_blocks_are_keyed_on_the_adapter_chain(flavor: str, page: int) -> None:
    f = FLAVORS[flavor]
    pipe, out = pipeline()
    n = len(TOKENS) // page
    hashes = [1000 + i for i in range(n)]
    half = n // 2  # two events: a root and its child, as engines publish a chain
    events = [
        stored_event(f, hashes[:half], None, TOKENS[: half * page], page,
                     **lora_fields(flavor, "sql-lora", half)),
        stored_event(f, hashes[half:], hashes[half - 1], TOKENS[half * page :], page,
                     **lora_fields(flavor, "sql-lora", n - half)),
    ]  # fmt: skip
    assert pipe.on_batch(0, 0, batch_payload(events))
    want = KEYER.keys(TOKENS, KEYER.adapter_root("sql-lora"))
    stored = [e for e in out if isinstance(e, Stored)]
    assert [k for e in stored for k in e.keys] == want
    assert stored[0].parent is None  # an adapter chain is published as a root
    assert not set(want) & set(KEYER.keys(TOKENS))  # never the base model's keys
    assert pipe.mirror.keys() == frozenset(want)
    out.clear()
    assert pipe.on_batch(0, 1, batch_payload([removed_event(f, [hashes[-1]])]))
    gone = [k for e in out if isinstance(e, Removed) for k in e.keys]
    per = max(page // 16, 1)  # canonical blocks the last engine block completes
    assert sorted(gone) == sorted(want[-per:]), (gone, want)


@pytest.mark.parametrize("flavor", ["vllm-0.33", "sglang-0.5.23"])
def test_base_and_two_adapters_with_one_prompt_hold_three_disjoint_chains(flavor: str) -> None:
    f = FLAVORS[flavor]
    pipe, _ = pipeline()
    events = [stored_event(f, [1, 2, 3, 4], None, TOKENS, 16)]
    for i, name in enumerate(("a", "b")):
        hashes = [10 * (i + 1) + j for j in range(4)]
        events.append(stored_event(f, hashes, None, TOKENS, 16, **lora_fields(flavor, name, 4)))
    assert pipe.on_batch(0, 0, batch_payload(events))
    base = KEYER.keys(TOKENS)
    a = KEYER.keys(TOKENS, KEYER.adapter_root("a"))
    b = KEYER.keys(TOKENS, KEYER.adapter_root("b"))
    assert len({*base, *a, *b}) == 12
    assert pipe.mirror.keys() == frozenset([*base, *a, *b])
    # the adapter's blocks go with their engine blocks, the base chain stays
    assert pipe.on_batch(0, 1, batch_payload([removed_event(f, [10, 11, 12, 13])]))
    assert pipe.mirror.keys() == frozenset([*base, *b])


def test_lora_with_other_extra_keys_or_without_a_name_is_dropped() -> None:
    f = FLAVORS["vllm-0.33"]
    mm = stored_event(f, [1], None, TOKENS[:16], 16, lora_id=1, lora_name="a",
                      extra_keys=[["a", ["img", 0]]])  # fmt: skip
    unnamed = stored_event(f, [2], None, TOKENS[:16], 16, lora_id=3)  # vLLM before lora_name
    batch = decode_batch(batch_payload([mm, unnamed]))
    canon = RankCanonicaliser(KEYER)
    for ev in batch.events:
        assert isinstance(ev, BlockStored) and ev.keyed_extra
        assert canon.stored(ev) == []
    assert canon.dropped["extra_keys"] == 2


def test_sglang_page_size_one_adapter_chain_reaches_across_events() -> None:
    """Page size 1: engine blocks that complete no canonical block still carry the adapter's
    chain start, so the first canonical key published is the adapter's, as a root."""
    canon = RankCanonicaliser(KEYER)
    parent = None
    chains = []
    for i, t in enumerate(TOKENS[:20]):
        chains += canon.stored(BlockStored([i], parent, [t], 1, lora_name="a"))
        parent = i
    assert chains == [(None, KEYER.keys(TOKENS[:16], KEYER.adapter_root("a")))]


def test_served_adapters_from_vllm_and_sglang_model_lists() -> None:
    from worker_agent.adapters import served_adapters

    vllm = {  # vLLM: a card per --lora-modules entry, parent = the base model
        "object": "list",
        "data": [
            {"id": "llama", "root": "meta/llama", "parent": None, "max_model_len": 8192},
            {"id": "sql-lora", "root": "/adapters/sql", "parent": "llama"},
            {"id": "chat-lora", "root": "/adapters/chat", "parent": "llama"},
        ],
    }
    assert served_adapters(vllm, "llama") == ("chat-lora", "sql-lora")
    sglang = {"data": [{"id": "ds", "root": "ds"}, {"id": "a", "root": "/l/a", "parent": "ds"}]}
    assert served_adapters(sglang, "ds") == ("a",)
    assert served_adapters({"data": [{"id": "m"}]}, "m") == ()
    with pytest.raises(ValueError):
        served_adapters(["not", "a", "list"], "m")


def test_loaded_adapters_from_vllm_lora_requests_info() -> None:
    from worker_agent.engines.base import parse_metrics
    from worker_agent.engines.vllm import VllmAdapter

    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",'
        'waiting_lora_adapters=""} 1.7e9\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,c",'
        'waiting_lora_adapters="d"} 1.8e9\n'
        'vllm:num_requests_running{model_name="m",engine="0"} 3\n'
    )
    adapter = VllmAdapter()
    report = adapter.report(parse_metrics(text, adapter.metric_names), 1.0)
    assert report.adapters == ("b", "c", "d") and report.max_adapters == 2  # the newest series
    assert report.running == 3
    plain = adapter.report(parse_metrics(text.split("# TYPE")[0], adapter.metric_names), 1.0)
    assert plain.adapters is None and plain.max_adapters is None


@settings(max_examples=60, deadline=None)
@given(
    bs=st.sampled_from([1, 5, 16, 32]),
    prompts=st.lists(
        st.tuples(
            st.sampled_from([None, "a", "b"]),
            st.integers(0, 1),
            st.lists(st.integers(0, 1000), max_size=60),
        ),
        min_size=1,
        max_size=8,
    ),
    gone=st.sampled_from([None, "a", "b"]),
)
def test_interleaved_adapters_against_a_reference(
    bs: int, prompts: list[tuple[str | None, int, list[int]]], gone: str | None
) -> None:
    """Against a plain model: the rank holds, per adapter (and the base), the keys of every
    prompt stored with it on that adapter's chain; dropping one adapter's engine blocks
    leaves the others' keys exactly."""
    canon = RankCanonicaliser(KEYER)
    shared = [list(range(500, 564)), list(range(700, 764))]
    held: dict[str | None, set[int]] = {None: set(), "a": set(), "b": set()}
    hashes: dict[str | None, set[str]] = {None: set(), "a": set(), "b": set()}
    for lora, which, tail in prompts:
        toks = shared[which] + tail
        blocks = engine_blocks(toks, bs, salt=f"{lora}|")  # the engine's hash has the adapter
        if not blocks:
            continue
        ev = BlockStored(
            [h for h, _ in blocks], None, [t for _, b in blocks for t in b], bs, lora_name=lora
        )
        canon.stored(ev)
        hashes[lora].update(h for h, _ in blocks)
        held[lora] |= set(KEYER.keys(toks[: len(blocks) * bs], KEYER.adapter_root(lora)))
    assert canon.held == held[None] | held["a"] | held["b"]
    canon.removed(BlockRemoved(sorted(hashes[gone])))
    assert canon.held == set().union(*(keys for name, keys in held.items() if name != gone))
