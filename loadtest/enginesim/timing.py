"""How long one engine step takes: a calibrated model of prefill and batched decode.

A step runs one forward pass over a batch that mixes prefill chunks (``prefill_tokens`` new
tokens in total) and decoding sequences (one token each). Its duration is

    step_ms = prefill_ms(prefill_tokens) [if any]  +  decode_ms(kv_usage) [if any decode]
    prefill_ms(T) = a·T² + b·T + c            (superlinear: attention grows with length)
    decode_ms(p)  = max(floor, d2·p² + d1·p + d0)   (p = fraction of the KV pool in use)

all divided by ``speedup``. ``attention`` says what the quadratic term is paid on:

* ``batch`` (the default; every figure on record): the step's prefill tokens taken together,
  ``a·T²``, as if every token of the batch attended to every other.
* ``sequence``: each sequence's chunk attends to its own context only, as attention kernels
  over a batch of variable-length sequences compute it: ``a·Σ c·(c + 2·ctx)`` for a chunk of
  ``c`` tokens after ``ctx`` tokens of its prompt already in the cache (matched or prefilled
  before). One prompt prefilled alone pays ``a·T²`` either way (its chunks tile the
  triangle); a step carrying four 2,048-token prompts pays a quarter of ``batch``'s
  quadratic term, and a 200-token turn after 6,000 cached tokens pays for attending to them.

Presets:

* ``mocker`` (default) — the published Dynamo mocker fit: prefill 4.21e-7·T² + 1.518e-2·T
  + 16.5 ms, decode max(1, −25.74p² + 54.01p + 5.74) ms.
* ``seed-70b`` — the seed design's Llama-3-70B FP8 on 8×H100: a 6,144-token cold prefill
  takes 1,240 ms (40 + 0.1172·T + 1.2716e-5·T²: about 60% linear, 40% quadratic at 6k), a
  hit that recomputes one 16-token block 42 ms, decode 22 ms per token rising to 32 ms
  with a full pool.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["ATTENTION", "PRESETS", "Attention", "TimingModel", "timing_model"]

#: what a step's quadratic prefill term is paid on (see the module docstring)
Attention = Literal["batch", "sequence"]
ATTENTION: tuple[str, ...] = get_args(Attention)


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Step-time model; coefficients in milliseconds (see the module docstring)."""

    name: str
    prefill_a: float  # ms per token²
    prefill_b: float  # ms per token
    prefill_c: float  # ms per prefill step
    decode_d2: float
    decode_d1: float
    decode_d0: float
    decode_floor: float = 1.0
    speedup: float = 1.0
    #: what the quadratic prefill term is paid on: "batch" or "sequence" (module docstring)
    attention: Attention = "batch"

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        if self.attention not in ATTENTION:
            raise ValueError(
                f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}"
            )

    def prefill_ms(self, tokens: int) -> float:
        return (self.prefill_a * tokens + self.prefill_b) * tokens + self.prefill_c

    def decode_ms(self, usage: float) -> float:
        return max(
            self.decode_floor, (self.decode_d2 * usage + self.decode_d1) * usage + self.decode_d0
        )

    def step_seconds(
        self, prefill_tokens: int, decode_seqs: int, usage: float, attended: float | None = None
    ) -> float:
        """Wall time of one step, speed-up applied. ``attended``: the step's quadratic
        units, ``Σ c·(c + 2·ctx)`` over its chunks (``attention`` "sequence"); None:
        ``prefill_tokens²`` ("batch", or a step whose chunks are not known)."""
        ms = 0.0
        if prefill_tokens > 0:
            if attended is None:
                ms += self.prefill_ms(prefill_tokens)
            else:
                ms += self.prefill_a * attended + self.prefill_b * prefill_tokens
                ms += self.prefill_c
        if decode_seqs > 0:
            ms += self.decode_ms(usage)
        return ms / (1000.0 * self.speedup)

    def cold_prefill_seconds(self, tokens: int, chunk: int) -> float:
        """One prompt of ``tokens`` prefilled alone on an idle engine, ``chunk`` tokens per
        step."""
        if tokens <= 0:
            return 0.0
        full, rest = divmod(tokens, chunk)
        if self.attention == "batch":
            s = full * self.step_seconds(chunk, 0, 0.0)
            return s + (self.step_seconds(rest, 0, 0.0) if rest else 0.0)
        steps = full + (1 if rest else 0)
        return self.step_seconds(tokens, 0, 0.0, float(tokens) * tokens) + (steps - 1) * (
            self.prefill_c / (1000.0 * self.speedup)
        )

    def scaled(self, speedup: float) -> TimingModel:
        """The same model at another speed-up (a slow-down fault divides it)."""
        return dataclasses.replace(self, speedup=speedup)


PRESETS: dict[str, TimingModel] = {
    "mocker": TimingModel("mocker", 4.21e-7, 1.518e-2, 16.5, -25.74, 54.01, 5.74),
    "seed-70b": TimingModel("seed-70b", 1.2716e-5, 0.1172, 40.0, 0.0, 10.0, 22.0),
}


def timing_model(
    preset: str = "mocker", speedup: float = 1.0, attention: Attention = "batch"
) -> TimingModel:
    try:
        base = PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown timing preset {preset!r}; known: {', '.join(PRESETS)}") from None
    return dataclasses.replace(base, speedup=speedup, attention=attention)
