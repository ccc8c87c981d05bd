"""The seed fingerprint: lets a gateway check that an agent keys blocks with the same secret.

Gateways and agents must share the deployment's hash seed, or no block key an agent publishes
ever matches one the gateway computes: routing silently loses every cache hit. The agent puts
this fingerprint in its registration and the gateway refuses a worker whose fingerprint is not
its own. It is an HMAC keyed by the seed over a fixed label, so it reveals nothing about the
seed (nor lets anyone compute block keys); it only says whether two seeds are equal.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["seed_fingerprint"]

_LABEL = b"kvroute-seed-fingerprint-v1"


def seed_fingerprint(seed: str) -> str:
    """16 hex digits (64 bits) of HMAC-SHA256(seed, label)."""
    return hmac.new(seed.encode(), _LABEL, hashlib.sha256).hexdigest()[:16]
