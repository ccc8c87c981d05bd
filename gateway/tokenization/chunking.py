"""Cutting long text between added tokens into chunks that encode alone to their ids in place.

A completion prompt has no messages to key a remembered prefix by, and plain text has no
added token to cut at, so before this every completion was encoded whole (~15 ms for 6,000
tokens). Requests that share a long prefix (a document, a few-shot block) share its first
chunks, which the piece cache then serves.

The cut is placed before a space that follows an ASCII letter and precedes one. With a
pre-tokenizer that starts a new pre-token there and reads nothing across it, and a model and
normaliser that work inside pre-tokens, ``encode(a + b) == encode(a) + encode(b)``. That is
checked from the configuration (the known-local components only, regexes without anchors
or look-behind) and then on probe texts at load time, as the added-token splitter is."""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from typing import Any

_LETTERS = frozenset(string.ascii_letters)

# Normalisers that act on characters or canonical sequences: none joins a letter to a space.
_LOCAL_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
# Pre-tokenizers whose pieces depend only on the text around them (no position rules, given
# that every chunk after the first starts with a space).
_LOCAL_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}
)
# Regex constructs whose meaning changes at the start of a string or looks behind it (checked
# outside character classes, where ``^`` negates and ``$`` is a character).
_ANCHORS = re.compile(r"\\[bBAGzZ]|\(\?<[=!]|\^|\$")


def _outside_classes(regex: str) -> str:
    """``regex`` without its character classes (nested ones included) and escaped
    characters other than letters (``\\b`` stays, ``\\^`` goes)."""
    out: list[str] = []
    depth, i = 0, 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            if depth == 0 and regex[i + 1].isalpha():
                out.append(regex[i : i + 2])
            i += 2
            continue
        if ch == "[":
            depth += 1
        elif ch == "]" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
        i += 1
    return "".join(out)


def _normalizer_reason(node: Any) -> str | None:
    if node is None:
        return None
    kind = node.get("type")
    if kind == "Sequence":
        for inner in node.get("normalizers", []):
            reason = _normalizer_reason(inner)
            if reason:
                return reason
        return None
    return None if kind in _LOCAL_NORMALIZERS else f"normalizer {kind} is not known to be local"


def _pre_tokenizer_reason(node: Any) -> str | None:
    if node is None:
        return "no pre-tokenizer: the model sees the whole text as one word"
    kind = node.get("type")
    if kind == "Sequence":
        inner = node.get("pretokenizers", [])
        if not inner:
            return "an empty pre-tokenizer sequence"
        for part in inner:
            reason = _pre_tokenizer_reason(part)
            if reason:
                return reason
        return None
    if kind not in _LOCAL_PRE_TOKENIZERS:
        return f"pre-tokenizer {kind} is not known to be local"
    if kind == "Split":
        pattern = node.get("pattern", {})
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if regex is not None and _ANCHORS.search(_outside_classes(regex)):
            return "a Split regex uses anchors or look-behind"
    return None


def unsafe_reason(
    config: dict[str, Any], model_type: str, inner_tokens: Sequence[dict[str, Any]] = ()
) -> str | None:
    """Why a letter-space-letter cut could encode differently from the whole text, if so.
    ``config`` is :func:`gateway.tokenization.splitter.splitting_config`'s; ``inner_tokens``
    the added tokens that tokenizers matches inside the pieces (those the splitter leaves)."""
    for token in inner_tokens:
        if any(token[flag] for flag in ("lstrip", "rstrip", "single_word")) or any(
            ch.isspace() for ch in token["content"]
        ):
            return f"added token {token['content']!r} is matched inside pieces and could span a cut"
    if model_type != "BPE":
        return f"model {model_type} is not known to encode within pre-tokens"
    if config.get("model", {}).get("dropout") not in (None, 0, 0.0):
        return "BPE dropout makes encoding non-deterministic"
    return _normalizer_reason(config.get("normalizer")) or _pre_tokenizer_reason(
        config.get("pre_tokenizer")
    )


class Chunker:
    """Cuts a text into chunks of at least ``size`` characters (the last may be shorter) at
    the first safe cut at or after each ``size`` characters. A cut depends only on the text up
    to one character past it, so texts sharing a prefix share every chunk that ends inside it."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("chunk size must be at least 1 character")
        self.size = size

    def chunks(self, text: str) -> list[str]:
        size, n = self.size, len(text)
        out: list[str] = []
        start = 0
        while n - start > size:
            cut = safe_cut(text, start + size)
            if cut == -1:
                break
            out.append(text[start:cut])
            start = cut
        out.append(text[start:])
        return out


def safe_cut(text: str, start: int) -> int:
    """The first safe cut of ``text`` at or after ``start`` (> 0): a space between two ASCII
    letters, where ``text[:cut]`` and ``text[cut:]`` encode to ``text``'s ids; -1 if none."""
    n = len(text)
    find = text.find
    cut = find(" ", start, n - 1)
    while cut != -1 and not (text[cut - 1] in _LETTERS and text[cut + 1] in _LETTERS):
        cut = find(" ", cut + 1, n - 1)
    return cut


def probe_texts() -> list[str]:
    """Texts with cuts beside every kind of character the pre-tokenizers treat apart."""
    words = [
        "hello", "it's", "We'LL", "x", "12345", "3.14", "naïve", "日本語テキスト", "emoji🙂ok",
        "tab\there", "line\nbreak", "two  spaces", "   lead", "trail   ", "a,b;c", "(paren)",
        "--dash", "über", "Ωmega", "\r\n", "don't", "ABC", "z9", "q",
    ]  # fmt: skip
    texts = []
    for i in range(len(words)):
        ring = words[i:] + words[:i]
        texts.append(" ".join(ring))
        texts.append("prefix " + " ok ".join(ring) + " end")
    return texts


def check(chunker: Chunker, encode: Callable[[list[str]], list[list[int]]]) -> str | None:
    """The first probe text whose chunks do not encode to its ids (with a chunk size that cuts
    at every chance), or None."""
    texts = probe_texts()
    split = [chunker.chunks(t) for t in texts]
    pieces = list(dict.fromkeys(c for s in split for c in s))
    ids = dict(zip(pieces, encode(pieces), strict=True))
    for text, whole, parts in zip(texts, encode(texts), split, strict=True):
        if [x for p in parts for x in ids[p]] != whole:
            return text
    return None
