"""The contract between worker agents and gateways: the only part of ``gateway`` that
``worker_agent`` imports, besides the block keys (``gateway.routing.keys``).

| module | concept |
|---|---|
| ``wire`` | canonical events, stream entries, snapshots, registrations, load reports, their bytes, the Redis layout and the key digest (docs/protocol.md, section by section) |
| ``bus`` | the event bus seam: ``EventBus`` (a small base class, like an httpx transport) and ``MemoryBus`` |
| ``redis_bus`` | ``RedisBus``: the bus on Redis Streams |
| ``settings`` | how every component reads its typed configuration (defaults < YAML < env < flags) |
"""
