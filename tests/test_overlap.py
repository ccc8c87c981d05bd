"""Routing a completion prompt on its known first ids while the rest is encoded (``Pool.prepare``
with ``overlap``): the ids, keys, count and speculative insert end up exactly those of a prompt
encoded first, and the exact ids still decide the errors."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator

import pytest
import tokenizers

from gateway.config import PoolSettings
from gateway.errors import ApiError
from gateway.pool import Pool, Prepared
from gateway.requests import ClientRequest, parse_body
from gateway.routing.index import ShadowIndex
from gateway.routing.policy import Decision
from gateway.tokenization import bundled_test_tokenizer

PATH = bundled_test_tokenizer()
WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega"]
DOCUMENT = "".join(" " + WORDS[(i * 7) % 6] + ("s" if i % 3 == 0 else "") for i in range(6000))
QUESTION = " Why is beta here at all? " + " ".join(["gamma", "delta"] * 80)
BS = 16


@pytest.fixture(scope="module")
def plain() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(PATH))


def make_pool(**kw: object) -> Pool:
    settings = PoolSettings("m", str(PATH), chat_template="deepseek-v3", block_size=BS, **kw)  # type: ignore[arg-type]
    pool = Pool(settings, ShadowIndex(speculative_ttl=60.0), "seed")
    for w in ("w0", "w1"):
        pool.router.add_worker(w)
    return pool


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = make_pool()
    yield p
    p.tokenizer.close()


async def route_while_encoded(pool: Pool, prep: Prepared, now: float) -> Decision:
    """Route ``prep`` on its known ids as the proxy does, then wait for the exact ones."""
    decision = pool.router.route(prep.keys, prep.prompt_tokens, now)
    prep.routes.append((decision, now))
    pool.settle(prep)
    await prep.ready()
    return decision


def holds_all(pool: Pool, worker: str, keys: list[int]) -> bool:
    """``worker`` holds (or is attributed) every block of ``keys``."""
    masks = pool.router.index.match_masks(keys)
    return (
        bool(masks)
        and masks[0][0] == len(keys)
        and bool(masks[0][1] & pool.router.index.bit(worker))
    )


def completion(prompt: str, max_tokens: int = 16) -> ClientRequest:
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens}).encode()
    return parse_body(raw, "completion")


def test_an_overlapped_prompt_ends_with_the_exact_ids_keys_and_speculation(
    pool: Pool, plain: tokenizers.Tokenizer
) -> None:
    async def run() -> None:
        await pool.prepare(completion(DOCUMENT + " What is alpha?"), overlap=False)  # caches
        prompt = DOCUMENT + QUESTION
        exact = plain.encode(prompt).ids
        prep = await pool.prepare(completion(prompt), overlap=True)
        assert prep.pending, "a new question under a cached document is routed at once"
        known = len(prep.ids)
        assert known < len(exact) and list(prep.ids) == exact[:known]
        assert abs(prep.prompt_tokens - len(exact)) < 0.01 * len(exact)  # an estimate
        decision = await route_while_encoded(pool, prep, 1.0)
        assert not prep.pending and prep.error is None
        assert list(prep.ids) == exact and prep.prompt_tokens == len(exact)
        full = pool.keyer.keys(exact)
        assert prep.keys.all() == full
        assert holds_all(pool, decision.worker, full)  # the rest speculated there too

    asyncio.run(run())


def test_what_overlaps_and_what_is_encoded_first(pool: Pool, plain: tokenizers.Tokenizer) -> None:
    async def run() -> None:
        # nothing cached and no worker holds a block of it: routed on its first piece's ids
        # (``tokenize_overlap_cold``), which no longer prompt can extend a match past
        cold_prompt = DOCUMENT + " What is alpha?"
        cold = await pool.prepare(completion(cold_prompt), overlap=True)
        assert cold.pending and 16 <= len(cold.ids) < 1000
        assert list(cold.ids) == plain.encode(cold_prompt).ids[: len(cold.ids)]
        decision = await route_while_encoded(pool, cold, 1.0)
        exact = plain.encode(cold_prompt).ids
        assert list(cold.ids) == exact and cold.prompt_tokens == len(exact)
        assert holds_all(pool, decision.worker, pool.keyer.keys(exact))
        prompt = DOCUMENT + QUESTION
        off = await pool.prepare(completion(prompt), overlap=False)
        assert off.rest is None and len(off.ids) == off.prompt_tokens
        again = await pool.prepare(completion(prompt), overlap=True)
        assert again.rest is None  # every piece cached now: nothing to wait for
        # new text that is most of the prompt, after known ids a worker holds all of (a
        # prefix every request shares): its first pieces are encoded here until the index's
        # match stops inside the known ids, then it is routed on them while the rest is
        # encoded; the match on them is the match on the whole prompt
        shared = DOCUMENT[:3000] + QUESTION * 3
        held_part = pool.keyer.keys(plain.encode(DOCUMENT[:3000]).ids)[:-1]
        assert holds_all(pool, decision.worker, held_part)
        index = pool.router.index
        short = await pool.prepare(completion(shared), overlap=True)
        assert short.pending and short.rest is not None
        exact = plain.encode(shared).ids
        known = list(short.ids)
        assert len(known) > BS * len(held_part) and known == exact[: len(known)]
        on_known = index.match_masks(pool.keyer.keys(known))
        assert on_known[0][0] < len(known) // BS  # the match stops inside the known ids
        assert on_known == index.match_masks(pool.keyer.keys(exact))
        await route_while_encoded(pool, short, 2.0)
        assert list(short.ids) == exact and short.prompt_tokens == len(exact)
        assert short.keys.all() == pool.keyer.keys(exact)
        # a cold prompt whose first pieces a worker holds, as far as the loop looks
        # (``_CLOSE_PIECES``): encoded first (that worker's match may go on)
        pool.tokenizer.clear_cache()
        held_prompt = DOCUMENT + " Where is omega?"
        encoded = pool.tokenizer._chars_encoded
        held = await pool.prepare(completion(held_prompt), overlap=True)
        assert held.rest is None and list(held.ids) == plain.encode(held_prompt).ids
        # the first piece, encoded to look the index up, is not encoded again with the rest:
        # no more text encoded than with the rule off
        off_pool = make_pool(tokenize_overlap_cold=False)
        once = off_pool.tokenizer._chars_encoded
        await off_pool.prepare(completion(held_prompt), overlap=True)
        once = off_pool.tokenizer._chars_encoded - once
        off_pool.tokenizer.close()
        assert pool.tokenizer._chars_encoded - encoded == once > 0
        # an estimate past the context is checked exactly before anything is sent
        with pytest.raises(ApiError) as err:
            await pool.prepare(completion(DOCUMENT + QUESTION + " x", 10**6), overlap=True)
        assert err.value.code == "context_length_exceeded"

    asyncio.run(run())


def test_a_cold_prompt_is_routed_on_the_start_of_its_first_piece(
    plain: tokenizers.Tokenizer,
) -> None:
    """``tokenize_probe_chars``: a prompt no worker holds the start of is routed on the ids of
    its first ~200 characters; its first piece is encoded with the rest, off the loop, not
    here. Where a worker holds those first blocks, the whole piece is encoded here as before
    and the known ids reach past it; the decision's match is the exact ids' either way."""
    prompt = DOCUMENT + " What is alpha?"
    exact = plain.encode(prompt).ids
    whole = make_pool(tokenize_probe_chars=0)
    probed = make_pool()

    async def run() -> None:
        off = await whole.prepare(completion(prompt), overlap=True)
        piece = len(off.ids)  # the first piece's ids (and the BOS)
        counted = probed.tokenizer._chars_encoded
        cold = await probed.prepare(completion(prompt), overlap=True)
        assert cold.pending and probed.tokenizer._chars_encoded == counted  # nothing stored
        assert BS <= len(cold.ids) < piece // 2 and list(cold.ids) == exact[: len(cold.ids)]
        decision = await route_while_encoded(probed, cold, 1.0)
        assert decision.matched_tokens == 0
        assert list(cold.ids) == exact and cold.keys.all() == probed.keyer.keys(exact)
        assert holds_all(probed, decision.worker, probed.keyer.keys(exact))
        # a new prompt whose first block w1 holds, and only that: routed on the probe to w1
        # with the match it has on the exact ids
        other = QUESTION * 8
        ids = plain.encode(other).ids
        keys = probed.keyer.keys(ids)
        piece = len((await whole.prepare(completion(other), overlap=True)).ids)
        probed.router.index.stored("w1", None, keys[:1])
        prep = await probed.prepare(completion(other), overlap=True)
        assert prep.pending and BS <= len(prep.ids) < piece // 2
        assert probed.router.index.match_masks(probed.keyer.keys(list(prep.ids)))[0][0] == 1
        decision = await route_while_encoded(probed, prep, 2.0)
        assert decision.worker == "w1" and decision.matched_tokens == BS
        assert list(prep.ids) == ids
        # w0 holds more than a probe's blocks of a third prompt: its whole first piece is
        # encoded here, and the request routed on it
        third = QUESTION.replace("beta", "omega") * 8
        keys = probed.keyer.keys(plain.encode(third).ids)
        piece = len((await whole.prepare(completion(third), overlap=True)).ids)
        probed.router.index.stored("w0", None, keys[: piece // BS - 1])
        held = await probed.prepare(completion(third), overlap=True)
        assert held.pending and len(held.ids) == piece
        decision = await route_while_encoded(probed, held, 3.0)
        assert decision.worker == "w0" and decision.matched_tokens == (piece // BS - 1) * BS

    asyncio.run(run())
    whole.tokenizer.close()
    probed.tokenizer.close()


def test_overlap_settings_turn_it_off() -> None:
    for kw in ({"tokenize_overlap_chars": 0}, {"tokenize_thread_chars": 0}):
        p = make_pool(**kw)

        async def run(p: Pool = p) -> None:
            await p.prepare(completion(DOCUMENT + " What is alpha?"), overlap=True)
            prep = await p.prepare(completion(DOCUMENT + QUESTION), overlap=True)
            assert prep.rest is None

        asyncio.run(run())
        p.tokenizer.close()


def test_a_cold_prompt_is_encoded_first_with_tokenize_overlap_cold_off() -> None:
    p = make_pool(tokenize_overlap_cold=False)

    async def run() -> None:
        cold = await p.prepare(completion(DOCUMENT + " What is alpha?"), overlap=True)
        assert cold.rest is None and len(cold.ids) == cold.prompt_tokens

    asyncio.run(run())
    p.tokenizer.close()


def test_the_exact_ids_decide_the_context_check(plain: tokenizers.Tokenizer) -> None:
    """New text denser in tokens than the cached document: its estimate fits the context, its
    exact count does not, and ``ready`` raises the error a first encode would have raised."""
    dense = " " + " ".join(f"{n}🙂" for n in range(200))  # ~4 tokens per 3 characters
    prompt = DOCUMENT + dense
    exact = len(plain.encode(prompt).ids)
    p = make_pool(max_model_len=exact + 8, tokenize_overlap_fraction=0.5)

    async def run() -> None:
        await p.prepare(completion(DOCUMENT + " What is alpha?"), overlap=True)
        prep = await p.prepare(completion(prompt, max_tokens=16), overlap=True)
        assert prep.pending and prep.prompt_tokens + 16 <= exact + 8
        with pytest.raises(ApiError) as err:
            await prep.ready()
        assert err.value.code == "context_length_exceeded"
        assert f"({exact} in the messages" in err.value.message
        first = make_pool(max_model_len=exact + 8)
        with pytest.raises(ApiError) as direct:
            await first.prepare(completion(prompt, max_tokens=16))
        assert direct.value.message == err.value.message
        first.tokenizer.close()

    asyncio.run(run())
    p.tokenizer.close()


def test_text_the_tokenizer_rejects_is_a_400_after_overlap(pool: Pool) -> None:
    async def run() -> None:
        await pool.prepare(completion(DOCUMENT + " What is alpha?"), overlap=True)
        bad = DOCUMENT + QUESTION + " \ud800 lone"
        prep = await pool.prepare(completion(bad), overlap=True)
        assert prep.pending
        for _ in range(2):  # every caller of ``ready`` gets the error
            with pytest.raises(ApiError) as err:
                await prep.ready()
            assert err.value.status == 400 and err.value.code == "invalid_prompt"
            assert "surrogate" in err.value.message

    asyncio.run(run())


def test_only_clients_and_gateways_that_need_no_exact_count_first_overlap() -> None:
    """A token rate limit takes the exact count before the request is admitted, and the
    request log's decisions must replay on the exact keys: neither overlaps."""
    from types import SimpleNamespace

    from gateway.config import ApiKey
    from gateway.limits import TokenBucket
    from gateway.server import Gateway, _Client

    def client(tokens_per_s: float) -> _Client:
        return _Client(ApiKey("k"), TokenBucket(0.0, 0.0), TokenBucket(tokens_per_s, 1e6))

    for log, who, expected in (
        (None, None, True),
        (None, client(0.0), True),
        (None, client(1000.0), False),
        (object(), None, False),
    ):
        gw = SimpleNamespace(proxy=SimpleNamespace(request_log=log))
        assert Gateway._may_overlap(gw, who) is expected  # type: ignore[arg-type]


