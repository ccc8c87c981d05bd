"""The simulator as DeepSeek-class and hybrid models make the engines publish KV events:

* vLLM KV-cache groups (``cache.kv_groups``): every store and removal once per group with
  the same hashes, and sliding-window/Mamba groups dropping blocks outside their window
  early, so a consumer keying blocks by hash alone loses blocks the full group still holds;
* SGLang EAGLE/MTP bigram keys (``cache.bigram_keys``): a radix tree over token pairs that
  reuses at most N-2 positions of an N-token prompt, and ``token_ids`` published as pairs
  hashed as SGLang hashes them.

Expected values are computed here independently of the encoder (SHA-256 over the pairs,
pickle-SHA-256 for vLLM, a brute-force reference model of bigram matching), plus a test
vector produced by running SGLang 0.5.23's own event recorder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_enginesim_events import ChainChecker, decode_batch, ref_vllm_hash

from gateway.contract.settings import ConfigError
from loadtest.enginesim.config import (
    KV_GROUP_PRESETS,
    CacheConfig,
    EventsConfig,
    KvGroup,
    SchedulerConfig,
    SimConfig,
    load_sim_config,
)
from loadtest.enginesim.events import EventEncoder, WireFormat
from loadtest.enginesim.kvcache import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVEvent,
    bigram_atoms,
    pack_tokens,
)
from loadtest.enginesim.scheduler import EngineCore
from loadtest.enginesim.timing import timing_model

GPT_OSS_SMALL = (KvGroup("sliding_window", 9), KvGroup())  # window 9, blocks of 4: keep 2

# -- configuration ---------------------------------------------------------------------------


def test_kv_groups_load_from_yaml(tmp_path: Path) -> None:
    f = tmp_path / "sim.yaml"
    f.write_text(
        "flavor: vllm\n"
        "cache:\n"
        "  kv_groups:\n"
        "    - {kind: sliding_window, sliding_window: 128}\n"
        "    - kind: full_attention\n"
    )
    cfg = load_sim_config(f, env={})
    assert cfg.cache.kv_groups == KV_GROUP_PRESETS["gpt-oss"]
    assert WireFormat.for_sim(cfg).kv_groups == tuple(KV_GROUP_PRESETS["gpt-oss"])


def test_kv_groups_load_from_the_environment() -> None:
    env = {"KVROUTE_SIM_CACHE__KV_GROUPS": "[{kind: mla_attention}]"}
    assert load_sim_config(env=env).cache.kv_groups == [KvGroup("mla_attention")]
    env = {
        "KVROUTE_SIM_CACHE__KV_GROUPS__0__KIND": "sliding_window_mla",
        "KVROUTE_SIM_CACHE__KV_GROUPS__0__SLIDING_WINDOW": "64",
    }
    assert load_sim_config(env=env).cache.kv_groups == [KvGroup("sliding_window_mla", 64)]


@pytest.mark.parametrize("preset", sorted(KV_GROUP_PRESETS))
def test_every_preset_round_trips_through_yaml(preset: str, tmp_path: Path) -> None:
    groups = KV_GROUP_PRESETS[preset]
    data = {"cache": {"kv_groups": [dataclasses.asdict(g) for g in groups]}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    assert load_sim_config(tmp_path / "p.yaml", env={}).cache.kv_groups == groups


def test_presets_follow_vllm_group_order() -> None:
    assert KV_GROUP_PRESETS["deepseek-v3"] == [KvGroup("mla_attention")]
    assert KV_GROUP_PRESETS["gpt-oss"] == [KvGroup("sliding_window", 128), KvGroup()]
    gemma = KV_GROUP_PRESETS["gemma-3-27b"]
    assert gemma[:-1] == [KvGroup("sliding_window", 1024)] * 6 and gemma[-1] == KvGroup()
    assert CacheConfig().kv_groups == [KvGroup()] and not CacheConfig().bigram_keys


@pytest.mark.parametrize(
    ("env", "names"),
    [
        (
            {"KVROUTE_SIM_FLAVOR": "sglang", "KVROUTE_SIM_CACHE__KV_GROUPS": "[{kind: mamba}]"},
            "cache.kv_groups",
        ),
        ({"KVROUTE_SIM_CACHE__BIGRAM_KEYS": "true"}, "cache.bigram_keys"),
        ({"KVROUTE_SIM_CACHE__KV_GROUPS": "[{kind: sliding_window}]"}, "cache.kv_groups.0"),
        ({"KVROUTE_SIM_CACHE__KV_GROUPS": "[{kind: attention}]"}, "cache.kv_groups.0"),
        (
            {"KVROUTE_SIM_CACHE__KV_GROUPS": "[{kind: full_attention, sliding_window: 8}]"},
            "cache.kv_groups.0",
        ),
        ({"KVROUTE_SIM_CACHE__KV_GROUPS": "[]"}, "cache.kv_groups"),
    ],
)
def test_invalid_model_settings_are_config_errors(env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_sim_config(env=env)


def test_model_settings_are_per_engine_in_python_too() -> None:
    with pytest.raises(ConfigError, match=r"cache\.kv_groups"):
        SimConfig(flavor="sglang", cache=CacheConfig(kv_groups=[KvGroup("mla_attention")]))
    with pytest.raises(ConfigError, match=r"cache\.bigram_keys"):
        SimConfig(flavor="vllm", cache=CacheConfig(bigram_keys=True))
    with pytest.raises(ValueError):
        WireFormat("sglang", "map", 4, kv_groups=(KvGroup("mla_attention"),))
    with pytest.raises(ValueError):
        WireFormat("vllm", "map", 4, bigram=True)
    cfg = SimConfig(flavor="sglang", cache=CacheConfig(block_size=4, bigram_keys=True))
    assert WireFormat.for_sim(cfg).bigram and cfg.cache.atom_bytes == 8


# -- vLLM KV-cache groups ----------------------------------------------------------------------


def encode(fmt: WireFormat, events: list[KVEvent], enc: EventEncoder | None = None) -> list[Any]:
    enc = enc or EventEncoder(fmt)
    _, decoded, _ = decode_batch(enc.encode(events, 1.0), fmt.engine, fmt.encoding)
    return decoded


def stores(decoded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in decoded if e["type"] == "BlockStored"]


def removals(decoded: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    out = []
    for e in decoded:
        if e["type"] == "BlockRemoved":
            assert len(e["block_hashes"]) == 1  # vLLM: one event per hash
            out.append((e["group_idx"], e["block_hashes"][0]))
    return out


def chain_hashes(tokens: list[int], bs: int, parent: bytes | None = None) -> list[int]:
    out = []
    for i in range(0, len(tokens) - bs + 1, bs):
        parent = ref_vllm_hash(parent, tokens[i : i + bs])
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


class HashKeyed:
    """A consumer that keys blocks by hash alone (wrong for hybrid models) and one that keys
    them by (group, hash)."""

    def __init__(self) -> None:
        self.by_hash: set[Any] = set()
        self.by_group: set[tuple[int, Any]] = set()

    def apply(self, decoded: list[dict[str, Any]]) -> None:
        for e in decoded:
            if e["type"] == "BlockStored":
                self.by_hash.update(e["block_hashes"])
                self.by_group.update((e["group_idx"], h) for h in e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    self.by_hash.discard(h)
                    key = (e["group_idx"], h)
                    assert key in self.by_group, f"removal of {key} never stored"
                    self.by_group.remove(key)
            else:
                self.by_hash.clear()
                self.by_group.clear()

    def group(self, g: int) -> set[Any]:
        return {h for gi, h in self.by_group if gi == g}


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_each_store_is_published_per_group_with_the_same_hashes(encoding: str) -> None:
    fmt = WireFormat("vllm", encoding, 4, kv_groups=GPT_OSS_SMALL)  # type: ignore[arg-type]
    toks = list(range(1, 21))
    decoded = encode(fmt, [BlocksStored([10, 11, 12, 13, 14], None, pack_tokens(toks))])
    sw, full = stores(decoded)
    hashes = chain_hashes(toks, 4)
    for g, ev in enumerate((sw, full)):
        assert ev["group_idx"] == g
        assert ev["block_hashes"] == hashes  # no group id in vLLM's hash
        assert ev["token_ids"] == toks and ev["block_size"] == 4
        assert ev["parent_block_hash"] is None and ev["extra_keys"] == [None] * 5
        ChainChecker("vllm", 4).apply(ev)
    assert sw["kv_cache_spec_kind"] == "sliding_window"
    assert sw["kv_cache_spec_sliding_window"] == 9
    assert full["kv_cache_spec_kind"] == "full_attention"
    if encoding == "map":
        assert "kv_cache_spec_sliding_window" not in full  # None is omitted
    else:
        assert full["kv_cache_spec_sliding_window"] is None
    # window 9 over blocks of 4: the SW group needs the last ceil(8/4) = 2 blocks; the three
    # before them are freed from that group at once, deepest first
    assert decoded[2:] and removals(decoded) == [(0, hashes[2]), (0, hashes[1]), (0, hashes[0])]


def test_sliding_window_group_drops_what_falls_out_of_the_window() -> None:
    fmt = WireFormat("vllm", "map", 4, kv_groups=GPT_OSS_SMALL)
    enc = EventEncoder(fmt)
    consumer = HashKeyed()
    toks = list(range(1, 29))
    h = chain_hashes(toks, 4)  # 7 blocks: ids 10..14, then 15..16 below 14

    consumer.apply(
        encode(fmt, [BlocksStored([10, 11, 12, 13, 14], None, pack_tokens(toks[:20]))], enc)
    )
    assert consumer.group(1) == set(h[:5]) and consumer.group(0) == set(h[3:5])
    # the hash-keyed consumer lost blocks the full-attention group still holds
    assert consumer.by_hash == set(h[3:5])

    # the chain grows: 14 and 13 fall out of the window now (stored before, removed now)
    decoded = encode(fmt, [BlocksStored([15, 16], 14, pack_tokens(toks[20:]))], enc)
    assert [e["block_hashes"] for e in stores(decoded)] == [h[5:7], h[5:7]]
    assert removals(decoded) == [(0, h[4]), (0, h[3])]
    consumer.apply(decoded)
    assert consumer.group(0) == set(h[5:7]) and consumer.group(1) == set(h)

    # a branch under an early-freed block frees nothing more (its blocks are in its window)
    decoded = encode(fmt, [BlocksStored([17], 12, pack_tokens([99, 98, 97, 96]))], enc)
    (hb,) = chain_hashes([99, 98, 97, 96], 4, parent=_digest(toks[:12]))
    assert [e["block_hashes"] for e in stores(decoded)] == [[hb], [hb]] and not removals(decoded)
    consumer.apply(decoded)

    # evictions: each group still holding a block publishes its removal, and only those
    decoded = encode(
        fmt, [BlocksRemoved([15, 16]), BlocksRemoved([13, 14]), BlocksRemoved([17])], enc
    )
    assert removals(decoded) == [
        (0, h[6]), (0, h[5]), (1, h[6]), (1, h[5]),  # in both groups
        (1, h[4]), (1, h[3]),  # the SW copies went earlier
        (0, hb), (1, hb),
    ]  # fmt: skip
    consumer.apply(decoded)
    assert consumer.group(0) == set() and consumer.group(1) == set(h[:3])
    decoded = encode(fmt, [AllBlocksCleared()], enc)
    assert [e["type"] for e in decoded] == ["AllBlocksCleared"]


def _digest(tokens: list[int]) -> bytes:
    """The vLLM chain digest of ``tokens``' last full block."""
    d = None
    for i in range(0, len(tokens) - 3, 4):
        d = ref_vllm_hash(d, tokens[i : i + 4])
    assert d is not None
    return d


