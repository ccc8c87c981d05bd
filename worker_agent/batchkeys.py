"""Canonical keys of many chains in one vectorised pass (the agent's hot path).

``BlockKeyer.keys`` costs ~50-80 µs of numpy call overhead per chain whatever its length,
and an engine batch holds many short chains (one BlockStored per request per step). This
evaluates the same recurrence for all of them at once: with global block index ``g``, a
chain starting at ``g0`` from state ``S``, and ``C`` the running sum of ``h_G * B**-G``,

    K_g = S * B**(g - g0 + 1) + B**g * (C_g - C_{g0-1})      (mod p, per prime)

which is ``BlockKeyer._chain`` with the prefix sums shared across chains. Every term stays
below 2**64 (operands are < 2**32). Tests check it against ``BlockKeyer.keys``.

It reads the keyer's tables (``_block_hashes``, ``_pow``, ``_inv``, ``_base``, ``_start``):
it belongs in ``gateway/keys.py`` as ``BlockKeyer.keys_many`` once that module's owner takes
it; until then the property test pins it to the reference.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

from gateway.keys import MAX_TOKEN_ID, BlockKeyer, InvalidTokens

__all__ = ["keys_many"]

_U32 = np.uint64(32)
_MASK = 0xFFFFFFFF


def keys_many(
    keyer: BlockKeyer, chains: Sequence[tuple[Sequence[int], int | None]]
) -> list[list[int]]:
    """``[keyer.keys(tokens, parent) for tokens, parent in chains]``, vectorised."""
    if len(chains) == 1:
        tokens, parent = chains[0]
        return [keyer.keys(tokens, parent)]
    bs = keyer.block_size
    counts = [len(t) // bs for t, _ in chains]
    total = sum(counts)
    if total == 0:
        return [[] for _ in chains]
    flat: list[int] = []
    for (tokens, _), n in zip(chains, counts, strict=True):
        flat.extend(tokens[: n * bs])
    blocks = _as_blocks(flat, total, bs)
    h = keyer._block_hashes(blocks)  # (2, total)
    if total + 1 > keyer._pow.shape[1]:
        keyer._grow(max(2 * keyer._pow.shape[1], total + 1))
    p = keyer._p
    pw, inv = keyer._pow, keyer._inv
    c = np.cumsum((h * inv[:, :total]) % p, axis=1) % p  # C_g
    # per block: its chain's start index g0, start state S, and C_{g0-1}
    starts = np.repeat(np.cumsum([0, *counts[:-1]]), counts).astype(np.int64)
    rel = np.arange(total, dtype=np.int64) - starts  # g - g0
    s0 = np.empty((2, len(chains)), dtype=np.uint64)
    for i, (_, parent) in enumerate(chains):
        if parent is None:
            s0[0, i], s0[1, i] = keyer._start
        else:
            if not 0 <= parent < 2**64:
                raise ValueError("parent key must be a 64-bit unsigned integer")
            s0[0, i], s0[1, i] = parent >> 32, parent & _MASK
    s = np.repeat(s0, counts, axis=1)
    c_prev = np.where(starts > 0, c[:, np.maximum(starts - 1, 0)], 0).astype(np.uint64)
    diff = (c + p - c_prev) % p
    k = (s * pw[:, rel + 1] % p + pw[:, :total] * diff % p) % p
    keys = ((k[0] << _U32) | k[1]).tolist()
    out: list[list[int]] = []
    pos = 0
    for n in counts:
        out.append(keys[pos : pos + n])
        pos += n
    return out


def _as_blocks(tokens: list[int], n: int, bs: int) -> np.ndarray:
    try:
        arr = np.frombuffer(array.array("q", tokens), dtype=np.int64)
    except (OverflowError, TypeError) as exc:
        raise InvalidTokens(f"token ids must be integers in [0, 2**31): {exc}") from None
    if arr.min() < 0 or arr.max() >= MAX_TOKEN_ID:
        raise InvalidTokens("token ids must be in [0, 2**31)")
    return arr.astype(np.uint64).reshape(n, bs)
