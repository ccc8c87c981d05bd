"""gateway.tokenization.chunking: completion prompts and long chat pieces cut into chunks whose
ids are cached; ids identical to a plain encode for every text, a shared prefix paid once,
configurations where a cut could change the ids falling back to whole encodes."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, normalizers, pre_tokenizers, processors

from gateway.tokenization import TokenizationError, Tokenizer, bundled_test_tokenizer
from gateway.tokenization.chunking import Chunker, _outside_classes, safe_cut, unsafe_reason
from gateway.tokenization.splitter import splitting_config

PATH = bundled_test_tokenizer()
PROPERTY = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Characters and words around which pre-tokenizers cut differently.
ATOMS = [
    "a", "Z", "hello", " ", "  ", "\n", "\t", "'s", "'LL", "123", "4567", ".", ",", "!?",
    "é", "naïve", "日本", "テキスト", "🙂", "\u0301", "<｜User｜>", "<｜Assistant｜>", "\r\n",
    " world", " x", "-", "__",
]  # fmt: skip
texts = st.lists(st.sampled_from(ATOMS), max_size=60).map("".join)
# ... and with words between spaces often enough for safe cuts inside a chunk
worded = st.lists(st.sampled_from(ATOMS + ["word", " alpha", " beta", " gamma"] * 4), max_size=60)


@pytest.fixture(scope="module")
def plain() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(PATH))


def load(chunk_chars: int, **kw: Any) -> Tokenizer:
    return Tokenizer.load(PATH, "deepseek-v3", chunk_chars=chunk_chars, **kw)


@pytest.fixture(scope="module")
def small() -> Iterator[Tokenizer]:
    """Chunks of 4+ characters: a cut at nearly every chance."""
    tk = load(4, cache_tokens=300)
    yield tk
    tk.close()


# -- the chunker -------------------------------------------------------------------------------


@given(text=texts, size=st.integers(1, 12))
def test_chunks_cut_only_between_a_letter_and_a_space(text: str, size: int) -> None:
    chunks = Chunker(size).chunks(text)
    assert "".join(chunks) == text
    assert all(chunks) or chunks == [""]
    for before, after in itertools.pairwise(chunks):
        assert len(before) >= size
        assert before[-1].isascii() and before[-1].isalpha()
        assert after[0] == " " and after[1].isascii() and after[1].isalpha()


@given(text=texts, size=st.integers(1, 12), data=st.data())
def test_a_cut_depends_only_on_the_text_up_to_it(text: str, size: int, data: Any) -> None:
    """Texts sharing a prefix share every chunk that ends before the prefix's last character:
    what makes the chunks of a shared document hit the cache."""
    k = data.draw(st.integers(0, len(text)))
    full, short = Chunker(size).chunks(text), Chunker(size).chunks(text[:k])
    ended = 0
    for i, chunk in enumerate(full):
        ended += len(chunk)
        if ended >= k - 1:
            break
        assert short[i] == chunk


def test_chunk_size_is_checked() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Chunker(0)


# -- exact ids ---------------------------------------------------------------------------------


@PROPERTY
@given(parts=st.lists(texts, min_size=1, max_size=4), special=st.booleans())
def test_completion_ids_identical_to_a_plain_encode(
    small: Tokenizer, plain: tokenizers.Tokenizer, parts: list[str], special: bool
) -> None:
    """Prompts growing from a shared start (as requests sharing a document do), encoded through
    a tiny cache (evictions on the way): ids equal the plain encode's, sync and async."""
    prompt = ""
    for part in parts:
        prompt += part
        expected = plain.encode(prompt, add_special_tokens=special).ids
        assert small.encode(prompt, add_special_tokens=special) == expected
        assert asyncio.run(small.aencode(prompt, add_special_tokens=special)) == expected


@PROPERTY
@given(system=texts, user=texts)
def test_chat_ids_identical_with_chunked_pieces(
    small: Tokenizer, plain: tokenizers.Tokenizer, system: str, user: str
) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    text = small.render_chat(messages)
    assert small.encode_chat(messages) == plain.encode(text, add_special_tokens=False).ids


