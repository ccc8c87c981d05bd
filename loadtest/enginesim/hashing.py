"""Block hashes exactly as the engines compute them for their KV events.

* vLLM (``prefix_caching_hash_algo=sha256``, 0.33 defaults): ``sha256(pickle.dumps((parent
  or NONE_HASH, tuple(block_tokens), extra_keys), protocol=5))`` chained over full blocks,
  ``NONE_HASH = sha256(pickle.dumps("vllm-none-hash", protocol=5))``. Events carry the last
  8 bytes as an unsigned integer (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the raw
  32-byte digest.
* SGLang: per page ``sha256(previous 32-byte digest || page token ids as uint32 LE)``, the
  first page without a prefix; events carry the first 8 bytes as a signed int64. With bigram
  keys (EAGLE/MTP) a page is ``page_size`` pairs and each pair ``(t_j, t_j+1)`` is hashed as
  two uint32 LE words (``cpp_utils/hash_binding.cpp``, ``fill_bigram_page``): exactly the
  cache's 8-byte bigram atoms, so the same function hashes them with ``atom_bytes=8``.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

__all__ = [
    "VLLM_NONE_HASH",
    "sglang_event_hash",
    "sglang_page_hashes",
    "vllm_block_hashes",
    "vllm_event_hash",
]

VLLM_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
_MASK64 = (1 << 64) - 1


def vllm_block_hashes(
    parent: bytes | None, tokens: Sequence[int], block_size: int, extra_keys: Any = None
) -> list[bytes]:
    """Digests of every full block of ``tokens`` chained from ``parent`` (None: first block)."""
    out: list[bytes] = []
    prev = parent or VLLM_NONE_HASH
    sha, dumps = hashlib.sha256, pickle.dumps
    for i in range(0, len(tokens) - block_size + 1, block_size):
        prev = sha(
            dumps((prev, tuple(tokens[i : i + block_size]), extra_keys), protocol=5)
        ).digest()
        out.append(prev)
    return out


def vllm_event_hash(digest: bytes, as_bytes: bool = False) -> int | bytes:
    """What a vLLM event publishes for a block digest."""
    return digest if as_bytes else int.from_bytes(digest, "big") & _MASK64


def sglang_page_hashes(
    parent: bytes | None, tokens_le: bytes, page_size: int, atom_bytes: int = 4
) -> list[bytes]:
    """Digests of every full page of ``tokens_le`` chained from ``parent``.

    ``tokens_le`` holds ``atom_bytes``-wide atoms, ``page_size`` per page: uint32 LE tokens
    (4), or bigram pairs ``t_j || t_j+1`` of them (8).
    """
    out: list[bytes] = []
    step = atom_bytes * page_size
    prev = parent
    for i in range(0, len(tokens_le) - step + 1, step):
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(tokens_le[i : i + step])
        prev = h.digest()
        out.append(prev)
    return out


def sglang_event_hash(digest: bytes) -> int:
    """SGLang's ``hash_str_to_int64``: the first 8 bytes as a signed big-endian int64."""
    return int.from_bytes(digest[:8], "big", signed=True)