def test_deepseek_publishes_one_mla_group() -> None:
    fmt = WireFormat("vllm", "map", 4, kv_groups=tuple(KV_GROUP_PRESETS["deepseek-v3"]))
    decoded = encode(fmt, [BlocksStored([1, 2, 3], None, pack_tokens(range(1, 13)))])
    (ev,) = decoded
    assert ev["kv_cache_spec_kind"] == "mla_attention" and ev["group_idx"] == 0
    assert "kv_cache_spec_sliding_window" not in ev
    assert ev["block_hashes"] == chain_hashes(list(range(1, 13)), 4)


def test_mamba_group_keeps_only_the_last_block() -> None:
    fmt = WireFormat("vllm", "array", 4, kv_groups=(KvGroup(), KvGroup("mamba")))
    toks = list(range(50, 66))
    decoded = encode(fmt, [BlocksStored([1, 2, 3, 4], None, pack_tokens(toks))])
    h = chain_hashes(toks, 4)
    full, mamba = stores(decoded)
    assert (full["group_idx"], mamba["group_idx"]) == (0, 1)
    assert mamba["kv_cache_spec_kind"] == "mamba" and mamba["kv_cache_spec_sliding_window"] is None
    assert removals(decoded) == [(1, h[2]), (1, h[1]), (1, h[0])]


