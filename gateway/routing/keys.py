"""Canonical block keys: the one function the gateway and the worker agent share.

A key names a token prefix at block granularity: ``key_i = H(key_{i-1}, tokens of block i)``
over full blocks of ``block_size`` tokens (the partial tail block is never keyed). Keys are
64-bit unsigned integers.

Construction (see docs/protocol.md, "Canonical block keys"). Per modulus ``p`` of two primes
just under 2**32, with secrets derived from the deployment seed:

* block hash ``h = sum(t_k * r_k) mod p`` — a multilinear hash with secret ``r_k``;
* chain ``K_i = K_{i-1} * B + h_i mod p`` with secret base ``B`` and a secret non-zero start
  state ``K_{-1} = S``;
* ``key_i = K_i(p1) << 32 | K_i(p2)``.

The chain is a polynomial in the secret ``B`` whose coefficients are secret-keyed block
hashes, so two different prefixes of ``n`` blocks collide with probability about
``(n / 2**27)**2`` for an attacker who does not know the seed — good enough for routing,
where a collision can only mis-route, never corrupt output. Because the state *is* the key,
a chain continues from any parent key, which is what the agent needs (engine events carry
the parent block) and what makes follow-up turns cheap (hash only the new blocks).

Two implementations compute exactly the same keys. The compiled one
(``gateway.routing._ckeys``, gateway/routing/_keys.c, built by ``pip install``) reads each id
once, straight from the list or integer buffer, hashing as it reads: no copy into an array
and no fixed cost beyond a C call. The fallback, used when the module did not build (or with
``BlockKeyer(..., native=False)``), evaluates the recurrence in closed form with numpy
(prefix sums of ``h_j * B**-j``): block hashes are one integer matrix product, the chain is
one multiply, one prefix sum and one multiply per prime, in place; a chain of a few blocks
is keyed in plain Python (numpy's fixed cost is larger). ``kvroute bench index --keys``
compares them, and the keys' cost against reading the ids into an array
(``keys_vs_ids_to_array``).
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from operator import mul
from types import NotImplementedType
from typing import overload

import numpy as np

#: the compiled key function: (tokens, parent, constants[, start, stop]) -> keys, or
#: NotImplemented for a buffer it does not read (see gateway/routing/_keys.c)
_native_keys: Callable[..., list[int] | NotImplementedType] | None
try:
    from gateway.routing._ckeys import keys as _native_keys
except ImportError:  # not built (no C compiler): the numpy path
    _native_keys = None

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MAX_TOKEN_ID",
    "BlockKeyer",
    "InvalidTokens",
    "LazyKeys",
    "PrefixKeys",
    "native_available",
]

DEFAULT_BLOCK_SIZE = 16
#: Token ids must be in ``[0, MAX_TOKEN_ID)``: engines use int32 ids.
MAX_TOKEN_ID = 2**31
_PRIMES = (4294967291, 4294967279)  # the two largest primes below 2**32
_R_BOUND = 2**27  # t_k * r_k < 2**58, so a 64-token block sums below 2**64
_U32 = np.uint64(32)
_M64 = 2**64 - 1
#: chains of at most this many blocks are keyed in plain Python (faster than numpy's fixed cost)
_SMALL_BLOCKS = 3
_MAX = 2**62  # "to the end" for the compiled function's stop
#: adapter start states remembered per keyer (a deployment serves a few dozen adapters)
_MAX_ADAPTER_ROOTS = 4096


#: Token ids: a sequence of ints, or a numpy integer array.
Tokens = Sequence[int] | np.ndarray


class InvalidTokens(ValueError):
    """Token ids outside ``[0, 2**31)`` or not integers."""


def native_available() -> bool:
    """Whether the compiled key function (``gateway.routing._ckeys``) was built."""
    return _native_keys is not None


class BlockKeyer:
    """Computes canonical block keys for one (deployment seed, block size) pair.

    Instances are cheap to share within one thread and deterministic across processes and
    hosts. ``native``: use the compiled key function (None: if it was built; True: it must
    have been, else ImportError; False: the numpy path, which tests compare it against).
    The numpy path's power tables grow on demand.
    """

    def __init__(
        self, seed: bytes | str, block_size: int = DEFAULT_BLOCK_SIZE, native: bool | None = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if native and _native_keys is None:
            raise ImportError(
                "gateway.routing._ckeys was not built (pip install needs a C compiler)"
            )
        if isinstance(seed, str):
            seed = seed.encode("utf-8")
        self.block_size = block_size
        self._seed = seed
        self._adapter_roots: dict[str, int] = {}
        stream = _secret_stream(seed, block_size, 8 * (2 * block_size + 4))
        words = np.frombuffer(stream, dtype="<u8")
        # r_k < 2**27 and tokens < 2**31 give products < 2**58; a block of up to 64 tokens sums
        # below 2**64. Larger blocks are summed in slices of 32 (see _block_hashes).
        r = (words[: 2 * block_size] % np.uint64(_R_BOUND - 1)) + np.uint64(1)
        self._r = r.reshape(block_size, 2)
        p = np.array(_PRIMES, dtype=np.uint64)
        self._p = p.reshape(2, 1)
        self._base = [int(words[2 * block_size + m]) % (_PRIMES[m] - 2) + 2 for m in range(2)]
        self._start = [int(words[2 * block_size + 2 + m]) % (_PRIMES[m] - 1) + 1 for m in range(2)]
        self._rt = np.ascontiguousarray(self._r.T)  # (2, block_size)
        self._base_col = np.array(self._base, dtype=np.uint64).reshape(2, 1)
        self._start_col = np.array(self._start, dtype=np.uint64).reshape(2, 1)
        self._root_term = self._start_col * self._base_col % self._p  # S * B, a root's start
        #: r_k of both primes in one int for the few-block path (exact up to 64 tokens)
        self._packed_r: list[int] | None = (
            [a << 64 | b for a, b in self._r.tolist()] if block_size <= 64 else None
        )
        self._pow = np.ones((2, 1), dtype=np.uint64)
        self._inv = np.ones((2, 1), dtype=np.uint64)
        self._grow(1024)
        #: the compiled function's constants (r interleaved per token: r[k][0], r[k][1])
        self._native = _native_keys if native is not False else None
        self._native_consts: tuple[object, ...] = ()
        if self._native is not None:
            self._native_consts = (
                self._r.astype(np.uint64).tobytes(),
                block_size,
                *self._base,
                *self._start,
                InvalidTokens,
            )

    @property
    def native(self) -> bool:
        """Whether keys are computed by the compiled function."""
        return self._native is not None

    # -- public API -------------------------------------------------------------------------

    def keys(
        self, tokens: Tokens, parent: int | None = None, start: int = 0, stop: int | None = None
    ) -> list[int]:
        """Keys of every full block of ``tokens[start:stop]`` (``0 <= start <= stop``),
        chained from ``parent`` (None: a root). The compiled function reads the range in
        place: no copy of the slice."""
        if self._native is not None:
            keys = (
                self._native(tokens, parent, self._native_consts)
                if start == 0 and stop is None
                else self._native(
                    tokens, parent, self._native_consts, start, _MAX if stop is None else stop
                )
            )
            if keys is not NotImplemented:  # else a buffer of non-integers: numpy's path
                return keys
        if start or stop is not None:
            if start < 0 or (stop is not None and stop < start):
                raise ValueError("need 0 <= start <= stop")
            tokens = tokens[start:stop]
        n = len(tokens) // self.block_size
        if n == 0:
            return []
        if n <= _SMALL_BLOCKS and self._packed_r is not None:
            return self._keys_small(tokens, n, parent)
        blocks = self._as_blocks(tokens, n)
        return self._chain(self._block_hashes(blocks), parent).tolist()

    def keys_many(self, chains: Sequence[tuple[Sequence[int], int | None]]) -> list[list[int]]:
        """``[self.keys(tokens, parent) for tokens, parent in chains]``, on the numpy path
        in one numpy pass.

        An engine event batch holds many short chains (one store per request per step) and
        each ``keys`` call pays ~20 µs of numpy overhead whatever its length. With global
        block index ``g``, a chain starting at ``g0`` from state ``S`` and ``C`` the running
        sum of ``h_G * B**-G``: ``K_g = S * B**(g - g0 + 1) + B**g * (C_g - C_{g0-1})``
        (mod p), which is ``_chain`` with the prefix sums shared across chains.
        """
        if len(chains) == 1 or self._native is not None:  # no fixed cost to share
            return [self.keys(tokens, parent) for tokens, parent in chains]
        bs = self.block_size
        counts = [len(t) // bs for t, _ in chains]
        total = sum(counts)
        if total == 0:
            return [[] for _ in chains]
        flat: list[int] = []
        for (tokens, _), n in zip(chains, counts, strict=True):
            flat.extend(tokens[: n * bs])
        h = self._block_hashes(self._as_blocks(flat, total))  # (2, total)
        if total + 1 > self._pow.shape[1]:
            self._grow(max(2 * self._pow.shape[1], total + 1))
        p, pw = self._p, self._pow
        c = np.cumsum((h * self._inv[:, :total]) % p, axis=1) % p  # C_g
        # per block: its chain's start index g0, start state S, and C_{g0-1}
        starts = np.repeat(np.cumsum([0, *counts[:-1]]), counts).astype(np.int64)
        rel = np.arange(total, dtype=np.int64) - starts  # g - g0
        s0 = np.empty((2, len(chains)), dtype=np.uint64)
        for i, (_, parent) in enumerate(chains):
            if parent is None:
                s0[0, i], s0[1, i] = self._start
            else:
                if not 0 <= parent < 2**64:
                    raise ValueError("parent key must be a 64-bit unsigned integer")
                s0[0, i], s0[1, i] = parent >> 32, parent & 0xFFFFFFFF
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

    def extend(
        self, prev_keys: Sequence[int], tokens: Sequence[int], root: int | None = None
    ) -> list[int]:
        """Keys of ``tokens`` given ``prev_keys`` = keys of a prefix of ``tokens`` (a chain
        from ``root``: None, or an ``adapter_root``).

        Only blocks past ``len(prev_keys)`` are hashed: this is how a follow-up turn pays for
        its new tokens only. Returns the full key list (``prev_keys`` + new keys).
        """
        done = len(prev_keys)
        start = done * self.block_size
        if start > len(tokens):
            raise ValueError("prev_keys cover more blocks than tokens has")
        parent = prev_keys[-1] if done else root
        tail = self.keys(tokens, parent, start)
        return [*prev_keys, *tail] if tail else list(prev_keys)

    def root_state(self) -> int:
        """The implicit parent of a first block (for protocol documentation and tests)."""
        return (self._start[0] << 32) | self._start[1]

    def adapter_root(self, adapter: str | None) -> int | None:
        """The chain start of blocks computed with LoRA ``adapter`` (None: the base model).

        An adapter's KV differs from the base model's for the same tokens, so its blocks
        are keyed on a chain of their own: ``keys(tokens, parent=adapter_root(name))``. The
        start state is derived from (seed, block size, name) like the base one, so base keys
        are unchanged, and base, adapter and other adapters' chains are disjoint (up to a
        64-bit collision). Published chains still start with parent None.
        """
        if adapter is None:
            return None
        root = self._adapter_roots.get(adapter)
        if root is None:
            words = np.frombuffer(
                _secret_stream(self._seed, self.block_size, 16, b"lora\0" + adapter.encode()),
                dtype="<u8",
            )
            k = [int(words[m]) % (_PRIMES[m] - 1) + 1 for m in range(2)]
            root = k[0] << 32 | k[1]
            if len(self._adapter_roots) < _MAX_ADAPTER_ROOTS:
                self._adapter_roots[adapter] = root
        return root

    # -- internals --------------------------------------------------------------------------

    def _keys_small(self, tokens: Tokens, n: int, parent: int | None) -> list[int]:
        """``keys`` for a few blocks (an engine event storing a block or two) in plain
        Python: below ~4 blocks the numpy path's fixed cost (~20 µs) is more than a Python
        loop's ~5 µs per block. Both primes in one product: ``R_k = r_k[0] << 64 | r_k[1]``,
        so ``sum(t_k * R_k) = h[0] << 64 | h[1]`` (each ``h`` < 2**64 up to 64 tokens)."""
        bs = self.block_size
        m = n * bs
        ids = self._ids(tokens, m)
        if max(ids[:m]) >= MAX_TOKEN_ID:
            raise InvalidTokens("token ids must be in [0, 2**31)")
        p0, p1 = _PRIMES
        b0, b1 = self._base
        if parent is None:
            k0, k1 = self._start
        else:
            if not 0 <= parent < 2**64:
                raise ValueError("parent key must be a 64-bit unsigned integer")
            k0, k1 = parent >> 32, parent & 0xFFFFFFFF
        packed = self._packed_r
        out = []
        for i in range(0, m, bs):
            h = sum(map(mul, ids[i : i + bs], packed))  # type: ignore[arg-type]
            k0 = (k0 * b0 + (h >> 64)) % p0
            k1 = (k1 * b1 + (h & _M64)) % p1
            out.append(k0 << 32 | k1)
        return out

    def _ids(self, tokens: Tokens, m: int) -> array.array[int]:
        """At least the first ``m`` token ids as machine ints (not range-checked).

        A Python list is converted with ``array('Q').fromlist``, the fastest list -> machine
        int conversion CPython offers (~4 ns per token here, about half the cost of an
        8,192-token prompt's keys); it rejects negatives and non-integers for us. The whole
        list is converted (slicing off the partial tail block first would copy it); if that
        fails, the keyed part alone decides, so tokens past the last full block never matter.
        """
        buf = array.array("Q")
        try:
            if type(tokens) is list:
                try:
                    buf.fromlist(tokens)
                except (OverflowError, TypeError):
                    buf = array.array("Q")
                    buf.fromlist(tokens[:m])
            elif isinstance(tokens, np.ndarray):
                arr = tokens[:m]
                if arr.size and arr.min() < 0:
                    raise OverflowError("negative token id")
                buf.frombytes(arr.astype(np.uint64).tobytes())
            else:
                buf.extend(tokens[:m])
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidTokens(f"token ids must be integers in [0, 2**31): {exc}") from None
        return buf

    def _as_blocks(self, tokens: Tokens, n: int) -> np.ndarray:
        """The first ``n`` blocks of ``tokens`` as an (n, block_size) uint64 array."""
        bs = self.block_size
        m = n * bs
        if isinstance(tokens, np.ndarray):
            arr = tokens[:m]
            if arr.size and (arr.min() < 0 or arr.max() >= MAX_TOKEN_ID):
                raise InvalidTokens("token ids must be in [0, 2**31)")
            arr = arr.astype(np.uint64, copy=False)
        else:
            arr = np.frombuffer(self._ids(tokens, m), dtype=np.uint64)[:m]
            if arr.max() >= MAX_TOKEN_ID:
                raise InvalidTokens("token ids must be in [0, 2**31)")
        return arr.reshape(n, bs)

    def _block_hashes(self, blocks: np.ndarray) -> np.ndarray:
        """(2, n) array of per-block multilinear hashes, reduced mod each prime (a new array
        the caller may modify)."""
        bs = self.block_size
        if bs <= 64:  # t_k * r_k < 2**58: up to 64 terms sum below 2**64
            h = self._rt @ blocks.T
        else:  # keep every partial sum below 2**64
            h = np.zeros((2, blocks.shape[0]), dtype=np.uint64)
            for s in range(0, bs, 32):
                h += (self._rt[:, s : s + 32] @ blocks[:, s : s + 32].T) % self._p
                h %= self._p
        h %= self._p
        return h

    def _state(self, parent: int | None) -> np.ndarray:
        """The chain state a first block continues from, as a (2, 1) column of residues."""
        if parent is None:
            return self._start_col
        if not 0 <= parent < 2**64:
            raise ValueError("parent key must be a 64-bit unsigned integer")
        return np.array([[parent >> 32], [parent & 0xFFFFFFFF]], dtype=np.uint64)

    def _chain(self, h: np.ndarray, parent: int | None) -> np.ndarray:
        """Keys (uint64) of the chain of block hashes ``h`` (2, n), continued from ``parent``.

        ``K_i = B**i * (S*B + sum_{j<=i} h_j * B**-j)  (mod p)``: one multiply, one prefix sum
        and one multiply per prime, every intermediate below 2**64, computed in place in ``h``
        (four reductions mod p: uint64 remainder is most of the arithmetic's cost).
        """
        n = h.shape[1]
        if n + 1 > self._pow.shape[1]:
            self._grow(max(2 * self._pow.shape[1], n + 1))
        p = self._p
        h *= self._inv[:, :n]
        h %= p
        h[:, :1] += self._root_term if parent is None else self._state(parent) * self._base_col % p
        np.cumsum(h, axis=1, out=h)
        h %= p
        h *= self._pow[:, :n]
        h %= p
        k = h[0] << _U32
        k |= h[1]
        return k

    def _grow(self, size: int) -> None:
        pw = np.empty((2, size), dtype=np.uint64)
        inv = np.empty((2, size), dtype=np.uint64)
        for m, prime in enumerate(_PRIMES):
            b = self._base[m]
            b_inv = pow(b, prime - 2, prime)
            x = y = 1
            for i in range(size):
                pw[m, i] = x
                inv[m, i] = y
                x = x * b % prime
                y = y * b_inv % prime
        self._pow, self._inv = pw, inv


def _secret_stream(seed: bytes, block_size: int, nbytes: int, label: bytes = b"") -> bytes:
    """Deterministic pseudo-random bytes from the deployment seed (blake2b in counter mode);
    ``label`` names a separate stream (an adapter's start state), empty for the base one."""
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        h = hashlib.blake2b(
            counter.to_bytes(8, "little") + block_size.to_bytes(8, "little") + label,
            key=hashlib.blake2b(seed, digest_size=32).digest(),
            person=b"kvroute-keys-v1",
            digest_size=64,
        )
        out += h.digest()
        counter += 1
    return bytes(out[:nbytes])


class LazyKeys(Sequence[int]):
    """The block keys of one prompt, computed only as far as they are read.

    A routing decision needs keys only as far as the index's match can reach: one key shows
    that a novel prompt matches nothing, a prompt under a cached system prompt needs the
    system prompt's keys and one more. Speculation and :class:`PrefixKeys` need them all, but
    after the decision. ``upto(k)`` extends the chain (``BlockKeyer.keys`` of the next range
    of ids, read in place, from the last computed key, so the keys are exactly the eager
    ones) to at least ``k`` keys and at least twice as many as before, so reading every key
    costs a few calls however it is read (one fixed cost each on the numpy path). ``len`` is the number of full blocks; indexing,
    slicing and iteration compute what they need. One thread only.
    """

    __slots__ = ("_keys", "_n", "keyer", "root", "tokens")

    def __init__(
        self,
        keyer: BlockKeyer,
        tokens: Tokens,
        root: int | None = None,
        known: Sequence[int] = (),
    ) -> None:
        """``known``: keys of a prefix of ``tokens`` already computed (a remembered turn)."""
        self.keyer = keyer
        self.tokens = tokens
        self.root = root  # the chain's start: None, or ``BlockKeyer.adapter_root``
        self._n = len(tokens) // keyer.block_size
        if len(known) > self._n:
            raise ValueError("known keys cover more blocks than tokens has")
        self._keys = list(known)
        if len(known) == self._n:
            self.tokens = ()

    def adopt(self, known: list[int]) -> None:
        """Take ``known`` (a new list of the keys of a prefix of the tokens, computed with no
        keys yet) as the computed keys: the constructor's ``known`` without its copy."""
        if self._keys or len(known) > self._n:
            raise ValueError("adopt: keys already computed, or more keys than blocks")
        self._keys = known
        if len(known) == self._n:
            self.tokens = ()

    def extend(self, tokens: Tokens) -> None:
        """The prompt turned out longer: ``tokens`` (which start with the ids these keys were
        made from) are its ids now. Keys computed so far stay; the rest are computed from
        ``tokens`` as read (the gateway routes on a prompt's known first ids while the rest
        is encoded)."""
        n = len(tokens) // self.keyer.block_size
        if n < self._n:
            raise ValueError("extend: fewer blocks than the keys already cover")
        self._n = n
        self.tokens = tokens if len(self._keys) < n else ()

    @property
    def computed(self) -> int:
        """Keys computed so far."""
        return len(self._keys)

    def upto(self, k: int) -> list[int]:
        """The computed keys, at least ``min(k, len(self))`` of them (the list grows in place:
        callers may keep it and call ``upto`` again)."""
        keys = self._keys
        done = len(keys)
        if k > done and done < self._n:
            end = min(self._n, max(k, 2 * done))
            bs = self.keyer.block_size
            parent = keys[-1] if done else self.root
            keys.extend(self.keyer.keys(self.tokens, parent, done * bs, end * bs))
            if end == self._n:  # complete: a remembered entry need not hold the ids too
                self.tokens = ()
        return keys

    def all(self) -> list[int]:
        """Every key (the list itself: do not modify it)."""
        return self.upto(self._n)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            stop = i.stop
            if i.step is None and stop is not None and stop >= 0 and (i.start or 0) >= 0:
                return self.upto(stop)[i]
            return self.all()[i]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("block key index out of range")
        return self.upto(i + 1)[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.all())


class PrefixKeys:
    """Block keys of remembered token prefixes, so a follow-up turn hashes only its new blocks.

    A chat's ids start with a prefix the tokenizer remembered from an earlier turn
    (:class:`gateway.tokenization.ChatIds`); that prefix is one tuple object for as long as it
    is remembered, so its keys are found by identity (no hashing of 8,000 ids) and the rest
    is chained on with :meth:`BlockKeyer.extend`. For an 8,000-token chat: ~15 µs instead of
    ~30-50 µs with the compiled keys (numpy: ~50 µs instead of ~150-200). Entries hold their prefix (so an identity is never reused while looked up) and
    are evicted least recently used beyond ``capacity_tokens`` prefix tokens. One event-loop
    thread only (no lock)."""

    def __init__(self, keyer: BlockKeyer, capacity_tokens: int) -> None:
        self.keyer = keyer
        self.capacity = max(0, capacity_tokens)
        # (id of the prefix, chain root) -> (prefix, keys of ids starting with it, its blocks);
        # an adapter's chain differs
        self._items: OrderedDict[tuple[int, int | None], tuple[tuple[int, ...], LazyKeys, int]] = (
            OrderedDict()
        )
        self.tokens = 0
        self.hits = self.misses = 0

    def keys(
        self,
        ids: Sequence[int],
        reused: tuple[int, ...] = (),
        remembered: tuple[int, ...] | None = None,
        root: int | None = None,
    ) -> list[int]:
        """Keys of ``ids``, which start with ``reused``; remember those of ``remembered`` (a
        prefix of ``ids``) for the requests that will start with it. ``root``: the chain's
        start (``BlockKeyer.adapter_root``; None: the base model's)."""
        return self.lazy(ids, reused, remembered, root).all()

    def lazy(
        self,
        ids: Sequence[int],
        reused: tuple[int, ...] = (),
        remembered: tuple[int, ...] | None = None,
        root: int | None = None,
        lead: tuple[int, ...] | None = None,
    ) -> LazyKeys:
        """``keys`` as :class:`LazyKeys`: the reused prefix's keys are known at once, the
        rest computed as read. ``remembered`` (and ``lead``, a shorter prefix remembered too:
        a chat's system prompt) is remembered with the lazy keys themselves, completed when
        a later turn reuses it (the gateway completes them after routing)."""
        slot = (id(reused), root)
        entry = self._items.get(slot) if reused else None
        if entry is not None and entry[0] is reused:
            self._items.move_to_end(slot)
            self.hits += 1
            prev, n = entry[1], entry[2]
            keys = LazyKeys(self.keyer, ids, root)
            keys.adopt(prev.upto(n)[:n])
        else:
            self.misses += 1
            keys = LazyKeys(self.keyer, ids, root)
        bs = self.keyer.block_size
        for prefix in (remembered, lead):
            if prefix is not None and len(prefix) >= bs:
                self._put(prefix, keys, len(prefix) // bs)
        return keys

    def _put(self, prefix: tuple[int, ...], keys: LazyKeys, n: int) -> None:
        slot = (id(prefix), keys.root)
        if len(prefix) > self.capacity or slot in self._items:
            return
        self._items[slot] = (prefix, keys, n)
        self.tokens += len(prefix)
        while self.tokens > self.capacity:
            _, (old, _, _) = self._items.popitem(last=False)
            self.tokens -= len(old)

    def __len__(self) -> int:
        return len(self._items)


def reference_keys(
    keyer: BlockKeyer, tokens: Sequence[int], parent: int | None = None
) -> list[int]:
    """Slow, loop-based evaluation of the recurrence, for tests and the protocol document."""
    bs = keyer.block_size
    r = keyer._r.tolist()
    state = list(keyer._start) if parent is None else [parent >> 32, parent & 0xFFFFFFFF]
    out = []
    for b in range(len(tokens) // bs):
        block = tokens[b * bs : (b + 1) * bs]
        for m, prime in enumerate(_PRIMES):
            h = sum(int(t) * r[k][m] for k, t in enumerate(block)) % prime
            state[m] = (state[m] * keyer._base[m] + h) % prime
        out.append((state[0] << 32) | state[1])
    return out
