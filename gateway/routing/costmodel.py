"""Predicted time to first token: a per-pool model of prefill and decode cost.

Defaults are the published mocker formulas (NVIDIA Dynamo's engine simulator, fitted on
H100s; see shared/reference/peers.md), which is also the engine simulator's default preset:

* prefill of a batch of ``T`` new tokens: ``a*T**2 + b*T + c`` ms
* one decode step with a fraction ``p`` of the KV cache in use:
  ``max(1, d2*p**2 + d1*p + d0)`` ms

An engine with chunked prefill works through queued prompt tokens ``max_batched_tokens`` per
step, and every step also carries the running sequences' decode, so a new request's first
token waits for the prefill queued ahead of it plus its own uncached tokens, both paid in
chunks, each chunk stretched by the decode work riding along.

``observe()`` calibrates online: the ratio of observed to predicted TTFT is tracked with an
exponentially weighted average and multiplies every prediction, so a model fitted on other
hardware still ranks workers correctly and its absolute numbers converge to the truth.

Every formula is pure given ``params`` and calibration only multiplies the result, so a
policy's per-decision terms are memoised unscaled: ``request_terms`` per number of new
tokens (a decision needs them once per distinct match length, and prompt lengths recur) and
``load_terms`` per worker load (a busy worker's queue costs the same for every request until
its load changes). The memos are bounded and forgotten when ``params`` is assigned; a
``CostParams`` is never mutated in place (assign a new one to change the model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CostModel", "CostParams", "LoadTerms", "RequestTerms"]

#: memoised entries per table before it is cleared (a few KB each; distinct prompt lengths
#: and loads seen in a short while are far fewer)
_MEMO_MAX = 8192


@dataclass
class CostParams:
    """Cost model coefficients (milliseconds); documented defaults = mocker formula."""

    prefill_a: float = 4.21e-7
    prefill_b: float = 1.518e-2
    prefill_c: float = 16.5
    decode_d2: float = -25.74
    decode_d1: float = 54.01
    decode_d0: float = 5.74
    max_batched_tokens: int = 8192
    #: how much of a decode step a running batch adds to a prefill step (0: none, 1: full)
    decode_overlap: float = 1.0
    #: loading a LoRA adapter onto a worker that does not have it (vLLM: from host memory
    #: or disk into one of its --max-loras GPU slots), paid before the prefill
    adapter_load_ms: float = 50.0
    #: bounds of the online calibration factor
    calibration_min: float = 0.25
    calibration_max: float = 4.0
    #: weight of a new observation in the calibration average
    calibration_alpha: float = 0.05


@dataclass(frozen=True, slots=True)
class RequestTerms:
    """The request's side of its predicted TTFT for ``new`` uncached tokens (unscaled ms)."""

    prefill: float  # ``prefill_ms(new)``: one batch, the compute the request costs the worker
    chunked: float  # ``chunked_prefill_ms(new)``: its own prefill, chunked
    own: tuple[float, int]  # ``own_prefill(new)``: (ms, steps), at least one token


@dataclass(frozen=True, slots=True)
class LoadTerms:
    """A worker's side of ``ttft_after`` for one load (unscaled): what a request waits for."""

    queued_ms: float  # chunked prefill of the queued tokens (0 when none)
    queued_steps: int  # engine steps the queue takes
    decode_ms: float  # one decode step at the worker's KV usage; 0 when nothing runs


