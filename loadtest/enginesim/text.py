"""Text in and out of a simulated engine: prompts to token ids, generated ids to text.

Prompts go through the gateway's own tokenization module (chat template + tokenizer.json),
so the simulator sees the tokens a real engine and the gateway see. Generated tokens cycle
through the ids of ``output_text`` (default " the", one token in most vocabularies): text for
any range of them is a slice of a repeated string, no per-token work, and a follow-up turn
that quotes the answer re-tokenizes to the same ids, so multi-turn chats hit the cache the
way they do on real engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.enginesim.api import ApiError

if TYPE_CHECKING:
    from gateway.tokenization import Tokenizer

__all__ = ["TextCodec", "load_tokenizer", "tokenizer_path"]

_NO_TOKENIZER_ID = 1000  # the output token id when the simulator runs without a tokenizer


def tokenizer_path(path: str | None) -> Path | None:
    """Where the configured tokenizer lives: ``path`` None means the bundled test tokenizer
    (DeepSeek-V3), ``"none"`` no tokenizer (token-id prompts only)."""
    if path == "none":
        return None
    if path is None:
        from gateway.tokenization import bundled_test_tokenizer

        return bundled_test_tokenizer()
    return Path(path)


def load_tokenizer(
    path: str | None, chat_template: str | None, cache_tokens: int = 4_000_000
) -> Tokenizer | None:
    """The configured tokenizer (see ``tokenizer_path``); the bundled one gets the bundled
    ``deepseek-v3`` template unless another is named. ``cache_tokens`` bounds its incremental
    cache (token ids held)."""
    where = tokenizer_path(path)
    if where is None:
        return None
    from gateway.tokenization import Tokenizer

    if path is None:
        chat_template = chat_template or "deepseek-v3"
    return Tokenizer.load(where, chat_template, cache_tokens=cache_tokens)


class TextCodec:
    """Prompt encoding and output text for one model (shared by all workers)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        output_text: str = " the",
        source: Path | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.source = None if tokenizer is None or source is None else str(source)
        if tokenizer is not None:
            ids = tokenizer.encode(output_text, add_special_tokens=False) or [_NO_TOKENIZER_ID]
            pieces = [tokenizer.decode([i]) for i in ids]
        else:
            ids, pieces = [_NO_TOKENIZER_ID], [output_text]
        self.output_ids: list[int] = ids
        self._pieces = pieces
        self._cycle = "".join(pieces)
        self._offsets = [0]
        for p in pieces:
            self._offsets.append(self._offsets[-1] + len(p))

    @property
    def vocab_size(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.vocab_size

    async def encode(self, text: str) -> list[int]:
        tk = self._need_tokenizer()
        from gateway.tokenization import TokenizationError

        try:
            return await tk.aencode(text, add_special_tokens=True)
        except TokenizationError as exc:
            raise ApiError(400, str(exc), "prompt") from None

    async def encode_chat(
        self,
        messages: list[Any],
        tools: list[Any] | None,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> list[int]:
        tk = self._need_tokenizer()
        from gateway.tokenization import TokenizationError

        try:
            return await tk.aencode_chat(messages, tools, add_generation_prompt, **kwargs)
        except TokenizationError as exc:
            raise ApiError(400, str(exc), "messages") from None

    def decode(self, ids: list[int]) -> str:
        return self._need_tokenizer().decode(ids)

    def output_text(self, start: int, end: int) -> str:
        """Text of generated tokens ``start..end`` (a slice of the repeated pattern)."""
        if end <= start:
            return ""
        n, width = len(self._pieces), len(self._cycle)
        first, last = start // n, end // n
        text = self._cycle * (last - first + 1)
        return text[self._offsets[start % n] : (last - first) * width + self._offsets[end % n]]

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, "This simulator runs without a tokenizer: send token ids")
        return self.tokenizer
