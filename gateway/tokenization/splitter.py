"""Cutting text at added tokens exactly as HF ``tokenizers``' ``AddedVocabulary`` does.

``tokenizers`` first cuts its input at added tokens, then normalises, pre-tokenises and runs the
model on each piece between them independently; so pieces can be cached on their own. The cut is
reproduced exactly: two passes (``normalized=false`` tokens on the raw text, then
``normalized=true`` tokens inside each piece, only when the normaliser is the identity),
leftmost-longest matching, and the ``lstrip``/``rstrip`` whitespace absorption. Configurations
where a piece's ids could depend on its position are reported unsafe, so the front falls back
to full encodes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
import tokenizers.models

# Unicode White_Space: what the Rust regex ``\s`` matches when tokenizers strips around tokens.
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


@dataclass(frozen=True)
class _Added:
    id: int
    lstrip: bool
    rstrip: bool


def _trie(words: Iterable[str]) -> dict[str, Any]:
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    return trie


def _node_pattern(node: dict[str, Any]) -> str:
    """A regex matching the longest word of the trie ``node`` at a position: at each character
    it prefers going deeper, and falls back to the deepest complete word."""
    branches = [re.escape(ch) + _node_pattern(child) for ch, child in node.items() if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if "" in node else body


class _Pass:
    """One matching pass of tokenizers' AddedVocabulary: a set of added tokens cut out of a
    string with leftmost-longest, non-overlapping matching (its Aho-Corasick automaton's kind).

    There is one regex per first character, each starting with a literal that ``re`` scans for
    at memchr speed; a combined alternation would test every character of the text."""

    def __init__(self, tokens: Sequence[dict[str, Any]]) -> None:
        self.tokens = {t["content"]: _Added(t["id"], t["lstrip"], t["rstrip"]) for t in tokens}
        trie = _trie(self.tokens)
        if len(trie) <= 8:
            self.regexes = [re.compile(re.escape(c) + _node_pattern(n)) for c, n in trie.items()]
        else:
            self.regexes = [re.compile(_node_pattern(trie))]

    def _matches(self, text: str) -> Iterator[re.Match[str]]:
        """The matches a single leftmost-longest scan finds: at each step the earliest next match
        of any regex (their first characters differ, so starts never tie)."""
        if len(self.regexes) == 1:
            yield from self.regexes[0].finditer(text)
            return
        heads = {r: r.search(text) for r in self.regexes}
        while True:
            live = [m for m in heads.values() if m is not None]
            if not live:
                return
            match = min(live, key=lambda m: m.start())
            yield match
            end = match.end()
            for r, m in heads.items():
                if m is not None and m.start() < end:
                    heads[r] = r.search(text, end)

    def split(self, text: str) -> list[str | int] | None:
        """Pieces of ``text`` and ids of the tokens between them, or None where tokenizers would
        produce overlapping splits (a stripped token swallowing the start of the next)."""
        out: list[str | int] = []
        offset = 0
        for match in self._matches(text):
            token = self.tokens[match.group()]
            start, stop = match.span()
            if token.lstrip:
                start = max(_whitespace_run_start(text, start), offset)
            if token.rstrip:
                stop = _whitespace_run_end(text, stop)
            if start < offset:
                return None
            if start > offset:
                out.append(text[offset:start])
            out.append(token.id)
            offset = stop
        if offset < len(text):
            out.append(text[offset:])
        return out


def _whitespace_run_start(text: str, end: int) -> int:
    i = end
    while i > 0 and text[i - 1] in _WHITESPACE:
        i -= 1
    return i


def _whitespace_run_end(text: str, start: int) -> int:
    i = start
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object inside a tokenizer.json component."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def splitting_config(tk: tokenizers.Tokenizer) -> dict[str, Any]:
    """The parts of tokenizer.json that decide how text is cut, in its JSON form, without
    serialising the (large) vocabulary."""
    light = tokenizers.Tokenizer(tokenizers.models.BPE())
    if tk.normalizer is not None:
        light.normalizer = tk.normalizer
    if tk.pre_tokenizer is not None:
        light.pre_tokenizer = tk.pre_tokenizer
    config: dict[str, Any] = json.loads(light.to_str())
    config["model"] = {"dropout": getattr(tk.model, "dropout", None)}
    config["added_tokens"] = [
        {
            "id": tid,
            "content": t.content,
            "lstrip": t.lstrip,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "normalized": t.normalized,
        }
        for tid, t in sorted(tk.get_added_tokens_decoder().items())
    ]
    return config


def _is_identity_normalizer(normalizer: Any) -> bool:
    if normalizer is None:
        return True
    if normalizer.get("type") == "Sequence":
        return all(_is_identity_normalizer(n) for n in normalizer.get("normalizers", []))
    return False


def unsafe_reason(config: dict[str, Any], encode_special_tokens: bool) -> str | None:
    """Why pieces cut at added tokens could encode differently alone than in place, if so."""
    if encode_special_tokens:
        return "encode_special_tokens is set"
    if config.get("model", {}).get("dropout") not in (None, 0, 0.0):
        return "BPE dropout makes encoding non-deterministic"
    for node in _walk(config.get("pre_tokenizer")):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return "Metaspace prepend_scheme='first' depends on a piece's position"
    raw = [t for t in config.get("added_tokens", []) if t["content"] and not t["normalized"]]
    if any(t["single_word"] for t in raw):
        return "single_word added tokens depend on the characters around a piece"
    return None


class Splitter:
    """Cuts text where tokenizers cuts it before encoding: ids of added tokens, and the text
    pieces between them, each of which encodes alone to the ids it gets in place."""

    def __init__(self, raw: _Pass | None, normalized: _Pass | None) -> None:
        self.raw, self.normalized = raw, normalized
        passes = [p for p in (raw, normalized) if p is not None]
        self._regexes = [(p.tokens, r) for p in passes for r in p.regexes]
        self.token_len = {t.id: len(c) for p in passes for c, t in p.tokens.items()}
        # Prefix reuse cuts after any added token we split on (see Tokenizer._finish).
        contents = [c for p in passes for c in p.tokens]
        self.cut_ids = frozenset(self.token_len)
        self.reach = max(map(len, contents), default=0)
        self.token_prefixes = frozenset(c[:i] for c in contents for i in range(1, len(c) + 1))
        self.strips = any(t.lstrip or t.rstrip for p in passes for t in p.tokens.values())

    def open_end(self, text: str) -> int:
        """The first position from which the rest of ``text`` could still grow into an added
        token (of either pass): matches starting before it are the same in any longer text."""
        for s in range(max(0, len(text) - self.reach), len(text)):
            if text[s:] in self.token_prefixes:
                return s
        return len(text)

    @classmethod
    def build(cls, config: dict[str, Any]) -> Splitter:
        tokens = [t for t in config.get("added_tokens", []) if t["content"]]
        raw = [t for t in tokens if not t["normalized"]]
        norm = [t for t in tokens if t["normalized"]]
        # Normalized tokens match the normalized text, which equals the raw text only under an
        # identity normaliser; otherwise tokenizers finds them inside each piece by itself.
        split_norm = (
            bool(norm)
            and _is_identity_normalizer(config.get("normalizer"))
            and not any(t["single_word"] for t in norm)
        )
        return cls(_Pass(raw) if raw else None, _Pass(norm) if split_norm else None)

    def split(self, text: str) -> list[str | int] | None:
        fast = self._split_fast(text)
        return fast if fast is not None else self._split_exact(text)

    def _split_fast(self, text: str) -> list[str | int] | None:
        """One scan of the whole text per regex. When no two matches overlap and none strips
        whitespace, the two-pass result is exactly these matches (a second-pass scan of the
        whole text only differs from the scans of the pieces around first-pass tokens where a
        match crosses or enters one of them, i.e. overlaps it). None: use the exact path."""
        found = sorted(
            (m.start(), m.end(), tokens[m.group()])
            for tokens, regex in self._regexes
            for m in regex.finditer(text)
        )
        out: list[str | int] = []
        offset = 0
        for start, stop, token in found:
            if start < offset or token.lstrip or token.rstrip:
                return None
            if start > offset:
                out.append(text[offset:start])
            out.append(token.id)
            offset = stop
        if offset < len(text):
            out.append(text[offset:])
        return out

    def _split_exact(self, text: str) -> list[str | int] | None:
        """tokenizers' two passes as it runs them: raw-text tokens, then normalized tokens
        inside each piece."""
        first: list[str | int] | None = self.raw.split(text) if self.raw else [text]
        if first is None or self.normalized is None:
            return first
        out: list[str | int] = []
        for item in first:
            if isinstance(item, int):
                out.append(item)
                continue
            inner = self.normalized.split(item)
            if inner is None:
                return None
            out.extend(inner)
        return out

    def probe_texts(self) -> list[str]:
        """Texts around every kind of boundary token, for the load-time self-check."""
        passes = [p for p in (self.raw, self.normalized) if p is not None]
        contents = [c for p in passes for c in list(p.tokens)[:24]]
        flagged = [c for p in passes for c, t in p.tokens.items() if t.lstrip or t.rstrip]
        texts = []
        for c in dict.fromkeys(contents + flagged[:24]):
            texts += [f"a{c}b", f"  {c}  x\n", f"\n\n{c}\n{c}{c}", f"héllo 12345{c}世界 ", c]
        return texts
