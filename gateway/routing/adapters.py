"""LoRA adapters of a pool's workers: which workers serve an adapter, which have it loaded.

A request whose ``model`` names an adapter may only go to a worker that serves the adapter
(an engine answers 404 for one it does not know), and costs an adapter load on a worker that
does not have it in GPU memory (vLLM keeps ``--max-loras`` adapters loaded, least recently
used out). The engines say which adapters they serve (vLLM ``/v1/models``: cards whose
``parent`` is the base model; the agent registers them) and, roughly, which are loaded
(vLLM's ``vllm:lora_requests_info`` names the adapters of running and waiting requests only).
So residency is modelled here: the adapters an engine reports, plus those the gateway sent
requests for, least recently used first, bounded by the engine's number of slots.

Occupancy too: a batch holds at most that many adapters, and a slot whose adapter a running
request uses cannot be taken. vLLM skips a waiting request whose adapter would exceed it and
schedules the ones behind (SGLang stops its batch there), so on a worker whose requests in
flight already use every slot with other adapters, a request waits until one of those
adapters has no request left: under steady traffic for them, indefinitely (the lora preset
measured a 29 s p99 that way). ``crowded`` names those workers from the requests this
gateway has in flight. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["DEFAULT_LOADED_SLOTS", "AdapterCatalog"]

#: vLLM's default ``--max-loras``: adapters loaded at once when the engine does not say.
DEFAULT_LOADED_SLOTS = 1


@dataclass
class _Worker:
    served: frozenset[str] = frozenset()
    loaded: OrderedDict[str, None] = field(default_factory=OrderedDict)  # oldest first
    slots: int = DEFAULT_LOADED_SLOTS
    busy: Counter[str] = field(default_factory=Counter)  # requests in flight per adapter
    said: bool = False  # the engine reported its slots (vLLM's ``max_lora``)


class AdapterCatalog:
    """Adapters served and loaded per worker of one pool.

    ``configured`` adapters are served by every worker of the pool (the pool's settings, for
    engines started with a fixed ``--lora-modules`` list); registrations add their own.
    """

    def __init__(self, configured: Iterable[str] = ()) -> None:
        self.configured = frozenset(configured)
        self._workers: dict[str, _Worker] = {}

    # -- membership and what the engines say ------------------------------------------------

    def add_worker(self, worker: str) -> None:
        self._workers.setdefault(worker, _Worker())

    def remove_worker(self, worker: str) -> None:
        self._workers.pop(worker, None)

    def serve(self, worker: str, adapters: Iterable[str]) -> None:
        """``worker`` registered the adapters it serves."""
        w = self._workers.setdefault(worker, _Worker())
        w.served = frozenset(adapters)
        for name in [a for a in w.loaded if not self.serves(worker, a)]:
            del w.loaded[name]

    def report(self, worker: str, loaded: Iterable[str] | None, slots: int | None) -> None:
        """The engine's report: adapters it has loaded now, and how many it keeps."""
        w = self._workers.get(worker)
        if w is None:
            return
        if slots is not None and slots > 0:
            w.slots = slots
            w.said = True
        for name in loaded or ():
            self._touch(w, name)
        self._trim(w)

    def routed(self, worker: str, adapter: str) -> None:
        """A request for ``adapter`` was sent to ``worker``: the engine loads it."""
        w = self._workers.get(worker)
        if w is not None:
            self._touch(w, adapter)
            self._trim(w)

    def begin(self, worker: str, adapter: str) -> None:
        """A request for ``adapter`` is in flight on ``worker`` (it occupies a slot)."""
        w = self._workers.get(worker)
        if w is not None:
            w.busy[adapter] += 1

    def end(self, worker: str, adapter: str) -> None:
        """A request ``begin`` counted ended (its worker may have been removed since)."""
        w = self._workers.get(worker)
        if w is not None and w.busy[adapter] > 0:
            w.busy[adapter] -= 1
            if not w.busy[adapter]:
                del w.busy[adapter]

    # -- queries ----------------------------------------------------------------------------

    def crowded(self, adapter: str, workers: Iterable[str]) -> frozenset[str]:
        """Of ``workers``, those whose requests in flight use every slot with other adapters:
        a request for ``adapter`` would wait there for one of them to drain. Only engines
        that report their slots count (SGLang does not, and batches up to 8 by default)."""
        get = self._workers.get
        return frozenset(
            name
            for name in workers
            if (w := get(name)) is not None
            and w.said
            and adapter not in w.busy
            and len(w.busy) >= w.slots
        )

    def known(self, adapter: str) -> bool:
        """Whether any worker of the pool serves ``adapter``."""
        return adapter in self.configured or any(
            adapter in w.served for w in self._workers.values()
        )

    def serves(self, worker: str, adapter: str) -> bool:
        if adapter in self.configured:
            return True
        w = self._workers.get(worker)
        return w is not None and adapter in w.served

    def not_serving(self, adapter: str) -> set[str]:
        """Workers that do not serve ``adapter`` (to exclude from its routing)."""
        if adapter in self.configured:
            return set()
        return {name for name, w in self._workers.items() if adapter not in w.served}

    def not_loaded(self, adapter: str, workers: Iterable[str]) -> frozenset[str]:
        """Of ``workers``, those without ``adapter`` loaded (they would pay its load)."""
        get = self._workers.get
        return frozenset(
            name for name in workers if (w := get(name)) is None or adapter not in w.loaded
        )

    def is_loaded(self, worker: str, adapter: str) -> bool:
        w = self._workers.get(worker)
        return w is not None and adapter in w.loaded

    def served_by(self, worker: str) -> list[str]:
        """Adapters ``worker`` serves (configured ones included), sorted."""
        w = self._workers.get(worker)
        return sorted(self.configured | (w.served if w is not None else frozenset()))

    def loaded_on(self, worker: str) -> list[str]:
        """Adapters modelled as loaded on ``worker``, least recently used first."""
        w = self._workers.get(worker)
        return [] if w is None else list(w.loaded)

    def names(self) -> list[str]:
        """Every adapter some worker serves, sorted (the models a client may ask for)."""
        out = set(self.configured)
        for w in self._workers.values():
            out |= w.served
        return sorted(out)

    # -- internals --------------------------------------------------------------------------

    @staticmethod
    def _touch(w: _Worker, adapter: str) -> None:
        w.loaded[adapter] = None
        w.loaded.move_to_end(adapter)

    @staticmethod
    def _trim(w: _Worker) -> None:
        while len(w.loaded) > w.slots:
            w.loaded.popitem(last=False)
