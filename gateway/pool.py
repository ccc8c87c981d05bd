"""A pool: one served model with its tokenizer, canonical block keys and router.

``prepare`` turns a client request into what routing needs — the exact token ids the engine
will see (chat template + tokenizer, with the incremental cache) and their canonical block
keys — or a 4xx for input the engine would reject. The keys are lazy (``LazyKeys``): routing
computes them as far as the index's match reaches, and ``settle`` computes the rest (for
speculation and the prefix-key cache) once the request is on its way.

A completion prompt whose new text is a small part of it can be routed before that text is
encoded (``PoolSettings.tokenize_overlap_chars``): ``prepare`` returns its known first ids,
the rest is encoded on a worker thread while the request is routed and sent, and
``Prepared.ready`` (awaited before the first byte reaches the client) gives the exact ids, or
the error the exact ids call for. A chat turn of a conversation the tokenizer remembers is
routed likewise on the ids its previous turn left (``PoolSettings.tokenize_overlap_chats``):
found by its messages before the render, they are a guess that the render then confirms or
not; either way the exact ids give the keys, the count and the speculative insert. A chat
with a long new message (a retrieved document, a tool's output) is rendered and then routed
on its known first ids as a completion prompt is (``PoolSettings.tokenize_overlap_cold`` for
the search past a prefix some worker holds whole).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from gateway.config import PoolSettings
from gateway.errors import ApiError, bad_request
from gateway.requests import ClientRequest, too_long
from gateway.routing.adapters import AdapterCatalog
from gateway.routing.costmodel import CostModel
from gateway.routing.index import ShadowIndex
from gateway.routing.keys import BlockKeyer, LazyKeys, PrefixKeys
from gateway.routing.policy import Decision, make_policy
from gateway.routing.router import Router
from gateway.tokenization import (
    ChatDraft,
    ChatIds,
    KnownChat,
    PromptPlan,
    TokenizationError,
    Tokenizer,
    normalize_messages,
)
from gateway.warmup import Warmer

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["Pool", "Prepared"]

#: event-loop steps an overlapped chat's render waits, so its request is sent before it
_SEND_FIRST_STEPS = 2

#: uncached pieces (~1 KB each, ``DEFAULT_CHUNK_CHARS``) a completion prompt may have encoded on
#: the loop to find where the index's match stops (``Pool._closed``): a shared prefix of a few
#: hundred tokens takes one, and past four the match is a document some worker holds
_CLOSE_PIECES = 4

#: a prompt's known first ids' keys and the ids (``Pool._routable``)
_Known = tuple[LazyKeys, list[int]]

#: the request field holding a chat-like request's conversation
_MESSAGES_PARAM = {"chat": "messages", "responses": "input", "messages": "messages"}


@dataclass
class Prepared:
    prompt_tokens: int
    keys: LazyKeys
    tokenize_s: float
    keys_s: float
    #: body to forward when the gateway changed it (normalised messages), else None
    body: bytes | None = None
    #: the LoRA adapter asked for (``keys`` are on its chain), None for the base model
    adapter: str | None = None
    #: the prompt's token ids (a warm-up sends a prefix of them: ``settle``); while ``rest``
    #: runs, its known first ids (``prompt_tokens`` is then an estimate)
    ids: Sequence[int] = ()
    #: the encode of the rest of the prompt (an overlapped prompt), None otherwise
    rest: asyncio.Task[None] | None = None
    #: what the exact ids call for (a prompt too long, text the tokenizer rejects)
    error: ApiError | None = None
    #: (decision, time) of decisions made on the known ids: ``rest`` speculates the rest there
    routes: list[tuple[Decision, float]] = field(default_factory=list)
    #: worker -> the tokens it holds of the exact ids (an overlapped chat, from ``rest``):
    #: what a decision made on the known ids matched, extended past them (:meth:`exact`)
    matched: dict[str, int] = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        """Still routed on known first ids: the rest of them is being encoded."""
        return self.rest is not None and not self.rest.done()

    def exact(self, decision: Decision) -> Decision:
        """``decision`` with the match its worker has on the exact ids (once ``ready``)."""
        n = self.matched.get(decision.worker)
        if n is None or n == decision.matched_tokens:
            return decision
        return dataclasses.replace(decision, matched_tokens=n)

    async def ready(self) -> None:
        """Wait for the exact ids (an overlapped prompt); raise the error they call for."""
        if self.rest is not None:
            await asyncio.shield(self.rest)  # a cancelled request leaves the encode to finish
        if self.error is not None:
            raise self.error


class Pool:
    def __init__(
        self,
        settings: PoolSettings,
        index: ShadowIndex,
        hash_seed: str,
        rng: random.Random | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.model
        self.tokenizer = tokenizer or Tokenizer.load(
            settings.tokenizer,
            settings.chat_template or None,
            normalize=settings.normalize_prompts,
            cache_tokens=settings.tokenizer_cache_tokens,
            thread_threshold_chars=settings.tokenize_thread_chars or sys.maxsize,
        )
        for what, reason in (
            ("chats are encoded whole", self.tokenizer.fallback_reason),
            ("completions are encoded whole", self.tokenizer.chunk_fallback_reason),
        ):
            if reason is not None:  # exact either way, only slower: say why once
                log.warning("pool %s: %s (%s)", self.name, what, reason)
        self.keyer = BlockKeyer(hash_seed, settings.block_size)
        # keys of the chat prefixes the tokenizer remembers, held for as many tokens
        self.prefix_keys = PrefixKeys(self.keyer, settings.tokenizer_cache_tokens)
        policy = make_policy(settings.policy, **settings.policy_params)
        if rng is None and settings.seed is not None:
            rng = random.Random(settings.seed)
        self.router = Router(
            policy,
            settings.block_size,
            index=index,
            cost=CostModel(settings.cost),
            rng=rng,
            adapters=AdapterCatalog(settings.adapters),
        )
        # prefill/decode disaggregation: ``router`` holds the prefill (and role-less) workers,
        # this one the decode workers; one index (a decode worker caches what it receives)
        decode = make_policy(settings.decode_policy, **settings.decode_policy_params)
        self.decode_router = Router(
            decode, settings.block_size, index=index, cost=CostModel(settings.cost), rng=rng
        )
        #: sends the warm-ups the policy asks for (set at start-up: gateway/main.py); None:
        #: they are dropped (the policy does not ask again before its warm-up timeout)
        self.warmer: Warmer | None = None

    @property
    def disaggregated(self) -> bool:
        """Requests go to a prefill and a decode worker (some worker registered as decode)."""
        return bool(self.decode_router.workers())

    def router_for(self, role: str) -> Router:
        return self.decode_router if role == "decode" else self.router

    def adapter_for(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model)."""
        if model is None or model == self.settings.model or model in self.settings.aliases:
            return None
        return model if self.router.adapters.known(model) else None

    def settle(self, prep: Prepared) -> None:
        """After routing ``prep``: the rest of its keys and the speculative insert the
        decision left pending (``Router.route`` with lazy keys). Anything that reads the
        index first applies it anyway; this does it once the request is forwarded."""
        self.router.index.settle()  # one index for both routers
        warm = self.router.ctx.warmups.take(prep.keys)
        if warm and self.warmer is not None:
            for intent in warm:
                self.warmer.submit(self, intent, prep.ids[: intent.tokens])
        prep.keys.all()

    async def prepare(
        self, req: ClientRequest, adapter: str | None = None, overlap: bool = False
    ) -> Prepared:
        """Token ids and keys; an ``adapter`` request is tokenized like the base model (the
        adapter shares its tokenizer and template) and keyed on the adapter's chain.
        ``overlap``: a completion prompt may come back routable on its known first ids, the
        rest being encoded (see the module's docstring); the caller awaits ``ready``."""
        t0 = time.perf_counter()
        tok = self.tokenizer
        body: bytes | None = None
        try:
            if req.messages is not None:  # chat, Responses, Messages: the chat template
                messages = req.messages
                # only a chat body can be rewritten; other APIs go to the engine unchanged
                if self.settings.normalize_prompts and req.kind == "chat":
                    messages = normalize_messages(messages)
                    body = req.with_changes(messages=messages)
                draft = tok.draft_chat(
                    messages,
                    tools=req.tools,
                    add_generation_prompt=req.add_generation_prompt,
                    **req.template_kwargs,
                )
                param = _MESSAGES_PARAM[req.kind]
                known = tok.known_chat(draft) if overlap and self._may_overlap_chats else None
                if known is not None and self._chat_overlaps(known, req.max_tokens):
                    return self._overlapped_chat(
                        draft, known, req.max_tokens, adapter, t0, body, param
                    )
                if not (overlap and self._may_overlap_chats):
                    chat = await tok.aencode_draft(draft)
                else:  # rendered: routed on its known first ids as a completion prompt is
                    rendered = tok.plan_chat(draft)
                    if isinstance(rendered, str):
                        chat = ChatIds(await tok.aencode(rendered, add_special_tokens=False))
                    else:
                        rendered, on = self._routable(rendered, req.max_tokens, adapter)
                        if on is not None:
                            return self._overlapped(
                                rendered, req.max_tokens, adapter, t0, *on, body, param
                            )
                        chat = await tok.aencode_chat_plan(rendered)
            elif req.prompt_ids is not None:
                chat = ChatIds(req.prompt_ids)
                vocab = tok.vocab_size
                if max(chat.ids) >= vocab:
                    raise bad_request(
                        f"token id {max(chat.ids)} is out of vocabulary (size {vocab})",
                        param="prompt",
                        code="invalid_token_id",
                    )
            else:
                assert req.prompt_text is not None
                # vLLM completions and SGLang /generate both encode text with special tokens
                planned = tok.plan_prompt(req.prompt_text, add_special_tokens=True)
                if planned is None:
                    chat = ChatIds(await tok.aencode(req.prompt_text, add_special_tokens=True))
                else:
                    if overlap:
                        planned, on = self._routable(planned, req.max_tokens, adapter)
                        if on is not None:
                            return self._overlapped(planned, req.max_tokens, adapter, t0, *on)
                    chat = ChatIds(await tok.aencode_planned(planned))
        except (TokenizationError, UnicodeError) as exc:
            param = "prompt" if req.messages is None else _MESSAGES_PARAM[req.kind]
            raise _invalid_prompt(exc, param) from None
        t1 = time.perf_counter()
        ids = chat.ids
        if not ids:
            raise bad_request("the prompt is empty after tokenization", code="empty_prompt")
        err = too_long(len(ids), req.max_tokens, self.settings.max_model_len)
        if err is not None:
            raise err
        root = self.keyer.adapter_root(adapter)
        keys = self.prefix_keys.lazy(ids, chat.reused, chat.remembered, root, chat.lead)
        return Prepared(len(ids), keys, t1 - t0, time.perf_counter() - t1, body, adapter, ids)

    def _routable(
        self, planned: PromptPlan, max_tokens: int | None, adapter: str | None
    ) -> tuple[PromptPlan, _Known | None]:
        """The plan to finish a prompt with and, when it is to be routed on its known first
        ids while the rest is encoded, their keys and those ids (``_overlaps``, else
        ``_closed``)."""
        if self._overlaps(planned, max_tokens):
            return planned, self._known(planned, adapter)
        return self._closed(planned, max_tokens, adapter)

    def _known(
        self, planned: PromptPlan, adapter: str | None, ids: list[int] | None = None
    ) -> _Known:
        """``planned``'s known ids (or ``ids``, a longer prefix of its ids) and their keys; a
        chat's keys start from its remembered prefix's."""
        root = self.keyer.adapter_root(adapter)
        known = planned.known_ids() if ids is None else ids
        if planned.chat and planned.head:
            return self.prefix_keys.lazy(known, planned.head, None, root), known
        return LazyKeys(self.keyer, known, root), known

    def _overlaps(self, planned: PromptPlan, max_tokens: int | None) -> bool:
        """Whether to route ``planned`` on its known ids: enough new text to be worth a
        thread, little enough of the prompt that the decision misses at most a small match,
        a whole block known, no pair to route (a decode router) and, by the estimate, within
        the context (a prompt that may not fit is checked exactly before it is sent)."""
        s = self.settings
        unknown = planned.estimate - planned.known
        return (
            s.tokenize_overlap_chars > 0
            and s.tokenize_thread_chars > 0
            and planned.missing_chars >= s.tokenize_overlap_chars
            and unknown <= s.tokenize_overlap_fraction * planned.estimate
            and planned.known >= s.block_size
            and not self.disaggregated
            and too_long(planned.estimate, max_tokens, s.max_model_len) is None
        )

    def _closed(
        self, planned: PromptPlan, max_tokens: int | None, adapter: str | None
    ) -> tuple[PromptPlan, _Known | None]:
        """The plan to finish the prompt with and, when no worker holds every block of its
        known ids, their keys (and the ids): a prefix match that stops inside them cannot
        grow with the rest of the prompt, so routing on them misses nothing. While some worker holds every
        known block (a prefix every request shares, then new text), the start of the first
        uncached piece is encoded here (``_probe``), and where the match goes on past it the
        whole piece (the cut kept), up to ``_CLOSE_PIECES`` pieces: the match
        then usually stops in the new text (a document seen nowhere) and the rest is encoded
        while the request is on its way. No keys when the match goes on past those pieces,
        or the overlap is not worth it (``_overlaps``' other bounds)."""
        s = self.settings
        if not (
            s.tokenize_overlap_cold
            and s.tokenize_overlap_chars > 0
            and s.tokenize_thread_chars > 0
            and planned.missing_chars >= s.tokenize_overlap_chars
            and not self.disaggregated
        ):
            return planned, None
        for encoded in range(_CLOSE_PIECES + 1):
            if planned.known >= s.block_size:
                if too_long(planned.estimate, max_tokens, s.max_model_len) is not None:
                    return planned, None  # checked exactly before anything is sent
                on = self._known(planned, adapter)
                if self._stops_inside(on[0]):
                    return planned, on
                # a worker holds every known block: the rest may lengthen its match
            if encoded == _CLOSE_PIECES:
                return planned, None
            first = planned.first_missing()
            if first is None or len(first) >= s.tokenize_thread_chars:  # not on the loop
                return planned, None
            probed = self._probe(planned, max_tokens, adapter)
            if probed is not None:
                return planned, probed
            planned = self.tokenizer.encode_first_missing(planned)  # not encoded twice
            if planned.missing_chars < s.tokenize_overlap_chars:
                return planned, None  # the rest is short: encoding it beats the overlap
        return planned, None  # not reached: the last pass returns

    def _stops_inside(self, keys: LazyKeys) -> bool:
        """No worker holds every block of ``keys``: the index's longest match stops inside
        them, so no longer prompt starting with them can lengthen it."""
        masks = self.router.index.match_masks(keys)
        return not masks or masks[0][0] < len(keys)

    def _probe(
        self, planned: PromptPlan, max_tokens: int | None, adapter: str | None
    ) -> _Known | None:
        """The known ids and keys of ``planned`` with the start of its first uncached piece
        (``tokenize_probe_chars``) when the index's match stops inside them, else None (the
        whole piece is then encoded here, as without the probe). Most cold prompts are held
        nowhere: their first blocks decide, and the piece's encode leaves the loop."""
        s = self.settings
        if too_long(planned.estimate, max_tokens, s.max_model_len) is not None:
            return None
        ids = self.tokenizer.probe_ids(planned, s.tokenize_probe_chars)
        if ids is None or len(ids) // s.block_size <= planned.known // s.block_size:
            return None  # no cut, or no whole block more than the known ids have
        on = self._known(planned, adapter, ids)
        return on if self._stops_inside(on[0]) else None

    @property
    def _may_overlap_chats(self) -> bool:
        """Chats may be routed on their previous turn's ids (the setting; no decode pairs)."""
        s = self.settings
        return s.tokenize_overlap_chats and not self.disaggregated

    def _chat_overlaps(self, known: KnownChat, max_tokens: int | None) -> bool:
        """Whether to route a chat on its previous turn's ids: a whole block known, what
        follows them a small part of the prompt (by its estimate), and the prompt within the
        context by its bound."""
        s = self.settings
        n = len(known.ids)
        return (
            n >= s.block_size
            and known.estimate <= s.tokenize_overlap_fraction * (n + known.estimate)
            and too_long(n + known.bound, max_tokens, s.max_model_len) is None
        )

    def _overlapped_chat(
        self,
        draft: ChatDraft,
        known: KnownChat,
        max_tokens: int | None,
        adapter: str | None,
        t0: float,
        body: bytes | None,
        param: str,
    ) -> Prepared:
        t1 = time.perf_counter()
        root = self.keyer.adapter_root(adapter)
        keys = self.prefix_keys.lazy(known.ids, known.ids, None, root)
        prep = Prepared(
            len(known.ids) + known.estimate, keys, t1 - t0, 0.0, body, adapter, known.ids
        )
        prep.rest = asyncio.get_running_loop().create_task(
            self._finish_chat(prep, draft, known, max_tokens, param),
            name="kvroute-tokenize-chat",
        )
        return prep

    async def _finish_chat(
        self,
        prep: Prepared,
        draft: ChatDraft,
        known: KnownChat,
        max_tokens: int | None,
        param: str,
    ) -> None:
        """The exact ids of an overlapped chat, checked as ``prepare`` checks them; its keys
        (those of the known ids kept when the render starts with them) and the speculative
        inserts of the decisions made so far completed."""
        # the request goes out first: on Python 3.11 aiohttp writes its body from a task
        # created on the send, queued behind this one
        for _ in range(_SEND_FIRST_STEPS):
            await asyncio.sleep(0)
        chat = await self._exactly(prep, self.tokenizer.aencode_draft(draft, known), param)
        if chat is not None:
            self._complete_chat(prep, chat, max_tokens, chat.reused is known.ids)

    def _complete_chat(
        self, prep: Prepared, chat: ChatIds, max_tokens: int | None, kept: bool
    ) -> None:
        """An overlapped chat's exact ids checked as ``prepare`` checks them, its keys made
        from the remembered prefixes (so that the next turn starts from them), and the
        speculative inserts of the decisions made so far completed. ``kept``: the ids start
        with the known ids the decisions were made on, whose keys and inserts stand."""
        ids = chat.ids
        if not ids:
            prep.error = bad_request("the prompt is empty after tokenization", code="empty_prompt")
            return
        prep.error = too_long(len(ids), max_tokens, self.settings.max_model_len)
        if prep.error is not None:
            return
        self.router.index.settle()
        keys = self.prefix_keys.lazy(ids, chat.reused, chat.remembered, prep.keys.root, chat.lead)
        start = len(prep.keys) if kept else 0
        self._match_exact(prep, keys, start)
        prep.keys, prep.ids, prep.prompt_tokens = keys, ids, len(ids)
        self._speculate_rest(prep, start)

    def _match_exact(self, prep: Prepared, keys: LazyKeys, known: int) -> None:
        """``prep.matched``: what each decision's worker holds of the exact ``keys``, before
        the rest of them is speculated there. A decision that matched all ``known`` blocks
        (the known ids' keys, which ``keys`` start with) may match more of the exact ids: the
        previous turn's last blocks and its reply, which the engine cached after it. One that
        stopped short matched the same on the exact ids. With ``known`` 0 (the render did not
        start with the known ids) the decision's match was on other keys: measured afresh."""
        bs = self.settings.block_size
        index = self.router.index
        masks: list[tuple[int, int]] | None = None
        live = set(index.workers())
        for decision, _ in prep.routes:
            if decision.worker not in live or (known and decision.matched_tokens < known * bs):
                continue
            if masks is None:
                masks = index.match_masks(keys)
            bit = index.bit(decision.worker)
            blocks = next((n for n, bits in masks if bits & bit), 0)
            prep.matched[decision.worker] = blocks * bs

    def _overlapped(
        self,
        planned: PromptPlan,
        max_tokens: int | None,
        adapter: str | None,
        t0: float,
        keys: LazyKeys,
        known: list[int],
        body: bytes | None = None,
        param: str = "prompt",
    ) -> Prepared:
        """Route on ``planned``'s ``known`` ids (``keys``: theirs) while the rest is encoded."""
        t1 = time.perf_counter()
        prep = Prepared(planned.estimate, keys, t1 - t0, 0.0, body, adapter, known)
        finish = (
            self._finish_chat_plan(prep, planned, max_tokens, param)
            if planned.chat
            else self._finish(prep, planned, max_tokens)
        )
        prep.rest = asyncio.get_running_loop().create_task(finish, name="kvroute-tokenize-rest")
        return prep

    async def _finish(self, prep: Prepared, planned: PromptPlan, max_tokens: int | None) -> None:
        """The rest of an overlapped prompt: its exact ids, checked as ``prepare`` checks them,
        and its keys and the speculative inserts of the decisions made so far completed."""
        ids = await self._exactly(
            prep, self.tokenizer.aencode_planned(planned, thread=True), "prompt"
        )
        if ids is None:
            return
        prep.error = too_long(len(ids), max_tokens, self.settings.max_model_len)
        if prep.error is not None:  # the engine is not to hold what it will reject
            return
        # inserts pending on the known keys go first; the rest once, below
        self.router.index.settle()
        start = len(prep.keys)
        prep.keys.extend(ids)
        prep.ids, prep.prompt_tokens = ids, len(ids)
        self._speculate_rest(prep, start)

    async def _finish_chat_plan(
        self, prep: Prepared, planned: PromptPlan, max_tokens: int | None, param: str
    ) -> None:
        """The rest of an overlapped rendered chat (a long new message), encoded on a
        thread; its ids start with the known ids, always."""
        chat = await self._exactly(
            prep, self.tokenizer.aencode_chat_plan(planned, thread=True), param
        )
        if chat is not None:
            self._complete_chat(prep, chat, max_tokens, kept=True)

    async def _exactly(self, prep: Prepared, encode: Awaitable[T], param: str) -> T | None:
        """An overlapped prompt's exact encode, or None with ``prep.error`` set to what its
        failure calls for (the request still gets an answer, the task no stray error)."""
        try:
            return await encode
        except (TokenizationError, UnicodeError) as exc:
            prep.error = _invalid_prompt(exc, param)
        except Exception:
            log.exception("pool %s: encoding the rest of a prompt failed", self.name)
            prep.error = ApiError(
                500, "tokenization failed", "internal_error", code="internal_error"
            )
        return None

    def _speculate_rest(self, prep: Prepared, start: int) -> None:
        """Attribute ``prep.keys[start:]`` (exact now) to the workers routed on the known
        ids, as the decisions would have had they seen them (those still in the pool)."""
        keys = prep.keys
        if start >= len(keys) or not self.router.speculate:
            return
        index = self.router.index
        live = set(index.workers())
        for decision, now in prep.routes:
            if decision.worker in live:
                index.speculate(decision.worker, keys, now, start=start)


def _invalid_prompt(exc: Exception, param: str) -> ApiError:
    """The 400 for text the tokenizer rejects (bad messages, a lone surrogate)."""
    if isinstance(exc, UnicodeError):
        return bad_request(f"prompt is not valid text: {exc}", code="invalid_prompt")
    return bad_request(str(exc), param=param, code="invalid_prompt")