def test_gemma3_every_sliding_group_frees_early() -> None:
    groups = tuple(KV_GROUP_PRESETS["gemma-3-1b"])  # 6 x window 512, then full
    fmt = WireFormat("vllm", "map", 16, kv_groups=groups)
    toks = [7 + i % 1000 for i in range(40 * 16)]
    decoded = encode(fmt, [BlocksStored(list(range(40)), None, pack_tokens(toks))])
    evs = stores(decoded)
    assert [e["group_idx"] for e in evs] == list(range(7))
    assert all(e["block_hashes"] == evs[0]["block_hashes"] for e in evs)
    assert [e.get("kv_cache_spec_sliding_window") for e in evs] == [512] * 6 + [None]
    # 512-token window, blocks of 16: keep ceil(511/16) = 32 of 40 blocks
    per_group = Counter(g for g, _ in removals(decoded))
    assert per_group == {g: 8 for g in range(6)}
    assert {h for _, h in removals(decoded)} == set(evs[0]["block_hashes"][:8])


def _links(store: dict[str, Any]) -> dict[Any, Any]:
    """Each hash of a ``BlockStored`` -> its parent's hash."""
    out, parent = {}, store.get("parent_block_hash")
    for h in store["block_hashes"]:
        out[h], parent = parent, h
    return out


