"""Exact tokenization: chat templates rendered as the engines render them, token ids from the
model's own ``tokenizer.json``, and an incremental cache so a follow-up turn only pays for what
is new. Routing keys must be the tokens the engine will see (design principle 6), so this
package copies the engine pipeline rather than approximating it.

The map, in the order a chat flows through it:

| module | concept |
|---|---|
| ``messages`` | messages and tools checked and converted as vLLM's ``chat_utils`` does |
| ``template`` | the jinja2 sandbox built like transformers' ``apply_chat_template``; content-format detection; where templates come from |
| ``splitter`` | cutting rendered text at added tokens exactly as ``tokenizers`` does |
| ``chunking`` | cutting the text between added tokens into chunks that encode alone (completion prompts, long messages) |
| ``cache`` | the incremental id cache: pieces and remembered chat prefixes, one LRU by tokens |
| ``tokenizer`` | ``Tokenizer``, the front: render, cut, look up, encode what is new; ``PromptPlan``, a prompt looked up and not yet encoded |
| ``types`` | ``TokenizationError``, ``TokenizerStats``, ``ChatIds`` |
"""

from gateway.tokenization.messages import normalize_messages, prepare_messages, prepare_tools
from gateway.tokenization.template import TEMPLATES_DIR, bundled_templates, detect_content_format
from gateway.tokenization.tokenizer import (
    ChatDraft,
    KnownChat,
    PromptPlan,
    Tokenizer,
    bundled_test_tokenizer,
)
from gateway.tokenization.types import ChatIds, ContentFormat, TokenizationError, TokenizerStats

__all__ = [
    "TEMPLATES_DIR",
    "ChatDraft",
    "ChatIds",
    "ContentFormat",
    "KnownChat",
    "PromptPlan",
    "TokenizationError",
    "Tokenizer",
    "TokenizerStats",
    "bundled_templates",
    "bundled_test_tokenizer",
    "detect_content_format",
    "normalize_messages",
    "prepare_messages",
    "prepare_tools",
]