# -- chats: routed on the ids their previous turn left ---------------------------------------

SYSTEM = DOCUMENT[:12000]


def chat(messages: list[dict[str, str]], max_tokens: int = 16) -> ClientRequest:
    raw = json.dumps({"model": "m", "messages": messages, "max_tokens": max_tokens}).encode()
    return parse_body(raw, "chat")


def turns(n: int) -> list[dict[str, str]]:
    """A conversation under SYSTEM ending with its n-th question."""
    out = [{"role": "system", "content": SYSTEM}]
    for i in range(n):
        if i:
            out.append({"role": "assistant", "content": f"Answer {i}: {WORDS[i % 6]} it is."})
        out.append({"role": "user", "content": f"Question {i}: why {WORDS[(i + 2) % 6]}?"})
    return out


def exact_chat_ids(
    pool: Pool, plain: tokenizers.Tokenizer, messages: list[dict[str, str]]
) -> list[int]:
    """A full render and a plain HF encode: what every path must give."""
    text = pool.tokenizer.render_chat(messages)
    return list(plain.encode(text, add_special_tokens=False).ids)


def test_an_overlapped_chat_ends_with_the_exact_ids_keys_and_speculation(
    pool: Pool, plain: tokenizers.Tokenizer
) -> None:
    async def run() -> None:
        first = await pool.prepare(chat(turns(1)), overlap=True)
        # a new conversation, nothing cached and no worker holding any of it: rendered, then
        # routed on its first piece's ids as a cold completion prompt is
        assert first.pending and 0 < len(first.ids) < first.prompt_tokens
        await first.ready()
        assert list(first.ids) == exact_chat_ids(pool, plain, turns(1))
        for n in (2, 3, 4):
            messages = turns(n)
            exact = exact_chat_ids(pool, plain, messages)
            prep = await pool.prepare(chat(messages), overlap=True)
            assert prep.pending, "a known conversation's turn is routed before its render"
            known = len(prep.ids)
            assert BS <= known < len(exact) and list(prep.ids) == exact[:known]
            assert abs(prep.prompt_tokens - len(exact)) < 0.05 * len(exact)  # an estimate
            decision = await route_while_encoded(pool, prep, float(n))
            assert not prep.pending and prep.error is None
            assert list(prep.ids) == exact and prep.prompt_tokens == len(exact)
            full = pool.keyer.keys(exact)
            assert prep.keys.all() == full
            assert holds_all(pool, decision.worker, full)
        # a later turn's keys still start from the remembered turn's (no hashing from scratch)
        hits = pool.prefix_keys.hits
        prep = await pool.prepare(chat(turns(5)), overlap=True)
        assert prep.pending and pool.prefix_keys.hits == hits + 1
        await prep.ready()
        assert pool.prefix_keys.hits == hits + 2
        assert prep.keys.all() == pool.keyer.keys(exact_chat_ids(pool, plain, turns(5)))

    asyncio.run(run())