def _depth(h: Any, parent_of: dict[Any, Any]) -> int:
    """The block's depth in its chain (0 at the root)."""
    d = 0
    while (h := parent_of.get(h)) is not None:
        d += 1
    return d


def _outside_window(cached: set[Any], parent_of: dict[Any, Any], keep: int) -> set[Any]:
    """Cached blocks with a cached descendant ``keep`` or more blocks deeper."""
    out: set[Any] = set()
    for h in cached:
        up = h
        for _ in range(keep):  # the ancestor ``keep`` blocks up, and all above it
            up = parent_of.get(up) if up is not None else None
        while up is not None and up not in out:
            out.add(up)
            up = parent_of.get(up)
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), window=st.integers(1, 20), mamba=st.booleans())
def test_grouped_events_stay_consistent_under_a_random_workload(
    seed: int, window: int, mamba: bool
) -> None:
    """Driven by the engine core (evictions included): no group removes a hash it does not
    hold, the full group always holds exactly the cached blocks, the early-freeing groups a
    subset of them, and every store is the same in every group. At the end, no early-freeing
    group holds a cached block that lies outside its window on a cached chain: one with a
    cached descendant ``keep`` or more blocks deeper, ``keep`` being the blocks its window
    covers (a block is never evicted before its descendants, so it was freed when that
    descendant's chain was stored and not stored again since)."""
    groups = (
        KvGroup("sliding_window", window),
        KvGroup(),
        KvGroup("mamba") if mamba else KvGroup("mla_attention"),
    )
    core = EngineCore(
        CacheConfig(kv_blocks=40, block_size=4),
        SchedulerConfig(max_num_batched_tokens=48),
        timing_model("mocker"),
        output_tokens=(3, 4),
    )
    enc = EventEncoder(WireFormat("vllm", "map", 4, kv_groups=groups))
    consumer = HashKeyed()
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 9) for _ in range(rng.randrange(0, 24))] for _ in range(3)]
    t = 0.0
    parent_of: dict[Any, Any] = {}  # block hash -> its parent's (None at the root)

    def publish(batch: list[KVEvent]) -> None:
        _, decoded, _ = decode_batch(enc.encode(batch, t), "vllm", "map")
        evs = stores(decoded)
        for i in range(0, len(evs), len(groups)):
            per_group = evs[i : i + len(groups)]
            assert [e["group_idx"] for e in per_group] == [0, 1, 2]
            common = [
                {k: v for k, v in e.items() if k[:3] not in ("gro", "kv_")} for e in per_group
            ]
            assert all(c == common[0] for c in common)
            parent_of.update(_links(per_group[1]))
        consumer.apply(decoded)

    def check() -> None:
        full = consumer.group(1)
        assert len(full) == core.cache.cached_blocks
        assert consumer.group(0) <= full and consumer.group(2) <= full
        if not mamba:  # MLA is a full-attention kind: it keeps everything
            assert consumer.group(2) == full

    for _ in range(25):
        t += rng.uniform(0.0, 0.08)
        for res in core.advance(t):
            publish(res.events)
        check()
        p = rng.choice(prefixes) + [rng.randrange(1, 9) for _ in range(rng.randrange(1, 20))]
        core.add_request(p, rng.randrange(1, 10), now=t)
    for res in core.advance(float("inf")):
        publish(res.events)
    check()
    full = consumer.group(1)
    early = [(0, -(-(window - 1) // 4))] + ([(2, 1)] if mamba else [])  # (group, keep)
    deepest = max((_depth(h, parent_of) for h in full), default=-1)
    for g, keep in early:
        outside = _outside_window(full, parent_of, keep)
        assert not outside & consumer.group(g), (g, keep)
        assert bool(outside) == (deepest >= keep)  # the check above is not vacuous
        if outside:
            assert consumer.group(g) < full
    assert core.reset_prefix_cache()
    publish(core.take_events())
    assert not consumer.by_group


# -- SGLang bigram keys ------------------------------------------------------------------------


def ref_bigram_hash(parent: bytes | None, pairs: list[list[int]]) -> bytes:
    """SGLang's page hash over bigrams: sha256(parent || t_j, t_j+1 as uint32 LE ...)."""
    words = [t for pair in pairs for t in pair]
    return hashlib.sha256((parent or b"") + struct.pack(f"<{len(words)}I", *words)).digest()


def public(d: bytes) -> int:
    return int.from_bytes(d[:8], "big", signed=True)


class BigramChecker:
    """Recomputes bigram page hashes from the published pairs and rebuilds each page's raw
    token path (the first elements, chained through parents)."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.digest: dict[int, bytes] = {}
        self.path: dict[int, list[int]] = {}  # hash -> raw tokens t_0.. up to the page's end + 1

    def apply(self, ev: dict[str, Any]) -> None:
        if ev["type"] == "AllBlocksCleared":
            self.digest.clear()
            self.path.clear()
            return
        if ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                del self.digest[h]
            return
        pairs, hashes = ev["token_ids"], ev["block_hashes"]
        assert ev["block_size"] == self.page and len(pairs) == self.page * len(hashes)
        assert all(isinstance(p, list) and len(p) == 2 for p in pairs)
        assert all(pairs[j][1] == pairs[j + 1][0] for j in range(len(pairs) - 1))  # overlap
        parent = ev["parent_block_hash"]
        prev = None if parent is None else self.digest[parent]
        path = [] if parent is None else self.path[parent][:-1]
        if path:
            assert pairs[0][0] == self.path[parent][-1]  # chains on from the parent's last pair
        for i, h in enumerate(hashes):
            page = pairs[i * self.page : (i + 1) * self.page]
            prev = ref_bigram_hash(prev, page)
            assert public(prev) == h
            self.digest[h] = prev
            path = path + [p[0] for p in page]
            self.path[h] = [*path, page[-1][1]]


def test_bigram_events_reproduce_sglang_0_5_23() -> None:
    """SGLang 0.5.23's recorder (run for the research notes), page size 4: tokens 101..109
    then a child node extending them by 201..204 published these hashes and pairs."""
    raw = [*range(101, 110), 201, 202, 203, 204]
    atoms = bigram_atoms(pack_tokens(raw))
    fmt = WireFormat("sglang", "map", 4, bigram=True)
    decoded = encode(
        fmt, [BlocksStored([0, 1], None, atoms[:64]), BlocksStored([2], 1, atoms[64:])]
    )
    first, child = decoded
    assert first["block_hashes"] + child["block_hashes"] == [
        6913447121781102366, 8107131609630134857, 7280987713151412170,
    ]  # fmt: skip
    assert first["token_ids"] + child["token_ids"] == [
        list(pair) for pair in itertools.pairwise(raw)
    ]
    assert first["block_size"] == child["block_size"] == 4
    assert child["parent_block_hash"] == first["block_hashes"][-1]
    plain = encode(WireFormat("sglang", "map", 4), [BlocksStored([0], None, pack_tokens(raw[:4]))])
    assert plain[0]["block_hashes"] == [6064031615711592133]  # the same page without bigrams


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_bigram_pairs_carry_the_cached_tokens(encoding: str) -> None:
    rng = random.Random(5)
    raw = [rng.randrange(0, 2**32) for _ in range(13)]  # 12 bigrams: 4 pages of 3
    atoms = bigram_atoms(pack_tokens(raw))
    fmt = WireFormat("sglang", encoding, 3, bigram=True)  # type: ignore[arg-type]
    decoded = encode(
        fmt,
        [
            BlocksStored([4, 5], None, atoms[:48]),
            BlocksStored([6, 7], 5, atoms[48:]),
            BlocksRemoved([6, 7]),
        ],
    )
    checker = BigramChecker(3)
    for ev in decoded:
        checker.apply(ev)
    evs = stores(decoded)
    assert len(evs) == (2 if encoding == "map" else 4)  # 0.5.15: one event per page
    pairs = [p for e in evs for p in e["token_ids"]]
    assert [p[0] for p in pairs] == raw[:12] and [p[1] for p in pairs] == raw[1:]
    hashes = [h for e in evs for h in e["block_hashes"]]
    d = None
    for i, h in enumerate(hashes):
        d = ref_bigram_hash(d, [[raw[j], raw[j + 1]] for j in range(3 * i, 3 * i + 3)])
        assert public(d) == h
    (rm,) = [e for e in decoded if e["type"] == "BlockRemoved"]
    assert rm["block_hashes"] == hashes[2:]


def bigram_core(bs: int, blocks: int = 4096, outputs: tuple[int, ...] = (1,)) -> EngineCore:
    return EngineCore(
        CacheConfig(kv_blocks=blocks, block_size=bs, bigram_keys=True),
        SchedulerConfig(),
        timing_model("mocker"),
        evict_whole_nodes=True,
        output_tokens=outputs,
    )


def run(core: EngineCore, tokens: list[int], max_tokens: int, t: float) -> Any:
    req, _ = run_events(core, tokens, max_tokens, t)
    return req


def run_events(
    core: EngineCore, tokens: list[int], max_tokens: int, t: float
) -> tuple[Any, list[KVEvent]]:
    req = core.add_request(tokens, max_tokens, now=t)
    events = [e for res in core.advance(float("inf")) for e in res.events]
    assert not core.has_work()
    return req, events


def test_bigram_cache_reuses_at_most_n_minus_2_positions() -> None:
    p = list(range(1, 10))  # 9 tokens: 8 bigrams, 2 pages of 4 cached
    bigram, plain = (
        bigram_core(4),
        EngineCore(CacheConfig(block_size=4), SchedulerConfig(), timing_model("mocker")),
    )
    for core in (bigram, plain):
        assert run(core, p, 1, 0.0).cached_tokens == 0
    assert bigram.cache.cached_blocks == 2 == plain.cache.cached_blocks
    # again: SGLang matches the bigrams of the first N-1 tokens (7 pairs): one page
    again = run(bigram, p, 1, 1.0)
    assert again.cached_tokens == bigram.lookup(p) == 4
    assert run(plain, p, 1, 1.0).cached_tokens == 8
    # one more token: 8 pairs to match, both pages reused
    assert bigram.lookup([*p, 77]) == 8
    assert bigram.stats.cache_hits == 4 and bigram.stats.prompt_tokens == 18


def test_bigram_page_is_not_reused_when_the_next_token_differs() -> None:
    core = bigram_core(4)
    p = list(range(1, 14))  # 12 pairs: 3 pages
    run(core, p, 1, 0.0)
    assert core.lookup([*p[:8], 50, 51, 52]) == 4  # page 1's last pair is (8, 9): 9 differs
    assert core.lookup(p[:4] + [50] * 8) == 0  # page 0 ends with pair (4, 5)
    assert core.lookup(p[:9] + [50] * 4) == 8
    plain = EngineCore(CacheConfig(block_size=4), SchedulerConfig(), timing_model("mocker"))
    run(plain, p, 1, 0.0)
    assert plain.lookup(p[:4] + [50] * 8) == 4  # plain keys do reuse it


def test_bigram_outputs_are_cached_as_pairs() -> None:
    core = bigram_core(4, outputs=(5, 6))
    p = list(range(1, 9))
    run(core, p, 9, 0.0)  # 8 + 8 tokens with KV: 15 pairs, 3 pages
    assert core.cache.cached_blocks == 3
    follow = p + core.output_token_ids(0, 9) + [7]
    assert core.lookup(follow) == 12
    assert core.allocator.num_free + core.cache.cached_blocks == core.allocator.num_blocks


def ref_bigram_match(seqs: list[list[int]], prompt: list[int], bs: int) -> int:
    """Positions an N-token prompt reuses: whole pages p whose bigrams (t_i, t_i+1), i < (p+1)
    * bs, are all those of one cached sequence, with at most N-2 positions."""
    limit = max(0, len(prompt) - 2) // bs
    best = 0
    for seq in seqs:
        pages = min((len(seq) - 1) // bs, limit)
        n = 0
        while n < pages and seq[: (n + 1) * bs + 1] == prompt[: (n + 1) * bs + 1]:
            n += 1
        best = max(best, n)
    return best * bs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bs=st.integers(1, 4),
    reqs=st.lists(
        st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=24), st.integers(1, 6)),
        min_size=1,
        max_size=12,
    ),
)
def test_bigram_matching_agrees_with_a_reference_model(
    bs: int, reqs: list[tuple[list[int], int]]
) -> None:
    core = bigram_core(bs, outputs=(2, 3))
    enc = EventEncoder(WireFormat("sglang", "map", bs, bigram=True))
    checker = BigramChecker(bs)
    seqs: list[list[int]] = []  # raw tokens with KV of every finished request
    for t, (prompt, max_tokens) in enumerate(reqs):
        want = ref_bigram_match(seqs, prompt, bs)
        assert core.lookup(prompt) == want
        req, events = run_events(core, prompt, max_tokens, float(t))
        assert req.cached_tokens == want <= max(0, len(prompt) - 2)
        seqs.append(prompt + core.output_token_ids(0, max_tokens - 1))
        # the events: pairs and hashes as SGLang's, for pages of the sequences cached
        _, decoded, _ = decode_batch(enc.encode(events, 0.0), "sglang", "map")
        for ev in decoded:
            assert ev["type"] == "BlockStored"  # the pool never fills here
            checker.apply(ev)
        assert len(checker.digest) == core.cache.cached_blocks
    for path in checker.path.values():  # every page's tokens are a cached sequence's prefix
        assert any(s[: len(path)] == path for s in seqs)


def test_bigram_cache_under_eviction_publishes_consistent_events() -> None:
    core = bigram_core(4, blocks=24, outputs=(9,))
    cfg = SimConfig(
        flavor="sglang",
        cache=CacheConfig(block_size=4, bigram_keys=True),
        events=EventsConfig(encoding="array"),
    )
    enc = EventEncoder(WireFormat.for_sim(cfg))
    checker = BigramChecker(4)
    rng = random.Random(3)
    shared = [rng.randrange(1, 5) for _ in range(10)]
    kinds: Counter[str] = Counter()
    t = 0.0
    for _ in range(40):
        t += 0.02
        for res in core.advance(t):
            _, decoded, _ = decode_batch(enc.encode(res.events, t), "sglang", "array")
            for ev in decoded:
                checker.apply(ev)
                kinds[ev["type"]] += 1
        core.add_request(
            shared + [rng.randrange(1, 5) for _ in range(rng.randrange(1, 30))],
            rng.randrange(1, 8),
            now=t,
        )
    for res in core.advance(float("inf")):
        _, decoded, _ = decode_batch(enc.encode(res.events, t), "sglang", "array")
        for ev in decoded:
            checker.apply(ev)
            kinds[ev["type"]] += 1
    assert kinds["BlockStored"] and kinds["BlockRemoved"]
    assert len(checker.digest) == core.cache.cached_blocks
    assert core.allocator.num_free + core.cache.cached_blocks == 24


def test_an_encoder_refuses_atoms_of_another_width() -> None:
    """Bigram atoms through a format without bigrams (or the reverse) would publish wrong
    tokens and hashes: it is an error, not a silent mismatch."""
    atoms = bigram_atoms(pack_tokens(range(1, 10)))  # 8 atoms: 2 pages of 4
    with pytest.raises(ValueError, match="for_sim"):
        EventEncoder(WireFormat("sglang", "map", 4)).encode(
            [BlocksStored([0, 1], None, atoms)], 1.0
        )
    with pytest.raises(ValueError, match="for_sim"):
        EventEncoder(WireFormat("sglang", "map", 4, bigram=True)).encode(
            [BlocksStored([0], None, pack_tokens(range(4)))], 1.0
        )
