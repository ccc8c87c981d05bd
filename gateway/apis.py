"""The generation APIs the gateway serves: path, request kind, error shape, engines serving it.

Every API goes through the same path (parse -> tokenize -> route -> proxy the client's bytes);
what differs is declared here. An API an engine does not serve is never translated into
another one (that would change what the engine computes): workers whose engine lacks it are
left out of routing, and a pool where none has it answers 501 naming its engines.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import ApiError, ErrorShape
from gateway.requests import Kind

__all__ = ["APIS", "Api"]


@dataclass(frozen=True)
class Api:
    kind: Kind
    path: str
    errors: ErrorShape = "openai"
    #: engines that serve ``path`` (None: every engine); workers of unknown engine are tried
    engines: frozenset[str] | None = None

    def served_by(self, engine: str | None) -> bool:
        return self.engines is None or engine is None or engine in self.engines

    def unsupported(self, pool: str, engines: set[str]) -> ApiError:
        """501 for a pool none of whose workers' engines serve this API."""
        names = ", ".join(sorted(engines)) or "none"
        return ApiError(
            501,
            f"{self.path} is not served by the engines of pool {pool!r} ({names}); it is "
            f"served by {', '.join(sorted(self.engines or ()))}. The gateway does not translate "
            "it to another API.",
            "not_implemented",
            code="endpoint_not_supported",
        )


APIS: dict[Kind, Api] = {
    api.kind: api
    for api in (
        Api("chat", "/v1/chat/completions"),
        Api("completion", "/v1/completions"),
        Api("generate", "/generate"),
        # vLLM and SGLang both render Responses input as chat messages with the template
        Api("responses", "/v1/responses", "responses", frozenset({"vllm", "sglang"})),
        # vLLM serves Anthropic's Messages API; SGLang does not
        Api("messages", "/v1/messages", "anthropic", frozenset({"vllm"})),
    )
}