def test_an_overlapped_chats_match_is_measured_on_its_exact_ids(
    pool: Pool, plain: tokenizers.Tokenizer
) -> None:
    """The worker holds the previous turn whole (its last blocks past the remembered cut, and
    its reply): a decision on the known ids matches only as far as they go, and the match it
    reports once the exact ids are known is what the worker holds of them, as a decision on
    the exact ids would have said."""
    index = pool.router.index

    async def run() -> None:
        await (await pool.prepare(chat(turns(2)), overlap=True)).ready()
        # the engine computed turn 2 and its reply: all of turn 3's prompt but its question
        held = pool.keyer.keys(exact_chat_ids(pool, plain, turns(3))[:-12])
        index.stored("w0", None, held)
        prep = await pool.prepare(chat(turns(3)), overlap=True)
        assert prep.pending
        known = len(prep.keys)
        decision = await route_while_encoded(pool, prep, 1.0)
        assert decision.worker == "w0" and decision.matched_tokens == known * BS
        exact = prep.keys.all()
        common = next(i for i, (a, b) in enumerate(zip([*held, -1], exact, strict=False)) if a != b)
        assert common * BS > decision.matched_tokens  # more than the known ids reached
        assert prep.exact(decision).matched_tokens == common * BS
        assert prep.exact(decision).worker == "w0" and decision.matched_tokens < common * BS
        # a worker the decision did not choose is left as it was
        other = dataclasses.replace(decision, worker="w1")
        assert prep.exact(other) is other

    asyncio.run(run())


