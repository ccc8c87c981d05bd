"""Types of the compiled key function (gateway/routing/_keys.c)."""

from types import NotImplementedType

def keys(
    tokens: object,
    parent: int | None,
    params: tuple[object, ...],
    start: int = 0,
    stop: int = ...,
    /,
) -> list[int] | NotImplementedType: ...
