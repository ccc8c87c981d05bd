"""Baseline: sticky sessions by consistent (rendezvous) hashing of a session key.

Each (key, worker) pair gets a hash and the highest wins, so adding or removing a worker
moves only the sessions that belonged to it. Requests without a session key hash their first
four block keys instead (a prefix hash, like SGLang's ``prefix_hash``): same system prompt,
same worker.
"""

from __future__ import annotations

import hashlib

from gateway.routing.policy import (
    Decision,
    Policy,
    PolicyContext,
    PoolView,
    RouteRequest,
    register,
    simple_decision,
)


class Session(Policy):
    name = "session"
    uses_index = False
    REASONS = ("session", "prefix_hash")

    def __init__(self, prefix_blocks: int = 4) -> None:
        self.prefix_blocks = prefix_blocks

    def choose(
        self, request: RouteRequest, pool: PoolView, ctx: PolicyContext, explain: bool = False
    ) -> Decision:
        if request.session_key is not None:
            key, reason = request.session_key.encode(), "session"
        else:
            head = request.keys[: self.prefix_blocks]
            key, reason = b",".join(str(k).encode() for k in head), "prefix_hash"
        worker = max(pool.workers, key=lambda w: _weight(key, w))
        return simple_decision(self, request, worker, pool, reason, explain)


def _weight(key: bytes, worker: str) -> bytes:
    return hashlib.blake2b(key + b"\0" + worker.encode(), digest_size=8).digest()


register(Session)
