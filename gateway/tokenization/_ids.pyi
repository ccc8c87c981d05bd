"""Types of the C helper for cached id tuples (gateway/tokenization/_ids.c)."""

from collections.abc import Iterable

def untracked_ints(ids: Iterable[int], /) -> tuple[int, ...]: ...
