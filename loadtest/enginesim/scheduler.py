"""The engine core: continuous batching over the KV cache, stepped by an explicit clock.

Pure and synchronous, no I/O: the live server steps it in real time, the offline cluster
simulator in virtual time. Per step and per request the work is arithmetic; no loop runs per
token (decode progress is one shared counter, finishes come off a heap).

Policy (vLLM V1's unified scheduler, simplified):

* Each step's token budget (``max_num_batched_tokens``) goes first to every decoding
  sequence (one token each), then to prefills in flight, then to newly admitted requests,
  first come first served, up to ``max_num_seqs`` running. Prefills are chunked to the
  remaining budget (with ``chunked_prefill`` off a prompt must fit whole, unless alone).
* Admission matches the prompt against the radix cache (at most ``(len - 1) // block_size``
  blocks, so at least one token is computed) and skips prefill of the matched blocks.
* Memory: admission reserves blocks for the whole request (uncached prompt + ``max_tokens``),
  evicting unpinned cached blocks LRU first if needed. When even eviction cannot make room,
  the head of the queue waits (head-of-line, like vLLM's FCFS) until running requests
  finish. Running requests therefore never run out of blocks, and nothing is preempted.
* A request's full prompt blocks enter the cache when a step schedules their computation
  (``commit_on_schedule``, vLLM: ``KVCacheManager.allocate_slots`` commits them before the
  scheduler matches the next waiting request, so a request admitted in the same step as its
  prefix's first computation reuses it), or when its prefill completes (SGLang, and a
  request whose KV another engine prefilled); blocks of generated tokens when it finishes
  (``cache_outputs``).
* LoRA: a batch holds at most ``max_loras`` adapters (the base model needs none). A waiting
  request whose adapter would exceed that waits; vLLM (``skip_lora_waits``) skips it and
  schedules the requests behind it (``Scheduler.schedule``: "Scheduling would exceed
  max_loras, skip"), SGLang stops the batch there (``get_new_batch_prefill``: ``break``).
* Output length is exactly ``max_tokens`` (as with ``ignore_eos``): load tests are
  deterministic. Generated token ids cycle through ``output_tokens``.
* Bigram keys (``CacheConfig.bigram_keys``, SGLang with EAGLE/MTP): the radix tree's atoms
  are token pairs ``(t_i, t_i+1)``, one per KV slot, so a sequence of T tokens with KV is
  T-1 atoms and a block holds ``block_size`` atoms. As in SGLang (``RadixKey`` with
  ``limit = N - 1`` raw tokens, then the bigram view), a prompt of N tokens is matched on
  the bigrams of its first N-1 tokens: at most N-2 positions, and position i is reused only
  if tokens i and i+1 both match. ``cached_tokens`` counts matched positions (atoms), which
  is what SGLang reports. Conversions are numpy slices, and the default path has none.

Fast-forward: ``step(now, until=...)`` runs k identical decode iterations in one call when
the batch is decode-only and nothing can be admitted (k stops at the next finish and at
``until``), which is what lets a discrete-event simulator skip ahead cheaply.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mypy_extensions import mypyc_attr

from loadtest.enginesim.config import CacheConfig, SchedulerConfig
from loadtest.enginesim.kvcache import (
    TOKEN_BYTES,
    BlockAllocator,
    KVEvent,
    RadixCache,
    bigram_atoms,
    pack_tokens,
)
from loadtest.enginesim.lora import LoraConfig, LoraSlots
from loadtest.enginesim.timing import TimingModel

__all__ = [
    "CoreStats",
    "EngineCore",
    "RequestState",
    "RequestTooLarge",
    "SimRequest",
    "StepResult",
]


@mypyc_attr(native_class=False)  # compiled: an exception stays a Python class
class RequestTooLarge(ValueError):
    """The request could never fit in the KV pool."""


class RequestState(enum.IntEnum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    FINISHED = 3
    ABORTED = 4


@dataclass(eq=False, slots=True)
class SimRequest:
    """One generation request as the core sees it. Times are on the caller's clock."""

    rid: int
    tokens: bytes  # prompt, uint32 LE
    prompt_len: int
    max_tokens: int
    arrival: float
    tag: Any = None  # free for the caller (the live server keeps its stream here)
    state: RequestState = RequestState.WAITING
    cached_tokens: int = 0  # prompt tokens (bigram keys: positions) cached at admission
    computed_tokens: int = 0  # prompt tokens with KV so far (cached + prefilled)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_output: int = 0  # exact except while decoding (see EngineCore.output_len)
    _node: Any = field(default=None, repr=False)  # pinned cache node
    _blocks: list[int] = field(default_factory=list, repr=False)  # reserved, not yet cached
    _clock0: int = 0  # decode clock at the first token
    _key: bytes | None = field(default=None, repr=False)  # bigram keys: the prompt's atoms
    #: disaggregated decode: the prompt's KV came from a prefill engine, so only its last
    #: token is computed here (the transferred blocks enter this engine's cache as usual)
    remote: bool = False
    lora: str | None = None  # the LoRA adapter asked for (its own cache tree and slot)
    #: the tokens it generates (uint32 LE), when the caller knows them (a replayed log: the
    #: answer its conversation's next turn sent back); None: the engine's output pattern
    output: bytes | None = None


