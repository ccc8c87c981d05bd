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

__all__ = ["TextCodec", "load_tokenizer"]

_NO_TOKENIZER_ID = 1000  # the output token id when the simulator runs without a tokenizer


def load_tokenizer(path: str | None, chat_template: str | None) -> Tokenizer | None:
    """The configured tokenizer; ``path`` None: the bundled test tokenizer (DeepSeek-V3, whose
    template then defaults to the bundled ``deepseek-v3``); ``"none"``: token ids only."""
    if path == "none":
        return None
    from gateway.tokenization import Tokenizer, bundled_test_tokenizer

    if path is None:
        return Tokenizer.load(bundled_test_tokenizer(), chat_template or "deepseek-v3")
    return Tokenizer.load(Path(path), chat_template)


class TextCodec:
    """Prompt encoding and output text for one model (shared by all workers)."""

    def __init__(self, tokenizer: Tokenizer | None, output_text: str = " the") -> None:
        self.tokenizer = tokenizer
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
