"""Built-in routing policies, one per module; importing this package registers them all."""

from gateway.routing.policies import (
    cache_aware,
    least_load,
    prefix,
    random_choice,
    round_robin,
    session,
    ttft,
)

__all__ = ["cache_aware", "least_load", "prefix", "random_choice", "round_robin", "session", "ttft"]
