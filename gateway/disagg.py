"""Prefill/decode disaggregation: the request bodies of each engine's own protocol.

The gateway picks a prefill worker by cache (its prefix cache is what saves the prefill) and
a decode worker by load and the KV it already holds, then drives the pair the way the
engines expect (``gateway.proxy`` does the I/O; these functions only shape bodies):

* **vLLM** (KV connectors, e.g. NIXL; the protocol of vLLM's own disaggregation proxy): the
  prefill worker gets the request with ``max_tokens`` 1, no streaming, and
  ``kv_transfer_params: {"do_remote_decode": true, ...}``; it answers with the
  ``kv_transfer_params`` the decode worker needs to pull the KV, and the decode worker gets
  the original request plus those parameters; its answer (streamed or not) is the client's.
* **SGLang** (``--disaggregation-mode``): both workers get the same request at once with
  ``bootstrap_host``/``bootstrap_port`` of the prefill worker and a random
  ``bootstrap_room``; the decode worker's answer is the client's, the prefill worker's is
  read and dropped.
"""

from __future__ import annotations

import json
import random
from typing import Any

__all__ = [
    "FAKE_BOOTSTRAP_HOST",
    "VLLM_PREFILL_PARAMS",
    "new_room",
    "sglang_pair_body",
    "sglang_prefill_alone",
    "vllm_decode_body",
    "vllm_prefill_body",
]

#: what vLLM's disaggregation proxy sends the prefill worker
VLLM_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


#: SGLang's own placeholder decode address (``sglang.srt.disaggregation.utils``): a prefill
#: engine given it computes the prompt with a fake KV sender and transfers nothing. SGLang's
#: server warm-up uses it; kvroute's cache warm-ups too.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def vllm_prefill_body(body: bytes) -> bytes:
    """The prefill half: one output token, not streamed, asking for a remote decode."""
    obj = json.loads(body)
    obj["kv_transfer_params"] = dict(VLLM_PREFILL_PARAMS)
    obj["max_tokens"] = 1
    if "max_completion_tokens" in obj:
        obj["max_completion_tokens"] = 1
    obj["stream"] = False
    obj.pop("stream_options", None)
    return _encode(obj)


def vllm_decode_body(body: bytes, params: dict[str, Any]) -> bytes:
    """The decode half: the client's request plus the prefill worker's ``kv_transfer_params``."""
    obj = json.loads(body)
    obj["kv_transfer_params"] = params
    return _encode(obj)


def new_room(rng: random.Random | None = None) -> int:
    """A bootstrap room: SGLang pairs the two halves of a request by it (63-bit, as its own
    routers draw it)."""
    return (rng or random).getrandbits(63)


def sglang_pair_body(body: bytes, host: str, port: int, room: int) -> bytes:
    """The body both halves get: the client's request plus the prefill worker's bootstrap
    address and the room (a client's own bootstrap fields are replaced)."""
    obj = json.loads(body)
    obj["bootstrap_host"] = host
    obj["bootstrap_port"] = port
    obj["bootstrap_room"] = room
    return _encode(obj)


def sglang_prefill_alone(port: int | None, room: int) -> dict[str, Any]:
    """Fields for a request to an SGLang prefill engine with no decode half (a warm-up): a
    prefill engine refuses a request without a bootstrap room, and the fake host makes it
    compute and cache the prompt without waiting for a decode engine to pull the KV."""
    fields: dict[str, Any] = {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": room}
    if port is not None:
        fields["bootstrap_port"] = port
    return fields