def test_shared_prefix_is_encoded_once(plain: tokenizers.Tokenizer) -> None:
    """A second prompt under the same 6,000-word document encodes about its own question only
    (what differs, plus the chunk it starts in), and its ids are exact."""
    tk = load(1024)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega"]
    document = "".join(" " + words[(i * 7) % 6] + ("s" if i % 3 == 0 else "") for i in range(6000))
    first, second = document + " What is alpha?", document + " Why is beta here at all?"
    assert tk.encode(first) == plain.encode(first).ids
    before = tk.stats.token_misses
    ids = tk.encode(second)
    assert ids == plain.encode(second).ids
    assert tk.stats.token_misses - before < 300 < len(ids) / 20


@PROPERTY
@given(parts=st.lists(texts, min_size=1, max_size=4), special=st.booleans())
def test_a_planned_prompt_knows_a_prefix_of_its_ids_and_finishes_exactly(
    small: Tokenizer, plain: tokenizers.Tokenizer, parts: list[str], special: bool
) -> None:
    """``plan_prompt``'s known ids (before the first uncached piece) are the first ids of the
    plain encode, its estimate is exact when nothing is missing, and finishing the plan on a
    worker thread gives the plain encode's ids."""
    prompt = ""
    for part in parts:
        prompt += part
        expected = plain.encode(prompt, add_special_tokens=special).ids
        planned = small.plan_prompt(prompt, add_special_tokens=special)
        assert planned is not None
        known = planned.known_ids()
        assert len(known) == planned.known and known == expected[: len(known)]
        if not planned.missing_chars:
            assert planned.estimate == len(expected) == planned.known
        ids = asyncio.run(small.aencode_planned(planned, thread=True))
        assert ids == expected


def test_a_new_question_under_a_cached_document_is_planned_from_the_document(
    plain: tokenizers.Tokenizer,
) -> None:
    """The gateway routes such a prompt on its known ids: they cover the document but its
    last chunk, the new text is a few hundred characters, and the estimate (the new text at the ratio of
    tokens to characters of what was encoded) is within 1% of the exact count."""
    tk = load(1024)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega"]
    document = "".join(" " + words[(i * 7) % 6] + ("s" if i % 3 == 0 else "") for i in range(6000))
    tk.encode(document + " What is alpha?")
    prompt = document + " Why is beta here at all? " + " ".join(["gamma"] * 100)
    planned = tk.plan_prompt(prompt)
    assert planned is not None
    expected = plain.encode(prompt).ids
    assert len(expected) - 300 < planned.known < len(expected) - 100
    assert planned.known_ids() == expected[: planned.known]
    assert 0 < planned.missing_chars < 2_000
    unknown = len(expected) - planned.known  # estimated at the document's ratio
    assert abs(planned.estimate - len(expected)) < min(unknown, 0.01 * len(expected))
    assert tk.encode_planned(planned) == expected
    with pytest.raises(TokenizationError, match="must be a string"):
        tk.plan_prompt(["not", "text"])  # type: ignore[arg-type]


def test_a_plan_with_its_first_piece_encoded_knows_past_it(plain: tokenizers.Tokenizer) -> None:
    """``encode_first_missing`` (the gateway encodes a piece to find where the index's match
    stops): the same cut, the known ids grow past the piece, that piece is cached and no
    longer missing, nothing is looked up again (the cache's hit counts stay), and the plan
    still finishes exactly."""
    tk = load(1024)
    head = "".join(f" head{i % 7}" for i in range(300))
    tk.encode(head + " first question")
    prompt = head + "".join(f" new{i % 11}" for i in range(2000))
    planned = tk.plan_prompt(prompt)
    assert planned is not None and planned.missing_chars > 4_000
    first = planned.first_missing()
    assert first is not None
    hits = tk.stats.token_hits
    again = tk.encode_first_missing(planned)
    expected = plain.encode(prompt).ids
    assert again.plan.items is planned.plan.items  # the same cut, not cut again
    assert again.known > planned.known and again.known_ids() == expected[: again.known]
    assert first not in again.plan.missing and again.first_missing() != first
    assert again.missing_chars == planned.missing_chars - len(first)
    assert tk.stats.token_hits == hits
    assert tk.plan_prompt(first, add_special_tokens=False).missing_chars == 0  # cached
    assert tk.encode_planned(again) == expected
    done = tk.plan_prompt(prompt)
    assert done is not None and done.first_missing() is None
    with pytest.raises(ValueError, match="no uncached piece"):
        tk.encode_first_missing(done)


