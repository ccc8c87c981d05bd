"""Routing policies: the small interface every policy implements, and their registry.

A policy sees one request and a ``PoolView`` of the eligible workers (the pool's healthy
workers minus any excluded for this request): their prefix matches from the shadow index
and their load, with the pool already ordered by load (idle workers; busy workers by queued
prefill), so a policy can decide without scanning every worker. It returns a ``Decision``
that carries its own explanation. Policies live one per module in ``gateway/routing/policies/`` and
register themselves by name; ``make_policy(name)`` builds one.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, overload

from mypy_extensions import mypyc_attr

from gateway.routing.costmodel import CostModel
from gateway.routing.load import LoadTracker, LoadView
from gateway.routing.popularity import PrefixPopularity
from gateway.routing.replication import WarmupBook

__all__ = [
    "CandidateScore",
    "Decision",
    "Policy",
    "PolicyContext",
    "PoolView",
    "RouteRequest",
    "WorkerSet",
    "make_policy",
    "policy_names",
    "register",
]


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of a request."""

    keys: Sequence[int]  # canonical block keys of the prompt, from the root
    prompt_tokens: int
    block_size: int
    session_key: str | None = None
    engine_block_size: int = 1  # the engines reuse whole engine blocks only
    adapter: str | None = None  # the LoRA adapter asked for (keys are on its chain)

    def matched_tokens(self, blocks: int) -> int:
        """Prompt tokens the engine will reuse from ``blocks`` matched canonical blocks:
        never the prompt's last token, which vLLM and SGLang always compute (it yields the
        first output token), and only whole engine blocks (vLLM on CPU runs 32-token blocks
        under kvroute's 16)."""
        usable = max(self.prompt_tokens - 1, 0) // self.block_size
        tokens = min(blocks, usable) * self.block_size
        e = self.engine_block_size
        return tokens if e <= 1 else tokens // e * e


@dataclass(frozen=True)
class CandidateScore:
    """One line of a decision's explanation."""

    worker: str
    matched_tokens: int
    predicted_ttft_ms: float | None
    score: float | None


@dataclass(frozen=True)
class Decision:
    worker: str
    policy: str
    reason: str  # low-cardinality, for metrics: see each policy's REASONS
    matched_tokens: int
    predicted_ttft_ms: float | None
    candidates: tuple[CandidateScore, ...] = ()  # evaluated candidates (all, with explain)


class WorkerSet(Sequence[str]):
    """A bit set of a pool's workers as a read-only sequence of ids (by increasing bit).

    Size and membership cost one integer operation; the ids are listed only when iterated
    or indexed, so a policy that asks "is my pick a holder, and how many are there?" of a
    prefix the whole fleet holds does not pay a step per holder."""

    __slots__ = ("_list", "bits", "loads")

    def __init__(self, loads: LoadTracker, bits: int) -> None:
        self.loads = loads
        self.bits = bits
        self._list: list[str] | None = None

    def _names(self) -> list[str]:
        if self._list is None:
            self._list = self.loads.names(self.bits)
        return self._list

    def __len__(self) -> int:
        return self.bits.bit_count()

    def __contains__(self, worker: object) -> bool:
        return isinstance(worker, str) and bool(self.bits & self.loads.bit(worker))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        return self._names()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WorkerSet):
            return self.bits == other.bits and self.loads is other.loads
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"WorkerSet({self._names()!r})"