class CostModel:
    """Pure arithmetic over ``CostParams`` plus one calibration factor."""

    def __init__(
        self, params: CostParams | None = None, scale: float = 1.0, observations: int = 0
    ) -> None:
        self._params = params if params is not None else CostParams()
        self.scale = scale
        self.observations = observations
        self._req_memo: dict[float, RequestTerms] = {}
        self._load_memo: dict[tuple[float, float, float], LoadTerms] = {}

    @property
    def params(self) -> CostParams:
        return self._params

    @params.setter
    def params(self, value: CostParams) -> None:
        """A new model: the memos are of the old one."""
        self._params = value
        self._req_memo.clear()
        self._load_memo.clear()

    def __repr__(self) -> str:
        return f"CostModel(params={self._params!r}, scale={self.scale!r})"

    def request_terms(self, new_tokens: float) -> RequestTerms:
        """``RequestTerms`` of ``new_tokens`` uncached tokens, memoised."""
        t = self._req_memo.get(new_tokens)
        if t is None:
            if len(self._req_memo) >= _MEMO_MAX:
                self._req_memo.clear()
            t = RequestTerms(
                self.prefill_ms(new_tokens),
                self.chunked_prefill_ms(new_tokens),
                self.own_prefill(new_tokens),
            )
            self._req_memo[new_tokens] = t
        return t

    def load_terms(self, queued_tokens: float, running: float, kv_usage: float) -> LoadTerms:
        """``LoadTerms`` of one worker load, memoised: ``ttft_after(own, q, r, kv)`` equals
        ``(own[0] + queued_ms + (queued_steps + own[1]) * decode_overlap * decode_ms if
        running else own[0] + queued_ms) * scale``, bit for bit."""
        key = (queued_tokens, running, kv_usage)
        t = self._load_memo.get(key)
        if t is None:
            if len(self._load_memo) >= _MEMO_MAX:
                self._load_memo.clear()
            p = self.params
            t = LoadTerms(
                self.chunked_prefill_ms(queued_tokens) if queued_tokens > 0 else 0.0,
                math.ceil(queued_tokens / p.max_batched_tokens) if running > 0 else 0,
                self.decode_step_ms(kv_usage) if running > 0 else 0.0,
            )
            self._load_memo[key] = t
        return t

    def prefill_ms(self, tokens: float) -> float:
        """Time to prefill ``tokens`` new tokens as one batch (no chunking)."""
        if tokens <= 0:
            return 0.0
        p = self.params
        return p.prefill_a * tokens * tokens + p.prefill_b * tokens + p.prefill_c

    def decode_step_ms(self, kv_usage: float) -> float:
        p = self.params
        u = min(max(kv_usage, 0.0), 1.0)
        return max(1.0, p.decode_d2 * u * u + p.decode_d1 * u + p.decode_d0)

    def max_decode_step_ms(self) -> float:
        """The longest decode step at any KV usage (the quadratic's maximum on [0, 1])."""
        p = self.params
        points = [0.0, 1.0]
        if p.decode_d2 < 0:
            points.append(min(max(-p.decode_d1 / (2 * p.decode_d2), 0.0), 1.0))
        return max(map(self.decode_step_ms, points))

    def chunked_prefill_ms(self, tokens: float) -> float:
        """Time to work through ``tokens`` prompt tokens in chunks of max_batched_tokens."""
        if tokens <= 0:
            return 0.0
        chunk = self.params.max_batched_tokens
        full, rest = divmod(tokens, chunk)
        return full * self.prefill_ms(chunk) + self.prefill_ms(rest)

    def ttft_ms(
        self, queued_tokens: float, new_tokens: float, running: float, kv_usage: float
    ) -> float:
        """Predicted TTFT of a request with ``new_tokens`` uncached prompt tokens.

        ``queued_tokens`` of prefill are ahead of it; ``running`` sequences decode alongside.
        The queue is paid first and ours in later steps: work already scheduled cannot absorb
        a newcomer (its step has started), so batching them together would underestimate the
        wait behind an in-flight prefill and draw requests onto it. Each prefill is chunked,
        so the quadratic term is paid per chunk.
        """
        return self.ttft_after(self.own_prefill(new_tokens), queued_tokens, running, kv_usage)

    def own_prefill(self, new_tokens: float) -> tuple[float, int]:
        """(ms, steps) of a request's own chunked prefill: ``ttft_ms`` split so a policy
        computes it once per request and match length, not once per worker."""
        new = max(new_tokens, 1.0)
        return self.chunked_prefill_ms(new), math.ceil(new / self.params.max_batched_tokens)

    def ttft_after(
        self, own: tuple[float, int], queued_tokens: float, running: float, kv_usage: float
    ) -> float:
        """``ttft_ms`` given the request's ``own_prefill`` and one worker's load."""
        ms = own[0] + (self.chunked_prefill_ms(queued_tokens) if queued_tokens > 0 else 0.0)
        if running > 0:
            steps = math.ceil(queued_tokens / self.params.max_batched_tokens) + own[1]
            ms += steps * self.params.decode_overlap * self.decode_step_ms(kv_usage)
        return ms * self.scale

    def queue_key(self, queued_tokens: float, running: float, kv_usage: float) -> float:
        """The part of a worker's TTFT lower bound that does not depend on the request.

        For any request with ``N`` uncached tokens,
        ``ttft_ms(q, N, r, kv) >= (chunked_prefill_ms(N) + queue_key(q, r, kv)) * scale``:
        queued tokens cost at least ``prefill_b`` each and a running batch adds at least one
        decode step. Ordering workers by this key lets a policy stop scanning early.
        """
        key = self.params.prefill_b * queued_tokens
        if running > 0:
            key += self.params.decode_overlap * self.decode_step_ms(kv_usage)
        return key

    def observe(self, predicted_ms: float, observed_ms: float) -> None:
        """Feed one observed TTFT for a prediction made by this model (online calibration)."""
        if predicted_ms <= 0 or observed_ms <= 0 or not math.isfinite(observed_ms):
            return
        p = self.params
        ratio = observed_ms / (predicted_ms / self.scale)
        target = min(max(ratio, p.calibration_min), p.calibration_max)
        alpha = max(p.calibration_alpha, 1.0 / (self.observations + 1))
        self.scale += alpha * (target - self.scale)
        self.observations += 1
