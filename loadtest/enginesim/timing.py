"""How long one engine step takes: a calibrated model of prefill and batched decode.

A step runs one forward pass over a batch that mixes prefill chunks (``prefill_tokens`` new
tokens in total) and decoding sequences (one token each). Its duration is

    step_ms = prefill_ms(prefill_tokens) [if any]  +  decode_ms(kv_usage) [if any decode]
    prefill_ms(T) = a·T² + b·T + c            (superlinear: attention grows with length)
    decode_ms(p)  = max(floor, d2·p² + d1·p + d0)   (p = fraction of the KV pool in use)

all divided by ``speedup``. Presets:

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

__all__ = ["PRESETS", "TimingModel", "timing_model"]


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

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")

    def prefill_ms(self, tokens: int) -> float:
        return (self.prefill_a * tokens + self.prefill_b) * tokens + self.prefill_c

    def decode_ms(self, usage: float) -> float:
        return max(
            self.decode_floor, (self.decode_d2 * usage + self.decode_d1) * usage + self.decode_d0
        )

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, usage: float) -> float:
        """Wall time of one step, speed-up applied."""
        ms = 0.0
        if prefill_tokens > 0:
            ms += self.prefill_ms(prefill_tokens)
        if decode_seqs > 0:
            ms += self.decode_ms(usage)
        return ms / (1000.0 * self.speedup)

    def scaled(self, speedup: float) -> TimingModel:
        """The same model at another speed-up (a slow-down fault divides it)."""
        return dataclasses.replace(self, speedup=speedup)


PRESETS: dict[str, TimingModel] = {
    "mocker": TimingModel("mocker", 4.21e-7, 1.518e-2, 16.5, -25.74, 54.01, 5.74),
    "seed-70b": TimingModel("seed-70b", 1.2716e-5, 0.1172, 40.0, 0.0, 10.0, 22.0),
}


def timing_model(preset: str = "mocker", speedup: float = 1.0) -> TimingModel:
    try:
        base = PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown timing preset {preset!r}; known: {', '.join(PRESETS)}") from None
    return base.scaled(speedup)
