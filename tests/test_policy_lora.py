"""Routing LoRA requests: only workers serving the adapter, preferring those with it loaded."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.adapters import AdapterCatalog
from gateway.routing.keys import BlockKeyer
from gateway.routing.policy import make_policy
from gateway.routing.router import NoCandidates, Router

BS = 16
KEYER = BlockKeyer("policy-lora", BS)
WORKERS = ["w0", "w1", "w2", "w3"]
TOKENS = list(range(1000, 1000 + 40 * BS))


def router(seed: int = 0, configured: tuple[str, ...] = ()) -> Router:
    r = Router(
        make_policy("ttft"), BS, rng=random.Random(seed), adapters=AdapterCatalog(configured)
    )
    for w in WORKERS:
        r.add_worker(w)
    return r


def test_equal_caches_prefer_the_worker_with_the_adapter_loaded() -> None:
    for seed in range(20):  # whatever the tie-breaking coin says
        r = router(seed, configured=("sql",))
        r.adapters.report("w2", ["sql"], slots=2)
        d = r.route(KEYER.keys(TOKENS, KEYER.adapter_root("sql")), len(TOKENS), 0.0, adapter="sql")
        assert d.worker == "w2"


def test_the_gateway_remembers_where_it_sent_an_adapter() -> None:
    r = router(configured=("sql",))
    first = r.route([], 100, 0.0, adapter="sql").worker
    assert r.adapters.is_loaded(first, "sql")
    assert all(r.route([], 100, 0.1, adapter="sql").worker == first for _ in range(5))


def test_adapter_load_is_paid_against_queued_work() -> None:
    """A worker with the adapter but a long queue loses to an idle one that loads it."""
    r = router(configured=("sql",))
    r.adapters.report("w0", ["sql"], slots=1)
    r.loads.started("w0", 30_000, now=0.0)  # seconds of queued prefill
    assert r.route([], 100, 0.0, adapter="sql").worker != "w0"
    # a short queue is cheaper than a load (default 50 ms); the queued request is longer than
    # this one, so this one is not a "long" request that a cold pool lets yield its best worker
    r2 = router(configured=("sql",))
    r2.adapters.report("w0", ["sql"], slots=1)
    r2.loads.started("w0", 150, now=0.0)
    assert r2.route([], 100, 0.0, adapter="sql").worker == "w0"


def test_only_workers_serving_the_adapter_are_candidates() -> None:
    r = router()
    r.adapters.serve("w3", ["sql"])
    assert r.adapters.known("sql") and not r.adapters.known("chat")
    assert {r.route([], 100, float(i), adapter="sql").worker for i in range(10)} == {"w3"}
    with pytest.raises(NoCandidates):
        r.route([], 100, 0.0, adapter="sql", exclude=["w3"])
    assert r.route([], 100, 0.0).worker in WORKERS  # the base model: everyone


def test_slots_evict_the_least_recently_used_adapter() -> None:
    cat = AdapterCatalog(["a", "b", "c"])
    cat.add_worker("w")
    cat.report("w", ["a"], slots=2)
    cat.routed("w", "b")
    cat.routed("w", "c")
    assert not cat.is_loaded("w", "a") and cat.is_loaded("w", "b") and cat.is_loaded("w", "c")
    assert cat.not_loaded("a", ["w", "nobody"]) == {"w", "nobody"}
    assert cat.names() == ["a", "b", "c"]
    assert cat.loaded_on("w") == ["b", "c"] and cat.served_by("w") == ["a", "b", "c"]


def test_a_worker_whose_slots_other_adapters_fill_is_left_out_until_one_drains() -> None:
    """vLLM skips a request whose adapter would exceed its slots, so on a worker whose
    requests in flight use every slot with other adapters it waits for one to drain: such a
    worker is not a candidate while another is, even holding the request's whole prefix."""
    r = router(configured=("sql", "legal", "chat"))
    for w in WORKERS:
        r.adapters.report(w, [], slots=2)
    tokens = list(range(5000, 5000 + 500 * BS))  # 8,000 tokens: seconds of prefill elsewhere
    keys = KEYER.keys(tokens, KEYER.adapter_root("chat"))
    r.index.stored("w0", None, keys)  # w0 holds the chat adapter's prefix
    assert r.route(keys, len(tokens), 0.0, adapter="chat").worker == "w0"
    held = [
        r.started(r.route([], 16, 0.0, adapter=a, exclude=WORKERS[1:]), 16, 0.0, a)
        for a in ("sql", "legal")
    ]
    # without the slots in the picture w0 is still the best score by far
    plain = router(configured=("sql", "legal", "chat"))
    plain.index.stored("w0", None, keys)
    for a in ("sql", "legal"):
        plain.started(plain.route([], 16, 0.0, adapter=a, exclude=WORKERS[1:]), 16, 0.0)
    assert plain.route(keys, len(tokens), 0.0, adapter="chat").worker == "w0"
    assert r.adapters.crowded("chat", WORKERS) == {"w0"}
    assert r.adapters.crowded("sql", WORKERS) == set()  # sql's own requests share its slot
    for t in range(10):
        assert r.route(keys, len(tokens), 0.01 * t, adapter="chat", dry_run=True).worker != "w0"
    assert r.route([], 100, 0.2).worker in WORKERS  # the base model needs no slot
    # every other worker gone: better to wait on w0 than to answer 503
    assert r.route(keys, len(tokens), 0.2, adapter="chat", exclude=WORKERS[1:]).worker == "w0"
    r.finished(held[0], 0.3)  # sql drains: a slot frees up
    assert r.adapters.crowded("chat", WORKERS) == set()
    assert r.route(keys, len(tokens), 0.3, adapter="chat").worker == "w0"
    r.finished(held[1], 0.4)
    r.finished(held[1], 0.4)  # a second end of one request never goes below zero
    assert not r.adapters._workers["w0"].busy
    silent = AdapterCatalog(["sql", "chat"])  # an engine that never said its slots
    silent.add_worker("s")
    silent.begin("s", "sql")
    assert silent.crowded("chat", ["s"]) == set()
    silent.report("s", None, slots=1)
    assert silent.crowded("chat", ["s"]) == {"s"}
    r.remove_worker("w0")
    r.adapters.end("w0", "sql")  # a request ending after its worker left