@dataclass(slots=True)
class StepResult:
    """What one ``step`` did; everything in it happened at ``start + duration``."""

    start: float
    duration: float = 0.0
    steps: int = 0  # engine iterations (> 1 only when fast-forwarding decode)
    prefill_tokens: int = 0
    decode_seqs: int = 0  # sequences that decoded (each made ``steps`` tokens)
    scheduled: list[SimRequest] = field(default_factory=list)  # admitted in this step
    first_token: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass
class CoreStats:
    """Cumulative counters (the engines' Prometheus counters are read from these)."""

    prompt_tokens: int = 0
    cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    cache_hits: int = 0  # of those, tokens found
    generation_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    busy_time: float = 0.0
    lora_loads: int = 0  # LoRA adapters loaded into a GPU slot


class EngineCore:
    """Scheduler + KV cache + timing of one simulated engine (see the module docstring).

    Typical driving loop (virtual time)::

        req = core.add_request(tokens, max_tokens, now=t)
        for res in core.advance(until=t_next):   # or: res = core.step(now)
            ...  # res.first_token / res.finished / res.events at res.end
    """

    def __init__(
        self,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        timing: TimingModel,
        *,
        evict_whole_nodes: bool = False,
        commit_on_schedule: bool = False,
        skip_lora_waits: bool = False,
        record_events: bool = True,
        output_tokens: Sequence[int] = (1,),
        lora: LoraConfig | None = None,
    ) -> None:
        self.block_size = cache.block_size
        self.commit_on_schedule = commit_on_schedule and not cache.bigram_keys
        self.skip_lora_waits = skip_lora_waits
        self.cache_outputs = cache.cache_outputs
        self.bigram = cache.bigram_keys
        self._unkeyed = 1 if cache.bigram_keys else 0  # tokens with KV but no key atom
        self.sched = scheduler
        self.timing = timing
        self.allocator = BlockAllocator(cache.kv_blocks)
        self.cache = RadixCache(
            self.allocator,
            cache.block_size,
            evict_whole_nodes=evict_whole_nodes,
            record_events=record_events,
            atom_bytes=cache.atom_bytes,
        )
        if not output_tokens:
            raise ValueError("output_tokens must not be empty")
        self.output_tokens = list(output_tokens)
        self._pattern = pack_tokens(self.output_tokens)
        self.stats = CoreStats()
        self._waiting: deque[SimRequest] = deque()
        self._prefilling: list[SimRequest] = []
        self._num_decoding = 0
        self._finish_heap: list[tuple[int, int, SimRequest]] = []
        self._decode_clock = 0
        self._free_at = 0.0  # when the current step ends (the engine is free)
        self._next_rid = 0
        self._private_blocks = 0  # reserved by requests, not in the cache
        self._waiting_tokens = 0
        self._blocked = False  # the queue head did not fit; retry only after blocks free up
        lora = lora or LoraConfig()
        self.adapters = frozenset(lora.adapters)
        self.loras = LoraSlots(lora.max_loras, lora.load_ms / 1000.0 / timing.speedup)
        self._load_s = 0.0  # adapter loads the next step waits for

    # -- inputs ----------------------------------------------------------------------------

    def add_request(
        self,
        tokens: Sequence[int] | bytes,
        max_tokens: int,
        now: float,
        *,
        tag: Any = None,
        remote: bool = False,
        lora: str | None = None,
        output: bytes | None = None,
    ) -> SimRequest:
        """Queue a request that arrived at ``now`` (``remote``: its prompt's KV was prefilled
        by another engine; ``lora``: for that LoRA adapter, one of the configured ones;
        ``output``: the tokens it generates, uint32 LE, padded with the engine's pattern
        when shorter). Raises ValueError if it is malformed."""
        if lora is not None and lora not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {lora!r}")
        data = pack_tokens(tokens)
        prompt_len = len(data) // TOKEN_BYTES
        if prompt_len < 1:
            raise ValueError("the prompt must contain at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if self._blocks_for(prompt_len + max_tokens - 1) > self.allocator.num_blocks:
            raise RequestTooLarge(
                f"{prompt_len} prompt + {max_tokens} output tokens exceed the KV pool "
                f"({self.allocator.num_blocks} blocks of {self.block_size})"
            )
        if not self.has_work():
            self._free_at = max(self._free_at, now)
        req = SimRequest(
            self._next_rid,
            data,
            prompt_len,
            max_tokens,
            now,
            tag,
            remote=remote,
            lora=lora,
            output=output,
        )
        self._next_rid += 1
        self._waiting.append(req)
        self._waiting_tokens += prompt_len
        return req

    def abort(self, req: SimRequest, now: float) -> None:
        """Drop a request (client gone); its blocks are freed, cached blocks stay cached."""
        state = req.state
        if state == RequestState.WAITING:
            self._waiting.remove(req)
            self._waiting_tokens -= req.prompt_len
            self._blocked = False  # the head may have changed
        elif state == RequestState.PREFILL:
            self._prefilling.remove(req)
            self._release(req, now)
        elif state == RequestState.DECODE:
            req.num_output = self.output_len(req)
            self._num_decoding -= 1
            self._release(req, now)
        else:
            return
        req.state = RequestState.ABORTED
        self.stats.aborted += 1
        self.stats.generation_tokens += req.num_output

    def reset_prefix_cache(self) -> bool:
        """Clear the cache like vLLM's ``/reset_prefix_cache``: refused while requests run."""
        if self.num_running:
            return False
        return self.cache.clear()

    # -- stepping --------------------------------------------------------------------------

    def step(self, now: float, until: float | None = None) -> StepResult:
        """Run one engine iteration starting at ``max(now, end of the previous step)``.

        Returns what the iteration produced; ``duration`` 0 and ``steps`` 0 when idle. With
        ``until``, a decode-only batch is fast-forwarded over several iterations (see the
        module docstring).
        """
        start = max(now, self._free_at)
        res = StepResult(start)
        n_dec = self._num_decoding
        budget = self.sched.max_num_batched_tokens - n_dec
        chunks = self._continue_prefills(budget)
        if self.commit_on_schedule:
            for req, c in chunks:
                self._commit(req, c, start)
        budget -= sum(c for _, c in chunks)
        self._admit_waiting(start, budget, chunks, res.scheduled, n_dec)
        if not chunks and not n_dec:
            self._free_at = start
            return res
        prefill_tokens = sum(c for _, c in chunks)
        attended: float | None = None  # "batch": the step's prefill tokens squared
        if self.timing.attention == "sequence":
            attended = float(sum(c * (c + 2 * req.computed_tokens) for req, c in chunks))
        dt = self.timing.step_seconds(prefill_tokens, n_dec, self.kv_usage, attended)
        dt += self._load_s
        self._load_s = 0.0
        k = 1
        if until is not None and not chunks:
            k = self._steps_to_next_finish()
            if until - start < k * dt:
                k = max(1, int((until - start) / dt))
        end = start + k * dt
        if n_dec:
            self._decode(k, end, res.finished)
        for req, c in chunks:
            req.computed_tokens += c
            if req.computed_tokens == req.prompt_len:
                self._prefill_done(req, end, res)
        res.duration = end - start
        res.steps = k
        res.prefill_tokens = prefill_tokens
        res.decode_seqs = n_dec
        res.events = self.cache.take_events()
        self._free_at = end
        self.stats.steps += k
        self.stats.busy_time += res.duration
        return res

    def advance(self, until: float) -> list[StepResult]:
        """Run steps back to back from the engine's clock while they start before ``until``.

        The last step may end after ``until`` (a step in flight is not interrupted).
        """
        out: list[StepResult] = []
        while self.has_work() and self._free_at < until:
            res = self.step(self._free_at, until)
            if not res.steps:
                break
            out.append(res)
        return out

    def take_events(self) -> list[KVEvent]:
        """Cache events not yet returned by a step (e.g. after ``reset_prefix_cache``)."""
        return self.cache.take_events()

    # -- state -----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._num_decoding)

    @property
    def free_at(self) -> float:
        """When the step in flight ends (the engine's clock)."""
        return self._free_at

    @property
    def num_running(self) -> int:
        return len(self._prefilling) + self._num_decoding

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens queued: waiting requests in full plus the rest of prefills in flight."""
        rest = sum(r.prompt_len - r.computed_tokens for r in self._prefilling)
        return self._waiting_tokens + rest

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (pinned cached blocks + reservations)."""
        return self.cache.pinned_blocks + self._private_blocks

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool held by running requests (vLLM's ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.allocator.num_blocks

    def lora_requests(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, of waiting ones), sorted, as vLLM reports them."""
        waiting = sorted({r.lora for r in self._waiting if r.lora is not None})
        return sorted(self.loras.in_use), waiting

    def output_len(self, req: SimRequest) -> int:
        """Tokens ``req`` has generated so far."""
        if req.state == RequestState.DECODE:
            return 1 + self._decode_clock - req._clock0
        return req.num_output

    def output_token_ids(self, start: int, end: int) -> list[int]:
        """Generated token ids ``start..end`` of any request (they cycle the pattern)."""
        pat = self.output_tokens
        n = len(pat)
        if n == 1:
            return pat * (end - start)
        return [pat[i % n] for i in range(start, end)]

    def lookup(self, tokens: Sequence[int] | bytes, lora: str | None = None) -> int:
        """Prompt tokens a request with ``tokens`` would find cached now (no side effect)."""
        data = pack_tokens(tokens)
        n = len(data) // TOKEN_BYTES
        if self.bigram:
            data = bigram_atoms(data)
        return self.cache.match(data, self._max_match(n), lora).blocks * self.block_size

    # -- internals -------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _max_match(self, prompt_len: int) -> int:
        """Blocks a prompt may reuse: at least its last token is computed (bigram keys: its
        first ``prompt_len - 1`` tokens are matched as ``prompt_len - 2`` bigrams)."""
        return max(0, prompt_len - 1 - self._unkeyed) // self.block_size

    def _full_blocks(self, kv_tokens: int) -> int:
        """Full blocks of cache keys over ``kv_tokens`` tokens with KV (bigrams: one fewer)."""
        return max(0, kv_tokens - self._unkeyed) // self.block_size

    def _key(self, req: SimRequest) -> bytes:
        """What the cache is keyed by for ``req``'s prompt: its tokens, or their bigrams."""
        if not self.bigram:
            return req.tokens
        if req._key is None:
            req._key = bigram_atoms(req.tokens)
        return req._key

    def _continue_prefills(self, budget: int) -> list[tuple[SimRequest, int]]:
        chunks: list[tuple[SimRequest, int]] = []
        for req in self._prefilling:
            if budget <= 0:
                break
            c = min(req.prompt_len - req.computed_tokens, budget)
            chunks.append((req, c))
            budget -= c
        return chunks

    def _admit_waiting(
        self,
        now: float,
        budget: int,
        chunks: list[tuple[SimRequest, int]],
        scheduled: list[SimRequest],
        n_dec: int,
    ) -> None:
        waiting = self._waiting
        skipped: list[SimRequest] = []  # vLLM: adapter waits, kept in order at the head
        while (
            waiting
            and not self._blocked
            and budget > 0
            and self.num_running < self.sched.max_num_seqs
        ):
            req = waiting[0]
            if req.lora is not None and not self.loras.can_acquire(req.lora):
                if not self.skip_lora_waits:
                    break  # SGLang: the batch stops at the first request it cannot add
                skipped.append(waiting.popleft())
                continue
            rest = req.prompt_len - self._cached_hint(req)
            if not self.sched.chunked_prefill and rest > budget and (chunks or n_dec):
                break  # a whole prompt must fit; it gets a batch of its own later
            if not self._admit(req, now):
                break
            waiting.popleft()
            self._waiting_tokens -= req.prompt_len
            self._prefilling.append(req)
            scheduled.append(req)
            rest = req.prompt_len - req.computed_tokens
            c = rest if not self.sched.chunked_prefill else min(rest, budget)
            chunks.append((req, c))
            budget -= c
            if self.commit_on_schedule:  # before the next waiting request is matched
                self._commit(req, c, now)
        waiting.extendleft(reversed(skipped))

    def _cached_hint(self, req: SimRequest) -> int:
        """Cached prompt tokens of a waiting request (only needed without chunking)."""
        if self.sched.chunked_prefill:
            return 0
        m = self.cache.match(self._key(req), self._max_match(req.prompt_len), req.lora)
        return m.blocks * self.block_size

    def _admit(self, req: SimRequest, now: float) -> bool:
        """Match, pin and reserve blocks for ``req``; False if the pool cannot hold it yet."""
        bs = self.block_size
        m = self.cache.match(self._key(req), self._max_match(req.prompt_len), req.lora)
        need = self._blocks_for(req.prompt_len + req.max_tokens - 1) - m.blocks
        free = self.allocator.num_free
        if need > free and need > free + self.cache.evictable_blocks - m.unpinned:
            self._blocked = True
            return False
        if req.lora is not None:
            load = self.loras.acquire(req.lora)
            if load:
                self._load_s += load
                self.stats.lora_loads += 1
        req._node = self.cache.acquire(m, now)
        if need > self.allocator.num_free:
            self.cache.evict(need - self.allocator.num_free)
        req._blocks = self.allocator.allocate(need)
        self._private_blocks += need
        req.cached_tokens = req.computed_tokens = m.blocks * bs
        if req.remote:
            req.computed_tokens = max(req.computed_tokens, req.prompt_len - 1)
        req.state = RequestState.PREFILL
        req.scheduled_time = now
        st = self.stats
        st.prompt_tokens += req.prompt_len
        st.cache_queries += req.prompt_len
        st.cache_hits += req.cached_tokens
        return True

    def _commit(self, req: SimRequest, chunk: int, now: float) -> None:
        """A step scheduled ``chunk`` more prompt tokens of ``req``: its full blocks up to
        there enter the cache now (vLLM), not when the prefill completes."""
        if req.remote:  # its KV arrives from the prefill engine: cached once it has
            return
        # in the cache already: the matched blocks and those of the chunks scheduled before
        # (``computed_tokens`` starts at the match and counts them)
        done = req.computed_tokens // self.block_size
        upto = min(req.computed_tokens + chunk, req.prompt_len) // self.block_size
        if upto > done:
            self._cache_blocks(req, self._key(req), done, upto, now)

    def _prefill_done(self, req: SimRequest, end: float, res: StepResult) -> None:
        self._prefilling.remove(req)
        n_full = self._full_blocks(req.prompt_len)
        committed = req.cached_tokens // self.block_size
        if self.commit_on_schedule and not req.remote:
            committed = n_full  # every full block went in as its chunk was scheduled
        self._cache_blocks(req, self._key(req), committed, n_full, end)
        req.first_token_time = end
        req.num_output = 1
        res.first_token.append(req)
        if req.max_tokens == 1:
            self._finish(req, end)
            res.finished.append(req)
            return
        req.state = RequestState.DECODE
        req._clock0 = self._decode_clock
        self._num_decoding += 1
        heapq.heappush(self._finish_heap, (req._clock0 + req.max_tokens - 1, req.rid, req))

    def _decode(self, k: int, end: float, finished: list[SimRequest]) -> None:
        self._decode_clock += k
        heap = self._finish_heap
        while heap and heap[0][0] <= self._decode_clock:
            req = heapq.heappop(heap)[2]
            if req.state != RequestState.DECODE:
                continue  # aborted
            self._num_decoding -= 1
            self._finish(req, end)
            finished.append(req)

    def _steps_to_next_finish(self) -> int:
        heap = self._finish_heap
        while heap and heap[0][2].state != RequestState.DECODE:
            heapq.heappop(heap)
        return heap[0][0] - self._decode_clock if heap else 1

    def _finish(self, req: SimRequest, end: float) -> None:
        if self.cache_outputs and req.max_tokens > 1:
            bs = self.block_size
            kv_tokens = req.prompt_len + req.max_tokens - 1  # the last token has no KV yet
            first, last = self._full_blocks(req.prompt_len), self._full_blocks(kv_tokens)
            if last > first:
                if self.bigram:  # bigrams over the tokens up to one past the last block
                    n_out = last * bs + 1 - req.prompt_len
                    full = bigram_atoms(req.tokens + self._generated(req, n_out))
                    self._cache_blocks(req, full, first, last, end)
                else:  # only blocks ``first..`` are read: the tokens from there, not a copy
                    # of the whole prompt (``insert`` reads ``tokens`` from ``start_block`` on)
                    start = first * bs
                    tail = req.tokens[start * TOKEN_BYTES :]
                    tail += self._generated(req, last * bs - req.prompt_len)
                    self._cache_blocks(req, tail, 0, last - first, end)
        self._release(req, end)
        req.state = RequestState.FINISHED
        req.finish_time = end
        req.num_output = req.max_tokens
        self.stats.finished += 1
        self.stats.generation_tokens += req.max_tokens

    def _cache_blocks(
        self, req: SimRequest, tokens: bytes, first: int, last: int, now: float
    ) -> None:
        """Move ``req``'s reserved blocks for blocks ``first..last`` of ``tokens`` into the cache."""
        k = last - first
        if k <= 0:
            return
        blocks = req._blocks[:k]
        del req._blocks[:k]
        self._private_blocks -= k
        req._node = self.cache.insert(req._node, tokens, first, blocks, now)

    def _release(self, req: SimRequest, now: float) -> None:
        self._blocked = False
        if req.lora is not None:
            self.loras.release(req.lora)
        self.cache.release(req._node, now)
        self.allocator.free(req._blocks)
        self._private_blocks -= len(req._blocks)
        req._blocks = []
        req._node = None
        req._key = None

    def _generated(self, req: SimRequest, n: int) -> bytes:
        """The first ``n`` tokens ``req`` generated: its own, then the engine's pattern."""
        own = req.output
        if own is None:
            return self._output_bytes(n)
        size = n * TOKEN_BYTES
        if len(own) >= size:
            return own[:size]
        return own + self._output_bytes(n - len(own) // TOKEN_BYTES)

    def _output_bytes(self, n: int) -> bytes:
        pat = self._pattern
        per = len(pat) // TOKEN_BYTES
        return (pat * (n // per + 1))[: n * TOKEN_BYTES]
