"""Does a worker's engine tokenize as the gateway does? Asked once per agent run.

Routing keys are block keys of the gateway's token ids. An engine that loaded other tokenizer
files (another model revision, a mirror's copy, a fine-tune's added tokens) produces other ids
for the same prompt, so none of the gateway's keys match its cache and prompt lengths are
misjudged: a silent loss of every hit, like a hash seed mismatch. The gateway asks the
engine's ``/tokenize`` (vLLM's, also the simulator's) for a fixed probe text and compares.
An engine without ``/tokenize`` (SGLang) or one that does not answer leaves the worker
unverified, never refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from gateway.tokenization import Tokenizer

__all__ = ["PROBE_TEXT", "TokenizerCheck", "check_engine_tokenizer"]

#: Mixed scripts, digits, punctuation and whitespace runs: merges differ early between
#: tokenizers and revisions.
PROBE_TEXT = (
    "kvroute tokenizer probe: Hello, World! The QUICK brown fox (1234567.89) "
    "naïve café Ünïcödé 漢字かなカナ 한국어 русский  \t tabs\n\nnew lines 🙂 end."
)


@dataclass(frozen=True)
class TokenizerCheck:
    """``ok``: True the same ids, False different ids, None the engine could not say."""

    ok: bool | None
    detail: str


async def check_engine_tokenizer(
    session: aiohttp.ClientSession, url: str, model: str, tokenizer: Tokenizer
) -> TokenizerCheck:
    """Compare the engine's ids for :data:`PROBE_TEXT` (no special tokens) with ours."""
    want = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    body = {"model": model, "prompt": PROBE_TEXT, "add_special_tokens": False}
    try:
        async with session.post(url.rstrip("/") + "/tokenize", json=body) as resp:
            if resp.status != 200:
                return TokenizerCheck(None, f"/tokenize answered {resp.status}")
            answer = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        return TokenizerCheck(None, f"/tokenize failed: {exc!r}")
    got = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
        return TokenizerCheck(None, "/tokenize gave no token ids")
    if got == want:
        return TokenizerCheck(True, f"{len(got)} probe tokens equal")
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    where = (
        f"first difference at token {i}: engine {got[i]}, gateway {want[i]}"
        if i is not None
        else "one is a prefix of the other"
    )
    return TokenizerCheck(
        False,
        f"its engine tokenizes a probe text into {len(got)} tokens, this gateway into "
        f"{len(want)} ({where}): the engine loaded other tokenizer files (model revision?) "
        "than the gateway's pool tokenizer, so no block key can match",
    )