class PoolView:
    """The eligible workers of a pool for one request, with matches and load order.

    Matches are kept as bit sets (``masks``, in the load tracker's bit space: the index's
    slots when a ``Router`` built it), so a prefix that most of a large fleet holds costs one
    integer operation, not a step per holder; ``levels`` lists the workers, decoded when
    asked."""

    _levels: list[tuple[int, Sequence[str]]] | None

    def __init__(
        self,
        loads: LoadTracker,
        masks: list[tuple[int, int]],
        exclude: frozenset[str] = frozenset(),
    ) -> None:
        """``masks`` already without excluded and untrusted workers (``from_masks``)."""
        self.loads = loads
        self.exclude = exclude
        #: [(matched blocks, eligible workers' bits)], longest first, none empty;
        #: ``untrusted`` workers stay eligible but show no match: they compete on load alone
        self.masks = masks
        eligible = loads.member_bits()
        if exclude:
            for w in exclude:
                eligible &= ~loads.bit(w)
        #: bits of the eligible workers
        self.eligible_bits = eligible
        self._levels = None
        self._matches: dict[str, int] | None = None
        self._workers: list[str] | None = None
        #: eligible workers without the request's LoRA adapter loaded (they pay its load)
        self.adapter_missing: frozenset[str] = frozenset()

    @classmethod
    def from_levels(
        cls,
        loads: LoadTracker,
        levels: list[tuple[int, list[str]]],
        exclude: frozenset[str] = frozenset(),
        untrusted: frozenset[str] = frozenset(),
    ) -> PoolView:
        """From ``ShadowIndex.match_levels`` (workers by name)."""
        members = loads.members()
        hidden = exclude | untrusted
        if hidden:
            levels = [(n, [w for w in ws if w not in hidden]) for n, ws in levels]
        levels = [
            (n, ws if all(map(members.__contains__, ws)) else [w for w in ws if w in members])
            for n, ws in levels
        ]
        levels = [(n, ws) for n, ws in levels if ws]
        bits = loads.bits()
        masks = [(n, sum(bits[w] for w in ws)) for n, ws in levels]
        view = PoolView(loads, masks, exclude)
        view._levels = list(levels)
        return view

    @classmethod
    def from_masks(
        cls,
        loads: LoadTracker,
        masks: list[tuple[int, int]],
        exclude: frozenset[str] = frozenset(),
        untrusted: frozenset[str] = frozenset(),
    ) -> PoolView:
        """From ``ShadowIndex.match_masks`` (its bits must be the tracker's: ``bind_bits``)."""
        keep = loads.member_bits()
        if exclude or untrusted:
            for w in exclude | untrusted:
                keep &= ~loads.bit(w)
        return PoolView(loads, [(n, b & keep) for n, b in masks if b & keep], exclude)

    @classmethod
    def from_matches(
        cls, loads: LoadTracker, matches: dict[str, int], exclude: frozenset[str] = frozenset()
    ) -> PoolView:
        by: dict[int, list[str]] = {}
        for w, n in matches.items():
            by.setdefault(n, []).append(w)
        return PoolView.from_levels(loads, sorted(by.items(), reverse=True), exclude)

    @property
    def levels(self) -> list[tuple[int, Sequence[str]]]:
        """[(matched blocks, eligible workers)], longest first (ShadowIndex.match_levels);
        the workers as a ``WorkerSet`` (listed only if iterated)."""
        if self._levels is None:
            self._levels = [(n, WorkerSet(self.loads, b)) for n, b in self.masks]
        return self._levels

    @property
    def size(self) -> int:
        """How many workers are eligible."""
        return self.eligible_bits.bit_count()

    @property
    def idle_bits(self) -> int:
        """Bits of the eligible idle workers."""
        return self.loads.idle_bits() & self.eligible_bits

    @property
    def matches(self) -> dict[str, int]:
        """Eligible worker -> matched blocks (workers without a match absent)."""
        if self._matches is None:
            self._matches = {w: n for n, ws in self.levels for w in ws}
        return self._matches

    @property
    def workers(self) -> list[str]:
        """Eligible workers, sorted by id."""
        if self._workers is None:
            allw = self.loads.workers()
            self._workers = [w for w in allw if w not in self.exclude] if self.exclude else allw
        return self._workers

    def view(self, worker: str) -> LoadView:
        return self.loads.view(worker)

    def idle(self) -> list[str]:
        """Eligible idle workers (no queued prefill, nothing running)."""
        idle = self.loads.idle_workers()
        if not self.exclude:
            return idle
        return [w for w in idle if w not in self.exclude]

    def busy_by_key(self) -> Iterator[tuple[float, str]]:
        """Eligible busy workers as (order key, worker) by increasing key (see LoadTracker)."""
        if not self.exclude:
            return self.loads.busy_by_key()
        ex = self.exclude
        return ((k, w) for k, w in self.loads.busy_by_key() if w not in ex)

    def busy_count(self) -> int:
        if not self.exclude:
            return self.loads.busy_count()
        return self.size - self.idle_bits.bit_count()


@dataclass
class PolicyContext:
    """Shared, per-pool inputs: the cost model, a seeded random source, prefix popularity,
    and the warm-ups the policy asked for (the owner sends them: ``WarmupBook.take``).
    ``computed(worker, key)``: whether the engine has reported the block ``key`` on
    ``worker`` (a match may be only speculative: a prefill still under way); None: unknown.
    ``speculated_at(worker, key)``: when the decision that attributed ``key`` to ``worker``
    speculatively was made (None: not speculative, or unknown).
    ``continues(worker, key)``: whether ``worker``'s chain goes on past the block ``key``
    (``ShadowIndex.continues``); None: unknown."""

    cost: CostModel = field(default_factory=CostModel)
    rng: random.Random = field(default_factory=random.Random)
    popularity: PrefixPopularity = field(default_factory=PrefixPopularity)
    warmups: WarmupBook = field(default_factory=WarmupBook)
    now: float = 0.0
    computed: Callable[[str, int], bool] | None = None
    speculated_at: Callable[[str, int], float | None] | None = None
    continues: Callable[[str, int], bool] | None = None


@mypyc_attr(allow_interpreted_subclasses=True)  # plug-in policies subclass it
class Policy(ABC):
    """Chooses a worker among a pool's eligible workers."""

    name: ClassVar[str]
    #: False: the router skips the index lookup (the policy ignores prefix matches)
    uses_index: ClassVar[bool] = True
    REASONS: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def choose(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, explain: bool = False
    ) -> Decision:
        """Pick an eligible worker (the pool is never empty). ``explain``: score everyone."""


P = TypeVar("P", bound=type[Policy])
_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: P) -> P:
    """Make a policy available by its ``name`` (called after the class: a decorated class
    cannot be compiled)."""
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    import gateway.routing.policies  # noqa: F401  (each module registers itself)


def policy_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def make_policy(name: str, **params: Any) -> Policy:
    """A policy instance by registered name; unknown names and parameters are errors."""
    _load_builtin()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    factory: Callable[..., Policy] = cls
    try:
        return factory(**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from None


def simple_decision(
    policy: Policy, request: RouteRequest, worker: str, pool: PoolView, reason: str, explain: bool
) -> Decision:
    """A decision for policies that do not predict TTFT (explanation: matches only)."""
    matched = request.matched_tokens(pool.matches.get(worker, 0))
    cands: tuple[CandidateScore, ...] = ()
    if explain:
        cands = tuple(
            CandidateScore(w, request.matched_tokens(pool.matches.get(w, 0)), None, None)
            for w in pool.workers
        )
    return Decision(worker, policy.name, reason, matched, None, cands)
