"""The routing core: pure, synchronous, deterministic Python with no I/O.

The live gateway, the offline cluster simulator and the benchmarks all call this package, so
what the simulator says about routing quality is what the gateway does. Time is always an
argument and randomness a seeded ``random.Random``. Nothing here imports asyncio, aiohttp,
redis or zmq (checked by import-linter in CI).

| module | concept |
|---|---|
| ``keys`` | canonical block keys ``key_i = H(key_{i-1}, block_i)``, 64-bit, seeded; incremental ``PrefixKeys`` |
| ``index`` | the shadow prefix index: a compressed radix tree over keys, one holder bitmask per run |
| ``load`` | per-worker load: engine reports merged with in-flight accounting; pool kept ordered by load |
| ``costmodel`` | predicted TTFT from queued prefill, uncached prefill and decode interference |
| ``popularity`` | decayed request rates of prefixes (requests/s, from a prefix's first moments) |
| ``replication`` | holders a hot prefix warrants (its demand against one worker's capacity); warm-ups asked for |
| ``policy`` | the policy interface (``PoolView`` in, ``Decision`` with its explanation out) and registry |
| ``policies/`` | one module per policy: ``ttft`` (default), ``round_robin``, ``random``, ``least_load``, ``session``, ``prefix`` |
| ``adapters`` | LoRA adapters per worker: which serve an adapter, which have it loaded (LRU of the engine's slots) |
| ``router`` | index lookup + load + policy → decision; speculative insert; in-flight bookkeeping |

The wire types this core consumes (``EngineReport``) come from ``gateway.contract.wire``.
"""