def test_a_chat_is_encoded_first_when_overlap_is_off_or_unsafe(
    plain: tokenizers.Tokenizer,
) -> None:
    for kw, overlap in (({"tokenize_overlap_chats": False}, True), ({}, False)):
        p = make_pool(**kw)

        async def run(p: Pool = p, overlap: bool = overlap) -> None:
            await p.prepare(chat(turns(1)), overlap=True)
            prep = await p.prepare(chat(turns(2)), overlap=overlap)
            assert prep.rest is None and len(prep.ids) == prep.prompt_tokens

        asyncio.run(run())
        p.tokenizer.close()
    p = make_pool()

    async def unsafe() -> None:
        await p.prepare(chat(turns(1)), overlap=True)
        # new text that may be most of the prompt, which a worker holds as far as the loop
        # looks (``_CLOSE_PIECES``): the decision on the known ids could miss much
        long = [*turns(2)[:-1], {"role": "user", "content": DOCUMENT[:20000]}]
        ids = exact_chat_ids(p, plain, long)
        p.router.index.stored("w0", None, p.keyer.keys(ids))
        assert (await p.prepare(chat(long), overlap=True)).rest is None
        # a bound past the context is checked exactly before anything is sent
        with pytest.raises(ApiError) as err:
            await p.prepare(chat(turns(2), max_tokens=10**6), overlap=True)
        assert err.value.code == "context_length_exceeded"

    asyncio.run(unsafe())
    p.tokenizer.close()


