"""Workloads: deterministic, seeded request streams for the load driver and the simulators.

A request is a list of *segments* (system prompt, user turn, assistant reply, tool output,
document...) with arrival time and output length. Segments are stable objects: the same
system prompt is the same segment in every conversation that uses it, so prefixes are shared
exactly as in production traffic. A request renders as chat ``messages`` (roles), as one
completion ``prompt`` text (the segments joined), or as token ids (for the offline simulator
and token-id runs; see ``Tokens``).

Arrivals are open loop: every request's time is fixed in advance (Poisson starts, then a
think time between a conversation's turns), so a slow system faces the same offered load as
a fast one and queues grow as they would. A turn carries the previous turns' assistant
replies as the workload wrote them (not what the engine produced), which keeps every system
on identical prompts.

Kinds (all parameters have defaults; see the dataclasses):

* ``chat``: multi-turn conversations under a few shared system prompts;
* ``agent``: agent loops, each step appending a tool output to a growing context;
* ``shared_prefix``: SGLang's ``generated-shared-prefix`` (groups × prompts × prefix × question);
* ``trace``: a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``,
  ``output_length``, 512-token chained ``hash_ids``) replayed at a speed factor, each hash id
  a fixed pseudo-random run of token ids (token-id prompts only).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

__all__ = [
    "AgentWorkload",
    "ChatWorkload",
    "Segment",
    "SharedPrefixWorkload",
    "TraceWorkload",
    "WorkItem",
    "Workload",
    "make_workload",
]

Role = Literal["system", "user", "assistant", "tool", "text"]

# Common English words that are single tokens (with their leading space) in byte-level BPE
# vocabularies, so ``n`` words are about ``n`` tokens.
WORDS = tuple(
    [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "as",
        "with",
        "was",
        "on",
        "be",
        "by",
        "at",
        "this",
        "are",
        "from",
        "or",
        "have",
        "an",
        "they",
        "which",
        "one",
        "you",
        "were",
        "all",
        "we",
        "when",
        "there",
        "can",
        "been",
        "has",
        "more",
        "if",
        "will",
        "would",
        "their",
        "what",
        "so",
        "about",
        "out",
        "many",
        "then",
        "them",
        "these",
        "some",
        "her",
        "him",
        "into",
        "time",
        "two",
        "like",
        "other",
        "see",
        "could",
        "no",
        "make",
        "than",
        "first",
        "been",
        "its",
        "who",
        "now",
        "people",
        "my",
        "made",
        "over",
        "did",
        "down",
        "only",
        "way",
        "find",
        "use",
        "may",
        "water",
        "long",
        "little",
        "very",
        "after",
        "words",
        "called",
        "just",
        "where",
        "most",
        "know",
        "get",
        "through",
        "back",
        "much",
        "before",
        "go",
        "good",
        "new",
        "write",
        "our",
        "used",
        "me",
        "man",
        "too",
        "any",
        "day",
        "same",
        "right",
        "look",
        "think",
        "also",
        "around",
        "another",
        "came",
        "come",
        "work",
        "three",
        "word",
        "must",
        "because",
        "does",
        "part",
        "even",
        "place",
        "well",
        "such",
        "here",
        "take",
        "why",
        "things",
        "help",
        "put",
        "years",
        "different",
        "away",
        "again",
        "off",
        "went",
        "old",
        "number",
        "great",
        "tell",
        "men",
        "say",
        "small",
        "every",
        "found",
        "still",
        "between",
        "name",
        "should",
        "home",
        "big",
        "give",
        "air",
        "line",
        "set",
        "own",
        "under",
        "read",
        "last",
        "never",
        "us",
        "left",
        "end",
        "along",
        "while",
        "might",
        "next",
        "sound",
        "below",
        "saw",
        "something",
        "thought",
        "both",
        "few",
        "those",
        "always",
        "looked",
        "show",
        "large",
        "often",
        "together",
        "asked",
        "house",
        "world",
        "going",
        "want",
        "school",
        "important",
        "until",
        "form",
        "food",
        "keep",
        "children",
        "feet",
        "land",
        "side",
        "without",
        "boy",
        "once",
        "animals",
        "life",
        "enough",
        "took",
        "sometimes",
        "four",
        "head",
        "above",
        "kind",
        "began",
        "almost",
        "live",
        "page",
        "got",
        "earth",
        "need",
        "far",
        "hand",
        "high",
        "year",
        "mother",
        "light",
        "parts",
        "country",
        "father",
        "let",
        "night",
        "following",
        "picture",
        "being",
        "study",
        "second",
        "eyes",
        "soon",
        "times",
        "story",
        "boys",
        "since",
        "white",
        "days",
        "ever",
        "paper",
        "hard",
        "near",
        "sentence",
        "better",
        "best",
        "across",
        "during",
        "today",
        "others",
        "however",
        "sure",
        "means",
        "knew",
        "try",
        "told",
        "young",
        "miles",
        "sun",
        "ways",
        "thing",
        "whole",
        "hear",
        "example",
        "heard",
        "several",
        "change",
        "answer",
        "room",
        "sea",
        "against",
        "top",
        "turned",
        "learn",
        "point",
        "city",
        "play",
        "toward",
        "five",
        "using",
        "himself",
        "usually",
        "money",
        "seen",
        "car",
        "morning",
        "given",
    ]
)


@dataclass(frozen=True)
class Segment:
    """A piece of a prompt with a role; equal ``key`` means identical content."""

    key: str
    role: Role
    text: str = ""
    #: token ids (trace workloads, or text segments once tokenized)
    ids: tuple[int, ...] | None = None


@dataclass
class WorkItem:
    index: int
    at: float  # seconds after the start
    session: str
    segments: list[Segment]
    max_tokens: int
    #: the LoRA adapter the request asks for (its ``model``); None: the pool's base model
    model: str | None = None

    def messages(self) -> list[dict[str, str]]:
        """Chat messages: consecutive segments of one role merge into one message. A tool
        result carries the ``tool_call_id`` that OpenAI's schema requires (smg refuses the
        message without it), the same for its segment on every request that resends it."""
        out: list[dict[str, str]] = []
        for s in self.segments:
            role = "user" if s.role == "text" else s.role
            if out and out[-1]["role"] == role and role != "tool":
                out[-1]["content"] += s.text
            elif role == "tool":
                out.append({"role": role, "content": s.text, "tool_call_id": f"call_{s.key}"})
            else:
                out.append({"role": role, "content": s.text})
        return out

    def prompt_text(self) -> str:
        return "".join(s.text for s in self.segments)

    def prompt_ids(self) -> list[int]:
        out: list[int] = []
        for s in self.segments:
            if s.ids is None:
                raise ValueError(f"segment {s.key} has no token ids (tokenize the workload first)")
            out.extend(s.ids)
        return out


class Workload:
    """A named, deterministic stream of ``WorkItem`` sorted by arrival time."""

    name = "workload"
    #: "text": prompts are text; "ids": token ids only (trace replay)
    prompt_kind: Literal["text", "ids"] = "text"
    #: sessions (conversations, agents) start over time and then issue their turns, so a run
    #: starting from nothing ramps up; False: requests arrive independently at a steady rate
    sessions_ramp: ClassVar[bool] = False

    def items(self) -> Iterator[WorkItem]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def scaled(self, rate: float) -> Workload:
        """The same requests with arrivals compressed/stretched to ``rate`` requests/s."""
        return _Rescaled(self, rate)


def _text(rng: random.Random, n_tokens: int) -> str:
    return "".join(" " + rng.choice(WORDS) for _ in range(max(1, n_tokens)))


def _poisson_starts(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return out


# -- multi-turn chat ---------------------------------------------------------------------------


@dataclass
class ChatWorkload(Workload):
    conversations: int = 200
    turns: tuple[int, int] = (3, 8)  # per conversation, inclusive range
    system_prompts: int = 8  # distinct shared system prompts
    system_tokens: int = 2000
    user_tokens: tuple[int, int] = (50, 300)
    assistant_tokens: tuple[int, int] = (50, 200)  # reply length = max_tokens of that turn
    think_time: float = 8.0  # seconds between a conversation's turns (mean, exponential)
    rate: float = 2.0  # conversations started per second
    #: LoRA adapters: system prompt i is served by the base model and these in turn
    #: (i mod (1 + len)), so each conversation asks for its system prompt's adapter
    adapters: tuple[str, ...] = ()
    seed: int = 0
    name: str = "chat"
    sessions_ramp: ClassVar[bool] = True

    def items(self) -> Iterator[WorkItem]:
        rng = random.Random(self.seed)
        models: list[str | None] = [None, *self.adapters]
        systems = [
            Segment(
                f"sys{i}", "system", _text(random.Random(f"{self.seed}-sys{i}"), self.system_tokens)
            )
            for i in range(self.system_prompts)
        ]
        starts = _poisson_starts(rng, self.conversations, self.rate)
        items: list[WorkItem] = []
        for c, t0 in enumerate(starts):
            crng = random.Random(f"{self.seed}-conv{c}")
            s = crng.randrange(len(systems))
            history, model = [systems[s]], models[s % len(models)]
            t = t0
            for turn in range(crng.randint(*self.turns)):
                user = Segment(f"c{c}u{turn}", "user", _text(crng, crng.randint(*self.user_tokens)))
                reply_len = crng.randint(*self.assistant_tokens)
                history = [*history, user]
                items.append(WorkItem(0, t, f"conv-{c}", history, reply_len, model))
                reply = Segment(f"c{c}a{turn}", "assistant", _text(crng, reply_len))
                history = [*history, reply]
                t += crng.expovariate(1.0 / self.think_time) if self.think_time > 0 else 0.0
        return _numbered(items)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "chat", **_fields(self)}


# -- agent loops -------------------------------------------------------------------------------


@dataclass
class AgentWorkload(Workload):
    agents: int = 50
    steps: tuple[int, int] = (5, 15)
    system_prompts: int = 4
    system_tokens: int = 3000
    task_tokens: tuple[int, int] = (100, 400)
    tool_tokens: tuple[int, int] = (200, 1500)  # each step appends a tool output
    call_tokens: tuple[int, int] = (20, 80)  # the agent's tool call (= max_tokens)
    step_gap: float = 1.0  # seconds between steps (tool execution time, mean)
    rate: float = 1.0  # agents started per second
    seed: int = 0
    name: str = "agent"
    sessions_ramp: ClassVar[bool] = True

    def items(self) -> Iterator[WorkItem]:
        rng = random.Random(self.seed)
        systems = [
            Segment(
                f"asys{i}",
                "system",
                _text(random.Random(f"{self.seed}-asys{i}"), self.system_tokens),
            )
            for i in range(self.system_prompts)
        ]
        starts = _poisson_starts(rng, self.agents, self.rate)
        items: list[WorkItem] = []
        for a, t0 in enumerate(starts):
            arng = random.Random(f"{self.seed}-agent{a}")
            ctx = [
                systems[arng.randrange(len(systems))],
                Segment(f"a{a}task", "user", _text(arng, arng.randint(*self.task_tokens))),
            ]
            t = t0
            for step in range(arng.randint(*self.steps)):
                call_len = arng.randint(*self.call_tokens)
                items.append(WorkItem(0, t, f"agent-{a}", list(ctx), call_len))
                ctx += [
                    Segment(f"a{a}c{step}", "assistant", _text(arng, call_len)),
                    Segment(f"a{a}t{step}", "tool", _text(arng, arng.randint(*self.tool_tokens))),
                ]
                t += arng.expovariate(1.0 / self.step_gap) if self.step_gap > 0 else 0.0
        return _numbered(items)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "agent", **_fields(self)}


# -- shared-prefix groups ------------------------------------------------------------------------


@dataclass
class SharedPrefixWorkload(Workload):
    """Groups of prompts under one shared prefix each, questions in random order.

    ``hot_after`` >= 0 makes a prefix hot suddenly (a launch, a viral prompt): from the
    request with that index on (arrival order), each request carries one common
    ``hot_prefix_tokens``-token prefix instead of its group's with probability ``hot_share``.
    """

    groups: int = 16
    prompts_per_group: int = 32
    prefix_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 64
    rate: float = 8.0  # requests per second
    seed: int = 0
    hot_after: int = -1
    hot_share: float = 0.8
    hot_prefix_tokens: int = 6000
    name: str = "shared_prefix"

    def items(self) -> Iterator[WorkItem]:
        rng = random.Random(self.seed)
        prefixes = [
            Segment(
                f"gp{g}", "system", _text(random.Random(f"{self.seed}-gp{g}"), self.prefix_tokens)
            )
            for g in range(self.groups)
        ]
        pairs = [(g, q) for g in range(self.groups) for q in range(self.prompts_per_group)]
        rng.shuffle(pairs)
        starts = _poisson_starts(rng, len(pairs), self.rate)
        hot_seg, hot_items = self._hot(len(pairs))
        items = [
            WorkItem(
                0,
                t,
                f"group-{g}",
                [
                    hot_seg if i in hot_items else prefixes[g],
                    Segment(
                        f"g{g}q{q}",
                        "user",
                        _text(random.Random(f"{self.seed}-g{g}q{q}"), self.question_tokens),
                    ),
                ],
                self.output_tokens,
            )
            for i, ((g, q), t) in enumerate(zip(pairs, starts, strict=True))
        ]
        return _numbered(items)

    def _hot(self, n: int) -> tuple[Segment, set[int]]:
        """The hot prefix and the indices of the requests that carry it (own random
        stream: without ``hot_after`` the workload is exactly what it was)."""
        seg = Segment(
            "hot",
            "system",
            _text(random.Random(f"{self.seed}-hot"), self.hot_prefix_tokens)
            if self.hot_after >= 0
            else "",
        )
        if self.hot_after < 0:
            return seg, set()
        rng = random.Random(f"{self.seed}-hot-items")
        return seg, {i for i in range(self.hot_after, n) if rng.random() < self.hot_share}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "shared_prefix", **_fields(self)}


# -- Mooncake trace ------------------------------------------------------------------------------


@dataclass
class TraceWorkload(Workload):
    """Replays a Mooncake-format JSONL trace; ``speed`` > 1 compresses time."""

    path: str = ""
    speed: float = 1.0
    limit: int | None = None
    block_tokens: int = 512
    vocab: int = 100_000
    seed: int = 0
    name: str = "trace"
    prompt_kind: Literal["text", "ids"] = "ids"

    def records(self) -> Iterator[dict[str, Any]]:
        with open(self.path) as f:
            for n, line in enumerate(f):
                if self.limit is not None and n >= self.limit:
                    return
                if line.strip():
                    yield json.loads(line)

    def items(self) -> Iterator[WorkItem]:
        cache: dict[int, Segment] = {}
        for i, rec in enumerate(self.records()):
            try:
                ts, n_in, n_out, hids = (
                    float(rec["timestamp"]),
                    int(rec["input_length"]),
                    int(rec["output_length"]),
                    rec["hash_ids"],
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(
                    f"{self.path}: record {i} is not a Mooncake trace record: {exc}"
                ) from None
            segs = []
            left = n_in
            for h in hids:
                seg = cache.get(h)
                if seg is None:
                    seg = cache[h] = self.block(h)
                if left < self.block_tokens:  # the last block may be partial
                    seg = Segment(f"h{h}:{left}", "text", ids=seg.ids[:left])  # type: ignore[index]
                segs.append(seg)
                left -= len(seg.ids or ())
                if left <= 0:
                    break
            yield WorkItem(i, ts / 1000.0 / self.speed, f"trace-{i}", segs, max(1, n_out))

    def block(self, h: int) -> Segment:
        """The fixed pseudo-random run of token ids that hash id ``h`` stands for."""
        rng = random.Random(self.seed * 1_000_003 + h)
        return Segment(
            f"h{h}",
            "text",
            ids=tuple(rng.randrange(1, self.vocab) for _ in range(self.block_tokens)),
        )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": "trace",
            "path": self.path,
            "speed": self.speed,
            "limit": self.limit,
        }


def write_synthetic_trace(
    path: Path,
    requests: int = 12_031,
    duration_s: float = 3540.0,
    seed: int = 0,
    mean_input: int = 12_035,
    mean_output: int = 343,
    block_tokens: int = 512,
) -> None:
    """A Mooncake-format trace with the published conversation trace's shape.

    The real trace is not redistributable here; this one follows its published statistics:
    mean input ~12k tokens with a long tail (median ~7k), mean output ~343, every request
    sharing block 0 (a hot prefix), about a third of blocks reused across requests (follow-up
    turns extend earlier requests' hash chains).
    """
    rng = random.Random(seed)
    next_id = 1
    sessions: list[list[int]] = []
    t = 0.0
    rate = requests / duration_s
    with open(path, "w") as f:
        for _ in range(requests):
            t += rng.expovariate(rate)
            n_in = max(
                block_tokens // 4, int(rng.lognormvariate(math.log(mean_input) - 0.55, 1.05))
            )
            n_in = min(n_in, 128_000)
            blocks = -(-n_in // block_tokens)
            if sessions and rng.random() < 0.45:  # a follow-up: extend an earlier chain
                base = rng.choice(sessions)
                keep = min(len(base), blocks - 1) if blocks > 1 else 1
                chain = base[:keep]
            else:
                chain = [0]  # block 0: the hot shared prefix
            while len(chain) < blocks:
                chain.append(next_id)
                next_id += 1
            sessions.append(chain)
            if len(sessions) > 2000:
                sessions.pop(rng.randrange(len(sessions)))
            n_out = max(1, int(rng.expovariate(1.0 / mean_output)))
            f.write(
                json.dumps(
                    {
                        "timestamp": int(t * 1000),
                        "input_length": n_in,
                        "output_length": n_out,
                        "hash_ids": chain,
                    }
                )
                + "\n"
            )


# -- helpers -------------------------------------------------------------------------------------


class _Rescaled(Workload):
    def __init__(self, inner: Workload, rate: float) -> None:
        self.inner = inner
        self.rate = rate
        self.name = inner.name
        self.prompt_kind = inner.prompt_kind

    def items(self) -> Iterator[WorkItem]:
        items = list(self.inner.items())
        if len(items) < 2 or self.rate <= 0:
            return iter(items)
        span = items[-1].at - items[0].at
        native = (len(items) - 1) / span if span > 0 else float("inf")
        factor = native / self.rate
        for it in items:
            it.at = it.at * factor
        return iter(items)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "rate": self.rate}


def _numbered(items: list[WorkItem]) -> Iterator[WorkItem]:
    items.sort(key=lambda it: it.at)
    for i, it in enumerate(items):
        it.index = i
    return iter(items)


def _fields(obj: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if k != "name"}


WORKLOADS: dict[str, type[Workload]] = {
    "chat": ChatWorkload,
    "agent": AgentWorkload,
    "shared_prefix": SharedPrefixWorkload,
    "trace": TraceWorkload,
}


def make_workload(kind: str, **params: Any) -> Workload:
    cls = WORKLOADS.get(kind)
    if cls is None:
        raise ValueError(f"unknown workload {kind!r}; known: {', '.join(WORKLOADS)}")
    fields_ = {f for f in cls.__dataclass_fields__}  # type: ignore[attr-defined]
    unknown = set(params) - fields_
    if unknown:
        raise ValueError(
            f"unknown parameter(s) for workload {kind!r}: {', '.join(sorted(unknown))}"
        )
    for k, v in params.items():
        if isinstance(v, list):
            params[k] = tuple(v)
    return cls(**params)


def tokenize_segments(items: Sequence[WorkItem], encode: Any) -> None:
    """Give every text segment its token ids (``encode(text) -> list[int]``), once per key."""
    done: dict[str, tuple[int, ...]] = {}
    for it in items:
        for i, s in enumerate(it.segments):
            if s.ids is not None:
                continue
            ids = done.get(s.key)
            if ids is None:
                ids = done[s.key] = tuple(encode(s.text))
            it.segments[i] = Segment(s.key, s.role, s.text, ids)
