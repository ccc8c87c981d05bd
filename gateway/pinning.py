"""Pinning a request to the data-parallel rank the router chose, each engine's own way.

An engine with several data-parallel ranks holds one prefix cache per rank, and its own
balancer would send an unpinned request to whichever rank is least loaded, not to the one
whose cache holds the prefix. vLLM takes the rank from the ``X-data-parallel-rank`` header
(``_get_data_parallel_rank`` in its OpenAI server); SGLang from the request field
``routed_dp_rank`` (``data_parallel_rank`` in releases before the rename; both are set, so
either reads it). The client's own steering fields are replaced: the gateway's choice wins.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["SGLANG_RANK_FIELDS", "VLLM_RANK_HEADER", "pin_rank"]

VLLM_RANK_HEADER = "X-data-parallel-rank"
SGLANG_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")


def pin_rank(
    engine: str,
    rank: int | None,
    body: bytes,
    parsed: dict[str, Any],
    headers: dict[str, str],
) -> tuple[bytes, dict[str, str]]:
    """``(body, headers)`` that pin the request to ``rank`` (unchanged when ``rank`` is None).

    ``parsed`` is the client's decoded body; when it carries no steering field, the SGLang
    field is spliced in after the opening brace instead of re-encoding a large body.
    """
    if rank is None:
        return body, headers
    if engine != "sglang":
        return body, {**headers, VLLM_RANK_HEADER: str(rank)}
    if any(name in parsed for name in SGLANG_RANK_FIELDS):
        obj = json.loads(body)
        for name in SGLANG_RANK_FIELDS:
            obj[name] = rank
        return json.dumps(obj, separators=(",", ":")).encode(), headers
    brace = body.index(b"{")
    fields = ",".join(f'"{name}":{rank}' for name in SGLANG_RANK_FIELDS)
    return body[: brace + 1] + fields.encode() + b"," + body[brace + 1 :], headers