# the message count leads the render: no turn's text starts with the previous turn's
COUNTING = (
    "{{ bos_token }}{{ messages | length }} messages."
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def test_a_render_that_does_not_start_with_the_known_ids(plain: tokenizers.Tokenizer) -> None:
    """The guess is wrong: the keys, ids and speculation are those of the exact ids all the
    same, and a template whose guesses keep missing is no longer guessed for."""
    settings = PoolSettings("m", str(PATH), chat_template=COUNTING, block_size=BS)
    p = Pool(settings, ShadowIndex(speculative_ttl=60.0), "seed")
    for w in ("w0", "w1"):
        p.router.add_worker(w)

    async def run() -> None:
        await (await p.prepare(chat(turns(1)), overlap=True)).ready()
        wrong = 0
        for n in range(2, 9):
            messages = turns(n)
            exact = exact_chat_ids(p, plain, messages)
            prep = await p.prepare(chat(messages), overlap=True)
            # routed on a guess (the previous turn's ids: wrong here), or, rendered, on its
            # known first ids, or encoded first (little new text once the first is encoded)
            if prep.pending:
                wrong += list(prep.ids) != exact[: len(prep.ids)]
                decision = await route_while_encoded(p, prep, float(n))
                assert holds_all(p, decision.worker, p.keyer.keys(exact))
            assert list(prep.ids) == exact and prep.keys.all() == p.keyer.keys(exact)
        assert wrong == 3  # three misses, then the template is no longer guessed for

    asyncio.run(run())
    p.tokenizer.close()


def test_the_exact_ids_decide_a_chats_context_check(plain: tokenizers.Tokenizer) -> None:
    """Template text the bound does not foresee (a long note once a chat has four messages):
    the bound fits the context, the exact count does not, and ``ready`` raises the error a
    first encode would have raised."""
    note = "{% if messages | length > 3 %}" + " note" * 1000 + "{% endif %}"
    template = COUNTING.replace("{{ messages | length }} messages.", "") + note
    settings = PoolSettings("m", str(PATH), chat_template=template, block_size=BS)

    async def run() -> None:
        probe = Pool(settings, ShadowIndex(), "seed")
        exact = len(exact_chat_ids(probe, plain, turns(2)))
        probe.tokenizer.close()
        small = PoolSettings(
            "m", str(PATH), chat_template=template, block_size=BS, max_model_len=exact - 500
        )
        p = Pool(small, ShadowIndex(), "seed")
        p.router.add_worker("w0")
        await (await p.prepare(chat(turns(1), max_tokens=16), overlap=True)).ready()
        prep = await p.prepare(chat(turns(2), max_tokens=16), overlap=True)
        assert prep.pending and prep.prompt_tokens + 16 <= exact - 500
        with pytest.raises(ApiError) as err:
            await prep.ready()
        assert err.value.code == "context_length_exceeded"
        assert f"({exact} in the messages" in err.value.message
        with pytest.raises(ApiError) as direct:
            await p.prepare(chat(turns(2), max_tokens=16))
        assert direct.value.message == err.value.message
        p.tokenizer.close()

    asyncio.run(run())


# -- chats with a long new message: rendered, then routed like a completion prompt ---------

#: a retrieved document no worker has seen (other words than DOCUMENT's, so no piece is shared)
RETRIEVED = "".join(
    " " + WORDS[(i * 5 + 1) % 6] + ("ed" if i % 4 == 0 else "") for i in range(2000)
)


def rag(question: str, document: str = RETRIEVED) -> list[dict[str, str]]:
    """A new conversation under SYSTEM whose message carries a document."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Context:{document}\n\nQuestion: {question}"},
    ]


def test_a_chat_with_a_long_new_message_is_routed_on_its_known_ids(
    pool: Pool, plain: tokenizers.Tokenizer
) -> None:
    """A new conversation under a system prompt every worker holds, its message a document
    seen nowhere: rendered, its first new piece encoded here, routed on the known ids once
    the index's match stops inside them (the decision on them is the decision on all of
    them), the rest encoded while the request is on its way; the ids, keys, count,
    speculation and forwarded body end as a first encode's."""
    index = pool.router.index

    async def run() -> None:
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
        await pool.prepare(chat(first), overlap=False)  # the system prompt is remembered
        system = pool.keyer.keys(exact_chat_ids(pool, plain, first))[:-1]
        for w in ("w0", "w1"):
            index.stored(w, None, system)
        messages = rag("Why alpha?")
        exact = exact_chat_ids(pool, plain, messages)
        hits = pool.prefix_keys.hits
        prep = await pool.prepare(chat(messages), overlap=True)
        assert prep.pending, "a document under a held system prompt is routed at once"
        known = list(prep.ids)
        assert BS * len(system) < len(known) < len(exact) - 1000  # the document's first piece
        assert known == exact[: len(known)]
        assert pool.prefix_keys.hits == hits + 1  # the system prompt's keys, not hashed again
        on_known = index.match_masks(pool.keyer.keys(known))
        assert on_known[0][0] < len(known) // BS  # the match stops inside the known ids
        assert on_known == index.match_masks(pool.keyer.keys(exact))
        assert abs(prep.prompt_tokens - len(exact)) < 0.1 * len(exact)  # an estimate
        decision = await route_while_encoded(pool, prep, 1.0)
        assert decision.matched_tokens == BS * len(system)
        assert not prep.pending and prep.error is None
        assert list(prep.ids) == exact and prep.prompt_tokens == len(exact)
        full = pool.keyer.keys(exact)
        assert prep.keys.all() == full
        assert holds_all(pool, decision.worker, full)  # the document speculated there too
        direct = await pool.prepare(chat(messages), overlap=False)
        assert prep.body == direct.body and list(direct.ids) == exact
        # the next turn starts from the remembered system prompt and the document's cached
        # pieces: only its new text is encoded (short: on the loop, before it is routed)
        nxt = [*messages, {"role": "assistant", "content": "Because."}]
        nxt.append({"role": "user", "content": "And beta?"})
        before = pool.tokenizer._chars_encoded
        turn = await pool.prepare(chat(nxt), overlap=True)
        assert turn.rest is None and list(turn.ids) == exact_chat_ids(pool, plain, nxt)
        assert 0 < pool.tokenizer._chars_encoded - before < 200

    asyncio.run(run())