@settings(max_examples=80, deadline=None)
@given(
    loaded=st.sets(st.sampled_from(WORKERS)),
    matches=st.dictionaries(st.sampled_from(WORKERS), st.integers(1, 30)),
    seed=st.integers(0, 1000),
)
def test_idle_pool_choice_against_a_reference_cost(
    loaded: set[str], matches: dict[str, int], seed: int
) -> None:
    """Idle pool: the pick is a lowest-cost worker by a plain reference model (uncached
    prefill + adapter load where not loaded + the compute weight on the prefill), up to
    the policy's near-tie tolerance; among equal matches a loaded worker always wins."""
    r = router(seed, configured=("a",))
    keys = KEYER.keys(TOKENS, KEYER.adapter_root("a"))
    for w, n in matches.items():
        r.index.stored(w, None, keys[:n])
    for w in loaded:
        r.adapters.report(w, ["a"], slots=4)
    d = r.route(keys, len(TOKENS), 0.0, dry_run=True, adapter="a")
    cost, cw = r.ctx.cost, 1.5
    load = cost.params.adapter_load_ms

    def score(w: str) -> float:
        new = len(TOKENS) - matches.get(w, 0) * BS
        return cost.prefill_ms(new) * (1 + cw) + (0.0 if w in loaded else load)

    best = min(map(score, WORKERS))
    assert score(d.worker) <= best + max(1.0, 0.02 * best) + 1e-6
    same = [w for w in WORKERS if matches.get(w, 0) == matches.get(d.worker, 0)]
    if any(w in loaded for w in same):
        assert d.worker in loaded