@pytest.fixture(scope="module")
def wide() -> Iterator[Tokenizer]:
    """Chunks of 48+ characters: pieces long enough to probe inside."""
    tk = load(48, cache_tokens=2000)
    yield tk
    tk.close()


@PROPERTY
@given(parts=st.lists(worded.map("".join), min_size=1, max_size=3), chars=st.integers(1, 40))
def test_a_probe_knows_a_prefix_of_the_ids_past_the_known_ones(
    wide: Tokenizer, plain: tokenizers.Tokenizer, parts: list[str], chars: int
) -> None:
    """``probe_ids`` (the gateway routes a cold prompt on the start of its first uncached
    piece): the known ids and that start's ids are a prefix of the exact ids, the start ends
    at the piece's first safe cut at or after ``chars``, and nothing is cached or counted."""
    small = wide
    prompt = "".join(parts)
    small.encode(parts[0] + " cached")  # some pieces known, so the probe follows them
    planned = small.plan_prompt(prompt)
    if planned is None or planned.first_missing() is None:
        return
    first = planned.first_missing()
    assert first is not None
    counted = small._chars_encoded
    ids = small.probe_ids(planned, chars)
    cut = safe_cut(first, chars)
    if cut == -1:
        assert ids is None
        return
    assert ids is not None and small._chars_encoded == counted
    expected = plain.encode(prompt).ids
    assert ids == expected[: len(ids)] and len(ids) >= planned.known
    assert ids[planned.known :] == plain.encode(first[:cut], add_special_tokens=False).ids
    assert small.plan_prompt(prompt) == planned  # nothing cached by the probe


def test_a_safe_cut_is_the_chunkers() -> None:
    text = "ab 12 c d  e f"
    assert [safe_cut(text, i) for i in (1, 3, 7, 9, 12)] == [7, 7, 7, 12, 12]
    assert safe_cut(text, 13) == -1 and safe_cut("a b", 1) == 1
    assert Chunker(1).chunks(text) == ["ab 12 c", " d  e", " f"]


def _letters(i: int) -> str:
    """``i`` spelled in letters (a distinct word ending per number)."""
    return chr(97 + i % 26) + chr(97 + i // 26 % 26) + chr(97 + i // 676 % 26)


def test_a_chats_plan_finishes_as_its_encode(plain: tokenizers.Tokenizer) -> None:
    """``plan_chat`` (a rendered chat, its remembered prefix reused, the rest cut and looked
    up): its known ids are a prefix of the exact ids before and after pieces are encoded one
    by one, it finishes to the full render's ids, and the conversation is remembered as
    ``aencode_draft`` remembers it (the next turn reuses it)."""
    tk = load(1024)
    # letters only, so the chunker cuts (at a space between letters), and no chunk repeats
    system = "".join(f" rule{_letters(i)}" for i in range(600))
    document = "".join(f" fact{_letters(i)}" for i in range(1500))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]
    asyncio.run(tk.aencode_chat(first))  # the system prompt is remembered
    messages = [{"role": "system", "content": system}, {"role": "user", "content": document}]
    expected = plain.encode(tk.render_chat(messages), add_special_tokens=False).ids
    planned = tk.plan_chat(tk.draft_chat(messages))
    assert not isinstance(planned, str) and planned.chat
    assert planned.head and planned.known >= len(planned.head)  # from the system prompt's ids
    assert planned.known_ids() == expected[: planned.known]
    assert abs(planned.estimate - len(expected)) < 0.2 * len(expected)  # an estimate
    for _ in range(3):
        planned = tk.encode_first_missing(planned)
        assert planned.chat and planned.known_ids() == expected[: planned.known]
    with pytest.raises(ValueError, match="aencode_chat_plan"):
        asyncio.run(tk.aencode_planned(planned))
    chat = asyncio.run(tk.aencode_chat_plan(planned, thread=True))
    assert chat.ids == expected and chat.reused is planned.head
    assert chat.remembered is not None and len(chat.remembered) > len(planned.head)
    follow = [*messages, {"role": "assistant", "content": "Noted."}]
    follow.append({"role": "user", "content": "Which fact?"})
    again = asyncio.run(tk.aencode_chat_ids(follow))
    assert again.reused is chat.remembered  # the next turn starts from this one's ids
    assert again.ids == plain.encode(tk.render_chat(follow), add_special_tokens=False).ids
    prompt = tk.plan_prompt("plain text")
    assert prompt is not None
    with pytest.raises(ValueError, match="not a chat"):
        asyncio.run(tk.aencode_chat_plan(prompt))
    tk.close()


