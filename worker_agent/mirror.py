"""The agent's mirror: the canonical key set it has published for its worker.

It is the reference every consumer's index must equal (``index.worker_keys(w) == mirror``).
A worker with several data-parallel ranks holds a key while any rank does, so the mirror
counts holders per key and publishes a store on the first holder and a remove on the last.
It keeps each key's parent so a snapshot can be written as chains.
"""

from __future__ import annotations

from gateway.contract.wire import Cleared, Event, Removed, Stored
from worker_agent.canonical import Chain

__all__ = ["WorkerMirror"]


class WorkerMirror:
    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}
        self._holders: dict[int, int] = {}  # key -> ranks holding it, only when > 1

    def __len__(self) -> int:
        return len(self.parent)

    def keys(self) -> frozenset[int]:
        return frozenset(self.parent)

    def add(self, chains: list[Chain]) -> list[Event]:
        """Ranks newly hold ``chains``; returns stores for keys new to the worker."""
        out: list[Event] = []
        parent = self.parent
        holders = self._holders
        for first_parent, keys in chains:
            run: list[int] = []
            run_parent = first_parent
            prev = first_parent
            for k in keys:
                if k in parent:
                    holders[k] = holders.get(k, 1) + 1
                    if run:
                        out.append(Stored(run_parent, run))
                        run = []
                else:
                    if not run:
                        run_parent = prev
                    parent[k] = prev
                    run.append(k)
                prev = k
            if run:
                out.append(Stored(run_parent, run))
        return out

    def drop(self, keys: list[int]) -> list[Event]:
        """A rank no longer holds ``keys``; returns a remove for keys no rank holds."""
        gone = []
        parent = self.parent
        holders = self._holders
        for k in keys:
            n = holders.get(k)
            if n is not None:
                if n > 2:
                    holders[k] = n - 1
                else:
                    del holders[k]
            elif k in parent:
                del parent[k]
                gone.append(k)
        return [Removed(gone)] if gone else []

    def clear(self) -> list[Event]:
        self.parent.clear()
        self._holders.clear()
        return [Cleared()]

    def chains(self, max_len: int = 0) -> list[Chain]:
        """The whole set as parent-first chains (snapshots, resync); ``max_len`` splits."""
        return build_chains(dict(self.parent), max_len)


def build_chains(parent: dict[int, int | None], max_len: int = 0) -> list[Chain]:
    """Group keys into chains (snapshots, resync); pure, one linear pass.

    The mirror's dict keeps insertion order and a key is inserted after its parent
    (published stores follow their parents), so consecutive entries already form chains
    in parent-first order. A key re-inserted after its children (evicted and stored again)
    just starts a chain that the index attaches when it arrives. ``max_len`` splits chains.
    """
    out: list[Chain] = []
    chain: list[int] = []
    prev: int | None = None
    for k, p in parent.items():
        if chain and p == prev and p is not None and (not max_len or len(chain) < max_len):
            chain.append(k)
        else:
            chain = [k]
            out.append((p, chain))
        prev = k
    return out