def test_an_agent_turn_with_a_long_tool_output_goes_to_its_conversations_worker(
    pool: Pool, plain: tokenizers.Tokenizer
) -> None:
    """A known conversation's next turn whose new text is most of it (a tool's long output):
    not routed on the previous turn's ids (the new text is too large a part), but rendered,
    routed on its known ids once the match stops inside the output, to the worker holding
    the conversation, with its whole match; the exact ids follow."""
    index = pool.router.index

    async def run() -> None:
        await (await pool.prepare(chat(turns(2)), overlap=True)).ready()
        index.stored("w1", None, pool.keyer.keys(exact_chat_ids(pool, plain, turns(2))))
        index.stored("w0", None, pool.keyer.keys(exact_chat_ids(pool, plain, turns(1))))
        tool = [*turns(2), {"role": "assistant", "content": "Let me look."}]
        tool.append({"role": "user", "content": "Tool output:" + RETRIEVED * 2})
        exact = exact_chat_ids(pool, plain, tool)
        known = pool.tokenizer.known_chat(pool.tokenizer.draft_chat(tool))
        assert known is not None and not pool._chat_overlaps(known, 16)  # too much new text
        prep = await pool.prepare(chat(tool), overlap=True)
        assert prep.pending and list(prep.ids) == exact[: len(prep.ids)]
        held = len(pool.keyer.keys(exact_chat_ids(pool, plain, turns(2))))
        decision = await route_while_encoded(pool, prep, 1.0)
        assert decision.worker == "w1" and decision.matched_tokens >= (held - 1) * BS
        assert list(prep.ids) == exact and prep.keys.all() == pool.keyer.keys(exact)
        assert holds_all(pool, "w1", pool.keyer.keys(exact))

    asyncio.run(run())


