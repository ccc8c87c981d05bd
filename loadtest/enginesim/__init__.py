"""Engine simulator: vLLM/SGLang-compatible GPU workers with the seed's radix-tree KV cache.

Pure, synchronous parts (no I/O, no asyncio; the offline cluster simulator drives them in
virtual time):

* ``kvcache``   — ``BlockAllocator`` + ``RadixCache`` (token radix tree over fixed blocks,
  ref-count pins, LRU leaf eviction) and the neutral cache events;
* ``timing``    — ``TimingModel`` presets (``mocker``, ``seed-70b``) and ``speedup``;
* ``scheduler`` — ``EngineCore``: continuous batching, chunked prefill, prefix hits,
  ``add_request`` / ``step(now)`` / ``advance(until)``;
* ``hashing``, ``events`` — engine block hashes and the exact KV-event wire formats;
* ``api``       — request validation with OpenAI-style errors;
* ``config``    — the ``SimConfig`` dataclass tree.

Live parts (asyncio): ``publisher`` (ZMQ PUB + replay ROUTER), ``metrics`` (Prometheus),
``text`` (tokenizer and output text), ``server`` (aiohttp routes), ``worker`` (one engine
driven in real time, faults), ``cluster`` (``SimCluster``: N workers in one process) and
``cli`` (``kvroute sim``).
"""
