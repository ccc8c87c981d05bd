"""Shadow index: exact agreement with a brute-force model (a set of keys per worker)."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.routing.index import ShadowIndex
from gateway.routing.keys import BlockKeyer

BS = 2
KEYER = BlockKeyer("index-tests", BS)
WORKERS = ["w0", "w1", "w2", "w3"]
TTL = 5.0

# A small universe of real key chains with much sharing: every token sequence over a
# 3-letter alphabet, up to 6 blocks. Keys of a sequence are its chain from the root.
_SEQS = [list(p) for n in range(1, 7) for p in itertools.product(range(3), repeat=n * BS)][::7]
CHAINS = [KEYER.keys(s) for s in _SEQS]
ALL_KEYS = sorted({k for c in CHAINS for k in c})
#: each key's parent on its chain (a key names its whole prefix, so the parent is unique)
PARENT = {k: (c[i - 1] if i else None) for c in CHAINS for i, k in enumerate(c)}


class Model:
    """The obviously-correct reference: sets and dicts, linear scans."""

    def __init__(self) -> None:
        self.real: dict[str, set[int]] = {}
        self.spec: dict[str, dict[int, float]] = {}

    def known(self, w: str) -> bool:
        return w in self.real

    def add(self, w: str) -> None:
        self.real.setdefault(w, set())
        self.spec.setdefault(w, {})

    def stored(self, w: str, keys: list[int]) -> None:
        self.add(w)
        self.real[w].update(keys)
        for k in keys:
            self.spec[w].pop(k, None)

    def removed(self, w: str, keys: list[int]) -> None:
        if w in self.real:
            self.real[w].difference_update(keys)
            for k in keys:
                self.spec[w].pop(k, None)

    def cleared(self, w: str) -> None:
        if w in self.real:
            self.real[w] = set()
            self.spec[w] = {}

    def remove_worker(self, w: str) -> None:
        self.real.pop(w, None)
        self.spec.pop(w, None)

    def speculate(self, w: str, keys: list[int], now: float, start: int) -> None:
        if start >= len(keys):
            return
        self.add(w)
        for k in keys[start:]:
            if k not in self.real[w]:
                self.spec[w][k] = now + TTL

    def expire(self, now: float) -> None:
        for s in self.spec.values():
            for k in [k for k, e in s.items() if e <= now]:
                del s[k]

    def continues(self, w: str, key: int) -> bool:
        """Whether ``w`` holds (really or speculatively) ``key`` and a block whose parent it is."""
        if w not in self.real:
            return False
        held = {*self.real[w], *self.spec[w]}
        return key in held and any(PARENT[k] == key for k in held)

    def match(self, keys: list[int]) -> dict[str, int]:
        out = {}
        for w in self.real:
            n = 0
            for k in keys:
                if k in self.real[w] or k in self.spec[w]:
                    n += 1
                else:
                    break
            if n:
                out[w] = n
        return out


chains = st.sampled_from(CHAINS)
workers = st.sampled_from(WORKERS)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = ShadowIndex(speculative_ttl=TTL)
        self.model = Model()
        self.now = 0.0

    @rule(w=workers, chain=chains, data=st.data())
    def store(self, w: str, chain: list[int], data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(chain) - 1))
        j = data.draw(st.integers(i + 1, len(chain)))
        parent = chain[i - 1] if i else None
        self.index.stored(w, parent, chain[i:j])
        self.model.stored(w, chain[i:j])

    @rule(w=workers, keys=st.lists(st.sampled_from(ALL_KEYS), max_size=6))
    def remove(self, w: str, keys: list[int]) -> None:
        self.index.removed(w, keys)
        self.model.removed(w, keys)

    @rule(w=workers, chain=chains)
    def remove_chain_tail_first(self, w: str, chain: list[int]) -> None:
        keys = list(reversed(chain))
        self.index.removed(w, keys)
        self.model.removed(w, keys)

    @rule(w=workers)
    def clear(self, w: str) -> None:
        self.index.cleared(w)
        self.model.cleared(w)

    @rule(w=workers)
    def remove_worker(self, w: str) -> None:
        self.index.remove_worker(w)
        self.model.remove_worker(w)

    @rule(w=workers, chain=chains, data=st.data())
    def speculate(self, w: str, chain: list[int], data: st.DataObject) -> None:
        start = data.draw(st.integers(0, len(chain)))
        self.index.speculate(w, chain, self.now, start)
        self.model.speculate(w, chain, self.now, start)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5, 5.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.index.expire(self.now)
        self.model.expire(self.now)

    @rule(chain=chains)
    def match(self, chain: list[int]) -> None:
        assert self.index.match(chain) == self.model.match(chain)

    @rule(w=workers, data=st.data())
    def continues(self, w: str, data: st.DataObject) -> None:
        # mostly keys the worker holds (where the answer can be yes), sometimes any key
        held = sorted({*self.model.real.get(w, ()), *self.model.spec.get(w, {})})
        key = data.draw(st.sampled_from(held if held and data.draw(st.booleans()) else ALL_KEYS))
        assert self.index.continues(w, key) == self.model.continues(w, key)

    @precondition(lambda self: True)
    @invariant()
    def agrees(self) -> None:
        self.index.check_invariants()
        for w in WORKERS:
            if self.model.known(w):
                assert self.index.worker_keys(w) == self.model.real[w]
                listed = self.index.worker_key_list(w)  # what a digest reads: each key once
                assert len(listed) == len(self.model.real[w]) == self.index.blocks(w)
                assert set(listed) == self.model.real[w]
            else:
                assert w not in self.index
        live = {k for s in self.model.real.values() for k in s}
        live |= {k for s in self.model.spec.values() for k in s}
        # memory bounded by what is held: no key kept that nobody holds, except interior
        # structure leading to held descendants
        assert len(self.index) <= len(live) + _interior_slack(self.index, live)


def _interior_slack(index: ShadowIndex, live: set[int]) -> int:
    return sum(len(keys) for keys, mask in index.iter_runs() if not mask)


TestIndexAgainstModel = IndexMachine.TestCase
TestIndexAgainstModel.settings = settings(
    max_examples=int(__import__("os").environ.get("KVR_EXAMPLES", "120")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_match_stops_at_first_missing_block() -> None:
    idx = ShadowIndex()
    chain = CHAINS[-1]
    idx.stored("a", None, chain)
    idx.removed("a", [chain[2]])
    assert idx.match(chain) == {"a": 2}
    idx.stored("b", None, chain[:1])
    assert idx.match(chain) == {"a": 2, "b": 1}


def test_orphans_are_counted_and_applied() -> None:
    idx = ShadowIndex()
    chain = CHAINS[-1]
    idx.stored("a", chain[1], chain[2:4])  # parent unknown to the index: kept detached
    assert idx.stats.orphan_stores == 1
    assert idx.match(chain) == {}
    idx.stored("a", None, chain[:2])  # the gap is filled: the whole run matches
    assert idx.match(chain) == {"a": 4}
    idx.check_invariants()


def test_duplicates_and_unknown_removes_counted() -> None:
    idx = ShadowIndex()
    chain = CHAINS[-1]
    idx.stored("a", None, chain[:3])
    idx.stored("a", None, chain[:3])
    idx.removed("a", [chain[5]])
    assert idx.stats.duplicate_stores == 3
    assert idx.stats.unknown_removes == 1
    assert idx.blocks("a") == 3


def test_conflicting_parent_is_counted_and_skipped() -> None:
    idx = ShadowIndex()
    a, b = CHAINS[-1], CHAINS[-2]
    idx.stored("w", None, a[:3])
    # claim a[2] follows b[0]: impossible for content-defined keys
    idx.stored("w", b[0], [a[2], 12345])
    assert idx.stats.conflicts == 1
    assert not idx.holds("w", 12345)
    idx.check_invariants()


def test_memory_is_freed_by_removal_and_worker_removal() -> None:
    idx = ShadowIndex()
    for c in CHAINS[:50]:
        idx.stored("a", None, c)
        idx.stored("b", None, c)
    idx.remove_worker("a")
    for c in CHAINS[:50]:
        idx.removed("b", list(reversed(c)))
    assert len(idx) == 0 and idx.node_count() == 0
    idx.check_invariants()


def test_speculated_at_is_when_the_attribution_was_made() -> None:
    """The policy reads when a speculative holding began (a prefix's first request), for
    speculative holdings only: not for real ones, unknown workers or expired attributions."""
    idx = ShadowIndex(speculative_ttl=5.0)
    chain = CHAINS[-1]
    idx.add_worker("a")
    idx.speculate("a", chain, now=2.0)
    assert idx.speculated_at("a", chain[-1]) == 2.0
    idx.speculate("a", chain, now=3.0)  # refreshed by a later decision: the latest counts
    assert idx.speculated_at("a", chain[0]) == 3.0
    idx.stored("a", None, chain[:2])  # the engine computed the first two blocks
    assert idx.speculated_at("a", chain[1]) is None
    assert idx.speculated_at("a", chain[2]) == 3.0
    assert idx.speculated_at("b", chain[2]) is None
    idx.expire(9.0)
    assert idx.speculated_at("a", chain[2]) is None


def test_continues_tells_where_a_holders_chain_goes_on() -> None:
    """``continues(worker, key)``: the worker holds ``key`` and the block after it, in the
    same run or in a child run (where another worker's shorter copy split the chain), really
    or speculatively; not at the chain's end, nor for a key it does not hold."""
    chain = max(CHAINS, key=len)
    idx = ShadowIndex(speculative_ttl=TTL)
    idx.stored("a", None, chain)
    idx.stored("b", None, chain[:2])  # splits a's chain after chain[1]
    idx.speculate("c", chain[:4], 1.0)
    assert idx.continues("a", chain[0])  # within a run
    assert idx.continues("a", chain[1])  # the run ends; a's child run goes on
    assert not idx.continues("a", chain[-1])  # the end of a's chain
    assert not idx.continues("b", chain[1])  # b's copy ends there
    assert not idx.continues("b", chain[3])  # not held by b
    assert idx.continues("c", chain[2]) and not idx.continues("c", chain[3])  # speculative
    assert not idx.continues("nobody", chain[0])
    idx.expire(1.0 + TTL)
    assert not idx.continues("c", chain[2])


def test_outbox_carries_own_inserts_and_adopt_replays_them_elsewhere() -> None:
    """A replica's speculative inserts, as (worker, parent, keys), replayed on another
    replica's index (``adopt``) leave the same match and the same expiry there, are not put
    in that index's own outbox (no echo), and name no worker that index does not know."""
    a, b = ShadowIndex(speculative_ttl=5.0), ShadowIndex(speculative_ttl=5.0)
    chain = CHAINS[-1]
    for idx in (a, b):
        idx.add_worker("w1")
        idx.stored("w1", None, chain[:2])
    a.outbox, b.outbox = [], []
    a.speculate("w1", chain, now=1.0, start=2)
    assert a.outbox == [("w1", chain[1], list(chain[2:]))]
    for worker, parent, keys in a.outbox:
        assert b.adopt(worker, parent, keys, now=1.5) == len(chain) - 2
    assert b.outbox == [] and b.match(chain) == a.match(chain) == {"w1": len(chain)}
    assert b.speculated_at("w1", chain[-1]) == 1.5 and b.blocks("w1") == 2
    b.expire(6.4)
    assert b.match(chain) == {"w1": len(chain)}
    b.expire(6.5)
    assert b.match(chain) == {"w1": 2}
    assert b.adopt("gone", None, list(chain), now=7.0) == 0 and "gone" not in b
    assert b.adopt("w1", None, [], now=7.0) == 0
    b.check_invariants()
    # without an outbox (a lone gateway) nothing is kept
    c = ShadowIndex()
    c.speculate("w1", chain, now=0.0)
    assert c.outbox is None


def test_speculation_keeps_a_burst_together_then_expires() -> None:
    idx = ShadowIndex(speculative_ttl=5.0)
    chain = CHAINS[-1]
    idx.add_worker("a")
    idx.speculate("a", chain, now=0.0)
    assert idx.match(chain) == {"a": len(chain)}
    assert idx.blocks("a") == 0  # speculation is not a real holding
    idx.stored("a", None, chain[:2])  # real events supersede
    idx.expire(10.0)
    assert idx.match(chain) == {"a": 2}
    assert idx.stats.speculative_confirmed == 2