def test_a_long_message_a_worker_holds_is_encoded_first(plain: tokenizers.Tokenizer) -> None:
    """The document's first pieces are held by a worker as far as the loop looks: its match
    may go on past them, so the chat is encoded before it is routed; likewise with the
    settings that turn the overlap off."""
    for kw, held in (({}, True), ({"tokenize_overlap_chats": False}, False)):
        p = make_pool(**kw)

        async def run(p: Pool = p, held: bool = held) -> None:
            messages = rag("Why kappa?")
            exact = exact_chat_ids(p, plain, messages)
            if held:
                p.router.index.stored("w1", None, p.keyer.keys(exact))
            prep = await p.prepare(chat(messages), overlap=True)
            assert prep.rest is None and list(prep.ids) == exact
            assert prep.prompt_tokens == len(exact) and prep.keys.all() == p.keyer.keys(exact)
            if held:
                decision = p.router.route(prep.keys, prep.prompt_tokens, 1.0)
                assert decision.worker == "w1" and decision.matched_tokens >= len(exact) - BS

        asyncio.run(run())
        p.tokenizer.close()


def test_the_exact_ids_decide_a_long_messages_context_check(plain: tokenizers.Tokenizer) -> None:
    """Text far denser in tokens than what the tokenizer has seen (the estimate's ratio): the
    estimate fits the context, the exact count does not; ``ready`` raises the error that a
    first encode raises."""
    dense = "".join(chr(0x4E00 + (i * 37) % 900) for i in range(3000))
    messages = rag("Why?", dense)

    async def run() -> None:
        probe = make_pool()
        exact = len(exact_chat_ids(probe, plain, messages))
        probe.tokenizer.close()
        p = make_pool(max_model_len=exact - 16)
        await p.prepare(chat(turns(1)), overlap=True)  # a ratio from plain words
        prep = await p.prepare(chat(messages, max_tokens=8), overlap=True)
        assert prep.pending and prep.prompt_tokens + 8 <= exact - 16
        with pytest.raises(ApiError) as err:
            await prep.ready()
        assert err.value.code == "context_length_exceeded"
        with pytest.raises(ApiError) as direct:
            await p.prepare(chat(messages, max_tokens=8))
        assert direct.value.message == err.value.message
        p.tokenizer.close()

    asyncio.run(run())
