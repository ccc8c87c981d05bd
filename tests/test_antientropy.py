"""Anti-entropy and trust: digest checks at the same stream position, resync from snapshot,
the trust rules, the router ignoring untrusted workers' index entries, and a live stack
where one store and one removal are silently lost (no sequence gap) and healed."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.antientropy import AntiEntropy
from gateway.contract.wire import (
    ENTRY_FIELD,
    Digest,
    Entry,
    RedisLayout,
    Removed,
    Stored,
    decode_entry,
    decode_snapshot,
    encode_entry,
    key_digest,
)
from gateway.routing.index import ShadowIndex
from gateway.routing.policy import make_policy
from gateway.routing.router import Router
from gateway.trust import TrustBook, TrustSettings
from loadtest.stack import ADMIN_KEY, Stack, StackConfig, wait_for


def _entry(seq: int, digest: Digest | None, epoch: int = 7) -> Entry:
    return Entry(1, epoch, seq, 0.0, 0.0, [], [Removed([])], digest)


def test_entry_digest_is_additive_on_the_wire() -> None:
    plain = _entry(3, None)
    stamped = _entry(3, Digest(2, "ab"))
    assert decode_entry(encode_entry(plain)).digest is None
    assert decode_entry(encode_entry(stamped)).digest == Digest(2, "ab")
    # a v1 reader without the field reads a stamped entry (trailing items are ignored)
    old = msgspec.defstruct(
        "OldEntry",
        [("v", int), ("epoch", int), ("seq", int), ("ts", float), ("pts", float)],
        array_like=True,
    )
    assert msgspec.msgpack.decode(encode_entry(stamped), type=old).seq == 3


def test_digest_check_compares_the_index_at_the_stamped_position() -> None:
    index = ShadowIndex()
    index.add_worker("w")
    index.stored("w", None, [1, 2, 3])
    ae = AntiEntropy(index)
    assert ae.check("w", _entry(5, None))  # nothing stamped: nothing to compare
    assert ae.check("w", _entry(5, Digest(3, key_digest([3, 2, 1]))))
    assert not ae.check("w", _entry(6, Digest(3, key_digest([1, 2, 4]))))
    assert ae.mismatched == {"w": (7, 6)}
    # only a snapshot at or after the mismatch's position heals it
    assert not ae.heals("w", 7, 5)
    assert ae.heals("w", 7, 6) and ae.heals("w", 8, 1)
    assert ae.healed("w") and not ae.healed("w")
    assert ae.stats.resyncs == {"w": 1} and ae.stats.mismatches == 1 and ae.stats.checks == 2


def test_trust_rules_precision_stream_and_decay() -> None:
    book = TrustBook(TrustSettings(min_precision=0.5, min_predicted_tokens=100, halflife=10))
    # per request min(predicted, reported): an under-claim does not hide an over-claim
    assert book.observe("a", 100, 0, 0.0) == 0
    assert book.observe("a", 0, 100, 0.0) == 0
    assert book.observe("b", 64, 80, 0.0) == 64
    assert book.observe("c", 500, 0, 0.0) == 0  # never reported a cached token: not judged
    why = book.update({"d": "stream_gap"}, 0.0)
    assert why == {"a": "precision 0.00 < 0.50", "d": "stream_gap"}
    assert book.untrusted == {"a", "d"}
    assert book.precision("b", 0.0) == 1.0
    # evidence fades: after a few half-lives "a" is below min_predicted_tokens, tried again
    assert book.update({}, 20.0) == {}


def test_router_ignores_the_index_of_untrusted_workers() -> None:
    index = ShadowIndex()
    router = Router(make_policy("prefix"), 16, index=index, speculate=False)
    for w in ("w0", "w1"):
        router.add_worker(w)
        index.add_worker(w)
    keys = [11, 12, 13, 14]
    index.stored("w1", None, keys)
    assert router.route(keys, 64 + 1, 0.0).worker == "w1"
    d = router.route(keys, 64 + 1, 0.0, untrusted={"w1"})
    assert d.matched_tokens == 0  # no worker's match is believed: by load alone


# -- live: a silently lost store and removal, healed within one period ----------------------


def _workers(url: str) -> list[dict[str, object]]:
    req = urllib.request.Request(url + "/workers", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return list(json.loads(resp.read())["workers"])


@pytest.mark.timeout(120)
@pytest.mark.alone
def test_lost_store_and_removal_are_found_and_healed_within_one_period(tmp_path: Path) -> None:
    period = 1.0
    cfg = StackConfig(
        workers=2,
        speedup=20,
        log_dir=tmp_path,
        agent_args=["--set", f"digest_interval={period}"],
    )
    with Stack(cfg) as stack:
        stack.wait_ready()
        client = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="x")
        failed = 0

        def ask(i: int) -> None:
            nonlocal failed
            try:
                client.chat.completions.create(
                    model=cfg.model,
                    messages=[{"role": "user", "content": f"conversation {i} " + "word " * 80}],
                    max_tokens=4,
                )
            except openai.OpenAIError:
                failed += 1

        for i in range(6):
            ask(i)
        assert wait_for(lambda: not stack.diverged(), 10) is not None
        wid = stack.worker_id(0)
        r = redis.Redis.from_url(stack.redis_url)
        stream = RedisLayout().stream(wid)
        # the agent is idle: its next entry would be last + 1; write that seq ourselves, so
        # nothing looks missing, holding one store the worker never made and one removal of a
        # key it holds (a lost removal and a lost store, as the index sees them)
        held = stack.index()[wid]["blocks"]
        assert held > 0
        assert wait_for(lambda: len(_snapshot_keys(r, wid)) >= held, 10) is not None
        keys = _snapshot_keys(r, wid)

        def inject() -> bool:
            _, fields = r.xrevrange(stream, count=1)[0]
            last = decode_entry(fields[ENTRY_FIELD])
            crafted = Entry(
                1, last.epoch, last.seq + 1, 0.0, time.time(), [],
                [Stored(keys[0], [0xDEADBEEF]), Removed([keys[-1]])],
            )  # fmt: skip
            r.xadd(stream, {ENTRY_FIELD: encode_entry(crafted)})
            # the agent's own entry may have taken that seq first: then ours is a duplicate
            return wait_for(lambda: wid in stack.diverged(), 0.5, step=0.01) is not None

        assert any(inject() for _ in range(5))
        injected = time.monotonic()

        seen_untrusted: list[object] = []

        def healed() -> bool:
            for w in _workers(stack.gateway_urls[0]):
                if w["worker_id"] == wid and not w["trusted"]:
                    seen_untrusted.append(w["why"])
            return (
                not stack.diverged() and stack.metric_sum("kvroute_antientropy_resyncs_total") >= 1
            )

        took = wait_for(healed, 2 * period + 3, step=0.01)
        assert took is not None, stack.diverged()
        assert time.monotonic() - injected <= 2 * period + 1.5  # one period (+ a snapshot)
        for i in range(6, 12):  # routing still works, nothing failed
            ask(i)
        assert failed == 0
        assert stack.metric_sum("kvroute_antientropy_mismatches_total") >= 1
        log = (
            (tmp_path / "gateway-0.log").read_text()
            if (tmp_path / "gateway-0.log").exists()
            else ""
        )
        assert seen_untrusted or "digest_mismatch" in log, "never shown untrusted"
        assert all(w["trusted"] for w in _workers(stack.gateway_urls[0]))


def _snapshot_keys(r: redis.Redis, wid: str) -> list[int]:
    """The worker's keys in its latest snapshot, parent-first."""
    data = r.get(RedisLayout().snapshot(wid))
    if data is None:
        return []
    return [k for _, chain in decode_snapshot(data).chains for k in chain]


def _reference_digest(keys: set[int]) -> str:
    """The digest's definition, one key at a time (what agents of every version compute)."""
    h = hashlib.sha256()
    for k in sorted(keys):
        h.update(k.to_bytes(8, "little"))
    return h.hexdigest()[:32]


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=2**64 - 1), max_size=300), st.randoms())
def test_the_key_digest_is_its_definition_whatever_the_order_or_container(
    keys: set[int], rnd: Any
) -> None:
    """The vectorised digest equals the per-key definition (sorted, 8 bytes little-endian,
    sha256) for any set of 64-bit keys, given as a set, a shuffled list or a tuple."""
    want = _reference_digest(keys)
    shuffled = list(keys)
    rnd.shuffle(shuffled)
    assert key_digest(keys) == key_digest(shuffled) == key_digest(tuple(shuffled)) == want


def test_the_key_digest_refuses_keys_outside_64_bits() -> None:
    for bad in ([-1], [2**64], [1, 2**70]):
        with pytest.raises(OverflowError):
            key_digest(bad)