# -- configurations --------------------------------------------------------------------------


def test_bos_and_eos_added_around_chunked_prompts(tmp_path: Path) -> None:
    base = tokenizers.Tokenizer.from_file(str(PATH))
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    base.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        special_tokens=[(bos, base.token_to_id(bos)), (eos, base.token_to_id(eos))],
    )
    path = tmp_path / "bos.json"
    base.save(str(path))
    tk = Tokenizer.load(path, "deepseek-v3", chunk_chars=8)
    oracle = tokenizers.Tokenizer.from_file(str(path))
    text = " ".join(["routing", "keys", "are", "tokens"] * 40)
    assert tk.chunk_fallback_reason is None
    for special in (True, False):
        expected = oracle.encode(text, add_special_tokens=special).ids
        assert tk.encode(text, add_special_tokens=special) == expected
    assert tk.encode(text)[0] == base.token_to_id(bos) and tk.encode(text)[-1] == base.token_to_id(
        eos
    )
    assert tk.stats.piece_hits > 0


def _variant(tmp_path: Path, name: str, **parts: Any) -> Path:
    base = tokenizers.Tokenizer.from_file(str(PATH))
    for attr, value in parts.items():
        if attr == "added":
            base.add_tokens(value)
        else:
            setattr(base, attr, value)
    path = tmp_path / f"{name}.json"
    base.save(str(path))
    return path


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ({"normalizer": normalizers.Prepend("▁")}, "normalizer Prepend"),
        ({"pre_tokenizer": pre_tokenizers.Metaspace()}, "pre-tokenizer Metaspace"),
        ({"pre_tokenizer": pre_tokenizers.Split(tokenizers.Regex(r"\b"), "isolated")}, "anchors"),
        (
            {"pre_tokenizer": pre_tokenizers.Split(tokenizers.Regex(r"(?<=a) "), "isolated")},
            "anchors",
        ),
        # a regex that pairs words: a cut moves where a space attaches, ids would differ
        (
            {
                "pre_tokenizer": pre_tokenizers.Sequence(
                    [
                        pre_tokenizers.Split(tokenizers.Regex(r"\w+ \w+"), "isolated"),
                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                    ]
                )
            },
            "self-check failed",
        ),
        ({"added": [AddedToken("<m>", single_word=True)]}, "matched inside pieces"),
        ({"added": [AddedToken("<m>", normalized=False, single_word=True)]}, "cannot be cut at"),
        ({"added": [AddedToken("New York")]}, None),  # split out exactly before chunking
        ({"normalizer": normalizers.NFKC(), "added": [AddedToken("New York")]}, "span a cut"),
        ({"normalizer": normalizers.NFKC()}, None),
    ],
)
def test_configurations_where_a_cut_could_change_ids_encode_whole(
    tmp_path: Path, parts: dict[str, Any], reason: str | None
) -> None:
    path = _variant(tmp_path, "variant", **parts)
    tk = Tokenizer.load(path, "deepseek-v3", chunk_chars=4)
    oracle = tokenizers.Tokenizer.from_file(str(path))
    assert tk.stats.chunked is (reason is None)
    if reason is None:
        assert tk.chunk_fallback_reason is None
    else:
        assert reason in str(tk.stats.chunk_fallback_reason)
    for text in [
        "hello world and more words here",
        "a b <m> c d e f g",
        "to New York x",
        "x " * 50,
    ]:
        assert tk.encode(text) == tk.encode(text) == oracle.encode(text).ids
    assert (tk.stats.piece_hits > 0) is (reason is None)


def test_unsafe_reasons_from_the_configuration() -> None:
    config = splitting_config(tokenizers.Tokenizer.from_file(str(PATH)))
    assert unsafe_reason(config, "BPE") is None
    assert "Unigram" in str(unsafe_reason(config, "Unigram"))
    assert "dropout" in str(unsafe_reason({**config, "model": {"dropout": 0.1}}, "BPE"))
    assert "no pre-tokenizer" in str(unsafe_reason({**config, "pre_tokenizer": None}, "BPE"))
    # ^ and $ inside classes are characters; outside they are anchors
    assert _outside_classes(r"[^\s$]+|\p{L}\^") == r"+|\p{L}"
    assert _outside_classes(r"[a[^b]]^") == "^"
