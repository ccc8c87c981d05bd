"""``RedisBus``: the event bus on Redis Streams (redis-py asyncio, RESP2).

The key layout is ``gateway.contract.wire.RedisLayout`` (docs/protocol.md, "Redis keys").
Appends are pipelined (one round trip per batch). ``rediss://`` URLs use TLS; a password in
the URL (or ``password=``) sends AUTH.

Three ways to reach Redis, chosen at construction:

* one node (``url``): reads are one blocking XREAD over all streams;
* Redis Cluster (``cluster=True``, ``url`` names any node): redis-py's ``RedisCluster``
  follows the slot map and its changes after a failover. A worker's keys share the hash
  tag of its stream group, so every command touches one slot. Redis refuses a multi-key
  command across slots (even on one node), so a read is one blocking XREAD per group
  (``STREAM_GROUPS`` at most), all in flight at once on their own connections. A slot
  whose reads or appends keep failing for ``rebuild_after`` seconds gets a new client
  (``_rebuild_if_stuck``): a slot map that did not heal after a failover;
* Sentinel (``sentinels=["host:port", ...]``, ``sentinel_master``; ``url``, if given, only
  for its credentials, database and TLS): the sentinels name the primary on every new
  connection, so after a failover the next reconnect reaches the new
  primary (a failed command raises ``BusError`` and the caller retries).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisClusterException, RedisError

from gateway.contract.bus import BusError, EventBus, StreamRead
from gateway.contract.wire import (
    ENTRY_FIELD,
    ORIGIN_FIELD,
    EngineReport,
    Entry,
    RedisLayout,
    Snapshot,
    WorkerInfo,
    decode_report,
    decode_snapshot,
    decode_worker,
    encode_entry,
    encode_report,
    encode_snapshot,
    encode_worker,
    try_decode_entry,
)

__all__ = ["RedisBus", "parse_sentinels"]

log = logging.getLogger(__name__)

#: stream keys (and their slots) remembered per bus before the memo starts over
_MEMO_MAX = 100_000
#: server-side XREAD BLOCK of a cluster group's read, which stays in flight across calls
#: (``_read_cluster``): with 60 groups and the consumer's 100 ms calls, idle groups were
#: re-read 600 times a second. Entries wake a read at once; what waits up to this long is
#: a stream that was not in its group's read in flight (a worker that just joined or was
#: re-bootstrapped), after its snapshot.
_GROUP_BLOCK_MS = 1000
#: a cluster group whose reads have failed this long (seconds) gets a new client: redis-py's
#: slot map normally heals on the next read after a failover, and once in CI a client kept
#: reading the dead primary for 40 s after the takeover; a fresh client starts from nothing
_REBUILD_AFTER_S = 5.0

#: what a failed or refused command raises (cluster slot-map errors are not RedisErrors)
_ERRORS = (RedisError, RedisClusterException, OSError)


class RedisBus(EventBus):
    """Redis Streams implementation of ``EventBus``.

    ``max_stream_len`` caps every stream (approximate MAXLEN on XADD) as a safety net when
    snapshots stop; normal trimming is MINID behind snapshots (``trim``).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvroute:",
        password: str | None = None,
        max_stream_len: int | None = 1_000_000,
        socket_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        cluster: bool = False,
        sentinels: Sequence[str] = (),
        sentinel_master: str = "",
        rebuild_after: float = _REBUILD_AFTER_S,
        **kwargs: Any,
    ) -> None:
        self.layout = RedisLayout(prefix)
        self.max_stream_len = max_stream_len
        self.cluster = cluster
        opts: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
            **kwargs,
        }
        if password is not None:
            opts["password"] = password
        self._r: Any
        self._reader: Any
        self._worker_key: dict[str, str] = {}
        #: worker -> (registration key, load report key): built once, not every poll
        self._record_keys: dict[str, tuple[str, str]] = {}
        #: worker -> (registration bytes, decoded): a registration rarely changes, and
        #: every replica reads every worker's every 0.2 s, so equal bytes are not decoded again
        self._registrations: dict[str, tuple[bytes, WorkerInfo]] = {}
        self._key_worker: dict[str, str] = {}
        self._key_slot: dict[str, int] = {}
        #: cluster reads in flight: slot -> (positions, XREAD task)
        self._inflight: dict[int, tuple[dict[str, str], asyncio.Future[Any]]] = {}
        #: cluster: slot -> monotonic time of the first of its reads' (appends') current run
        #: of failures
        self._failing_since: dict[int, float] = {}
        self._appends_failing_since: dict[int, float] = {}
        self._url = url
        self._opts = dict(opts)
        self.rebuild_after = rebuild_after
        #: the failing time that triggers the next replacement: doubles after each one (to
        #: a minute) until a failing group reads again, so a long outage or a slow failover
        #: (cluster-node-timeout is 15 s by default) does not replace the client every 5 s
        self._rebuild_wait = rebuild_after
        #: the slots whose failures caused the last replacement
        self._stuck: set[int] = set()
        #: cluster clients replaced because a slot's reads or appends kept failing
        #: (``_rebuild_if_stuck``)
        self.client_rebuilds = 0
        if cluster and sentinels:
            raise ValueError("redis: cluster and sentinels exclude each other")
        if cluster:
            # one client: its pool per node gives each blocking read a connection of its own
            self._r = self._reader = RedisCluster.from_url(url, **opts)
        elif sentinels:
            self._r, self._reader = _sentinel_clients(url, sentinels, sentinel_master, opts)
        else:
            opts.update(health_check_interval=10, retry_on_timeout=False)
            self._r = aioredis.Redis.from_url(url, **opts)
            # XREAD BLOCK holds its connection: give blocking reads their own client.
            self._reader = aioredis.Redis.from_url(url, **opts)

    # -- streams ----------------------------------------------------------------------------

    async def append(self, worker: str, entries: Sequence[Entry]) -> list[str]:
        if not entries:
            return []
        key = self.layout.stream(worker)
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for entry in entries:
                    pipe.xadd(
                        key,
                        {ENTRY_FIELD: encode_entry(entry)},
                        maxlen=self.max_stream_len,
                        approximate=True,
                    )
                ids = await pipe.execute()
        except _ERRORS as exc:
            if self.cluster:
                self._appends_failing_since.setdefault(self._slot(key), time.monotonic())
                await self._rebuild_if_stuck()
            raise BusError(f"XADD to {key} failed: {exc}") from exc
        if self._appends_failing_since or self._stuck:
            self._succeeded(self._appends_failing_since, self._slot(key))
        return [_s(i) for i in ids]

    def _slot(self, key: str) -> int:
        """``key``'s cluster slot, memoised (``_stream_key`` clears the memo)."""
        slot = self._key_slot.get(key)
        if slot is None:
            slot = self._key_slot[key] = self._reader.keyslot(key)
        return slot

    def _succeeded(self, failing_since: dict[int, float], slot: int) -> None:
        """``slot`` answered: its run of failures is over, and if it was one that caused the
        last replacement, the wait before the next is back to ``rebuild_after``."""
        if failing_since.pop(slot, None) is not None or slot in self._stuck:
            self._stuck.clear()
            self._rebuild_wait = self.rebuild_after

    async def read(
        self, positions: Mapping[str, str], count: int = 1000, block_ms: int | None = None
    ) -> list[StreamRead]:
        if not positions:
            return []
        streams = {self._stream_key(w): pos for w, pos in positions.items()}
        try:
            if self.cluster:
                reply = await self._read_cluster(streams, count, block_ms)
            else:
                reply = await self._reader.xread(streams, count=count, block=block_ms)
        except _ERRORS as exc:
            raise BusError(f"XREAD failed: {exc}") from exc
        out = []
        for key, items in reply or []:
            entries = [(_s(sid), _decode_fields(fields)) for sid, fields in items]
            k = _s(key)
            worker = self._key_worker.get(k) or self.layout.stream_worker(k)
            out.append(StreamRead(worker, entries))
        return out

    def _stream_key(self, worker: str) -> str:
        """``layout.stream(worker)``, memoised: a read names every worker's stream."""
        key = self._worker_key.get(worker)
        if key is None:
            if len(self._worker_key) >= _MEMO_MAX:  # ids churn over days: start over
                self._worker_key.clear()
                self._key_worker.clear()
                self._key_slot.clear()
            key = self._worker_key[worker] = self.layout.stream(worker)
            self._key_worker[key] = worker
        return key

    async def _read_cluster(
        self, streams: dict[str, str], count: int, block_ms: int | None
    ) -> list[Any]:
        """One blocking XREAD per slot (stream group), all in flight at once.

        A group's read is started with the positions of the moment and left running across
        calls (cancelling a blocking read would cost its connection); a call returns what
        the reads finished by then hold, waiting up to ``block_ms`` for the first. Entries
        read for a stream whose position has changed meanwhile (a re-bootstrap) are dropped
        and read again from the new position: XREAD consumes nothing."""
        groups: dict[int, dict[str, str]] = {}
        for key, pos in streams.items():
            groups.setdefault(self._slot(key), {})[key] = pos
        for slot in [s for s in self._failing_since if s not in groups]:
            del self._failing_since[slot]  # no longer read (its workers left)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (block_ms or 0) / 1000
        while True:
            for slot, positions in groups.items():
                if slot not in self._inflight:
                    # the server-side block outlives the call (the read stays in flight):
                    # an idle group re-reads once per _GROUP_BLOCK_MS, not once per call
                    wait = max(block_ms, _GROUP_BLOCK_MS) if block_ms else block_ms
                    read = self._xread_slot(slot, positions, count, wait)
                    self._inflight[slot] = (positions, asyncio.ensure_future(read))
            tasks = [t for _, t in self._inflight.values()]
            left = deadline - loop.time()
            if left > 0 and not any(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            try:
                out = self._collect_reads(streams)
            except _ERRORS:
                # the slot map may be stale (a failover): refresh it before the next call
                with contextlib.suppress(*_ERRORS):
                    await self._reader.nodes_manager.initialize()
                raise
            finally:
                await self._rebuild_if_stuck()
            # a group that timed out empty is read again until data comes or time is up
            if out or loop.time() >= deadline:
                return out

    async def _xread_slot(
        self, slot: int, positions: dict[str, str], count: int, block_ms: int | None
    ) -> Any:
        """XREAD of one slot's streams sent straight to the slot's primary: redis-py would
        otherwise ask the server for the keys of every XREAD (COMMAND GETKEYS, a round trip:
        XREAD's keys are "movable")."""
        await self._reader.initialize()
        node = self._reader.nodes_manager.get_node_from_slot(slot)
        args: list[Any] = ["COUNT", count]
        if block_ms:
            args += ["BLOCK", block_ms]
        args += ["STREAMS", *positions.keys(), *positions.values()]
        return await self._reader.execute_command("XREAD", *args, target_nodes=node)

    async def _rebuild_if_stuck(self) -> None:
        """Replace the cluster client when a group's reads (or a slot's appends) have failed
        for ``rebuild_after`` seconds (doubling after each replacement). Its reads in flight
        are dropped (XREAD consumes nothing: the next call reads from the same positions)
        and the new client is seeded with every node the old one knew, so a dead node named
        by the URL does not matter."""
        if not self._failing_since and not self._appends_failing_since:
            return  # the usual case: nothing failing, nothing allocated per read
        now = time.monotonic()
        failing = {**self._appends_failing_since, **self._failing_since}
        if not any(now - t >= self._rebuild_wait for t in failing.values()):
            return
        old = self._reader
        known = {n.name: n for n in old.nodes_manager.startup_nodes.values()}
        known.update(old.nodes_manager.nodes_cache)
        seeds = [ClusterNode(n.host, n.port) for n in known.values()]
        log.warning(
            "cluster commands failing for %.1f s: replacing the Redis client (%d known nodes)",
            now - min(failing.values()),
            len(seeds),
        )
        self._r = self._reader = RedisCluster.from_url(self._url, startup_nodes=seeds, **self._opts)
        self.client_rebuilds += 1
        self._rebuild_wait = min(2 * self._rebuild_wait, max(self.rebuild_after, 60.0))
        self._stuck = set(failing)
        self._failing_since.clear()
        self._appends_failing_since.clear()
        tasks = [t for _, t in self._inflight.values()]
        self._inflight.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        with contextlib.suppress(*_ERRORS):
            await old.aclose()

    def _collect_reads(self, streams: dict[str, str]) -> list[Any]:
        """Replies of the finished group reads for streams still at the position read from;
        a failure is raised unless another group read something (the next call retries)."""
        out: list[Any] = []
        failed: BaseException | None = None
        for slot, (positions, task) in list(self._inflight.items()):
            if not task.done():
                continue
            del self._inflight[slot]
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is not None:
                self._failing_since.setdefault(slot, time.monotonic())
                failed = failed or exc
                continue
            if self._failing_since or self._stuck:
                self._succeeded(self._failing_since, slot)
            for key, items in task.result() or []:
                k = _s(key)
                if streams.get(k) == positions.get(k):
                    out.append((k, items))
        if failed is not None and not out:
            raise failed
        return out

    # -- placements (gateway replicas) --------------------------------------------------------

    carries_placements = True
    #: placements batches kept (approximate MAXLEN): seconds of traffic, the only readers
    #: being live replicas that read as they come
    placements_max_len = 10_000

    async def publish_placements(self, origin: str, data: bytes) -> None:
        key = self.layout.placements
        fields = {ORIGIN_FIELD: origin, ENTRY_FIELD: data}
        try:
            await self._r.xadd(key, fields, maxlen=self.placements_max_len, approximate=True)
        except _ERRORS as exc:
            raise BusError(f"XADD to {key} failed: {exc}") from exc

    async def placements_tail(self) -> str:
        try:
            last = await self._r.xrevrange(self.layout.placements, count=1)
        except _ERRORS as exc:
            raise BusError(f"XREVRANGE failed: {exc}") from exc
        return _s(last[0][0]) if last else "0-0"

    async def read_placements(
        self, after: str, count: int = 256, block_ms: int | None = None
    ) -> list[tuple[str, str, bytes]]:
        key = self.layout.placements
        try:
            # the reader's pool gives this blocking read a connection of its own
            reply = await self._reader.xread({key: after}, count=count, block=block_ms)
        except _ERRORS as exc:
            raise BusError(f"XREAD of {key} failed: {exc}") from exc
        # an entry without the fields reads as empty: the reader counts it as garbage
        return [
            (_s(sid), _s(fields.get(ORIGIN_FIELD) or b""), fields.get(ENTRY_FIELD) or b"")
            for _, items in reply or []
            for sid, fields in items
        ]

    async def trim(self, worker: str, min_id: str) -> None:
        try:
            await self._r.xtrim(self.layout.stream(worker), minid=min_id, approximate=True)
        except _ERRORS as exc:
            raise BusError(f"XTRIM failed: {exc}") from exc

    async def stream_bytes(self, worker: str) -> int:
        try:
            return int(await self._r.memory_usage(self.layout.stream(worker), samples=0) or 0)
        except _ERRORS as exc:
            raise BusError(f"MEMORY USAGE failed: {exc}") from exc

    # -- snapshots --------------------------------------------------------------------------

    async def write_snapshot(self, worker: str, snapshot: Snapshot) -> None:
        try:
            await self._r.set(self.layout.snapshot(worker), encode_snapshot(snapshot))
        except _ERRORS as exc:
            raise BusError(f"snapshot write failed: {exc}") from exc

    async def read_snapshot(self, worker: str) -> Snapshot | None:
        try:
            data: Any = await self._r.get(self.layout.snapshot(worker))
        except _ERRORS as exc:
            raise BusError(f"snapshot read failed: {exc}") from exc
        if data is None:
            return None
        try:
            return decode_snapshot(data)
        except ValueError:  # msgspec.DecodeError is a ValueError
            return None

    # -- registry ---------------------------------------------------------------------------

    async def register(self, info: WorkerInfo, ttl: float) -> None:
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.set(self.layout.worker(info.worker_id), encode_worker(info), px=_ms(ttl))
                pipe.sadd(self.layout.workers, info.worker_id)
                await pipe.execute()
        except _ERRORS as exc:
            raise BusError(f"register failed: {exc}") from exc

    async def deregister(self, worker: str) -> None:
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.delete(self.layout.worker(worker), self.layout.load(worker))
                pipe.srem(self.layout.workers, worker)
                await pipe.execute()
        except _ERRORS as exc:
            raise BusError(f"deregister failed: {exc}") from exc

    async def workers(self) -> dict[str, WorkerInfo]:
        try:
            ids = sorted(_s(m) for m in await self._r.smembers(self.layout.workers))
            if not ids:
                self._registrations = {}
                return {}
            values = await self._mget([self._keys_of(w)[0] for w in ids])
        except _ERRORS as exc:
            raise BusError(f"registry read failed: {exc}") from exc
        out = {}
        lapsed = []
        known = self._registrations
        seen: dict[str, tuple[bytes, WorkerInfo]] = {}
        for w, data in zip(ids, values, strict=True):
            if data is None:
                lapsed.append(w)
                continue
            prev = known.get(w)
            if prev is not None and prev[0] == data:
                info = prev[1]
            else:
                try:
                    info = decode_worker(data)
                except ValueError:
                    continue
            out[w] = info
            seen[w] = (data, info)
        self._registrations = seen  # only the registered: bounded by the fleet
        if lapsed:  # keep the set bounded; a live agent re-adds itself every heartbeat
            try:
                await self._r.srem(self.layout.workers, *lapsed)
            except _ERRORS as exc:
                raise BusError(f"registry prune failed: {exc}") from exc
        return out

    # -- load -------------------------------------------------------------------------------

    async def publish_report(self, worker: str, report: EngineReport, ttl: float) -> None:
        try:
            await self._r.set(self.layout.load(worker), encode_report(report), px=_ms(ttl))
        except _ERRORS as exc:
            raise BusError(f"load report failed: {exc}") from exc

    async def read_reports(self, workers: Sequence[str]) -> dict[str, EngineReport]:
        if not workers:
            return {}
        try:
            values = await self._mget([self._keys_of(w)[1] for w in workers])
        except _ERRORS as exc:
            raise BusError(f"load read failed: {exc}") from exc
        out = {}
        for w, data in zip(workers, values, strict=True):
            if data is not None:
                try:
                    out[w] = decode_report(data)
                except ValueError:
                    continue
        return out

    def _keys_of(self, worker: str) -> tuple[str, str]:
        """``worker``'s registration and load report keys (memoised: a hash per id)."""
        keys = self._record_keys.get(worker)
        if keys is None:
            if len(self._record_keys) >= _MEMO_MAX:  # ids churn over days: start over
                self._record_keys.clear()
            keys = self._record_keys[worker] = (
                self.layout.worker(worker),
                self.layout.load(worker),
            )
        return keys

    async def _mget(self, keys: list[str]) -> list[Any]:
        """MGET; on a cluster split by slot (each worker's keys have a slot of their own)."""
        if self.cluster:
            return list(await self._r.mget_nonatomic(keys))
        return list(await self._r.mget(keys))

    async def ping(self) -> None:
        try:
            await self._r.ping()
        except _ERRORS as exc:
            raise BusError(f"PING failed: {exc}") from exc

    async def close(self) -> None:
        for _, task in self._inflight.values():
            task.cancel()
        if self._inflight:
            await asyncio.wait([t for _, t in self._inflight.values()])
            self._inflight.clear()
        await self._r.aclose()
        if self._reader is not self._r:
            await self._reader.aclose()


def _sentinel_clients(
    url: str, sentinels: Sequence[str], master: str, opts: dict[str, Any]
) -> tuple[Any, Any]:
    """Clients of the primary the sentinels name (asked again on every new connection); the
    URL, if any, still gives the credentials, database and TLS (not the host)."""
    if not master:
        raise ValueError("redis: sentinels need sentinel_master (the primary's name)")
    sentinel = Sentinel(
        parse_sentinels(sentinels),
        socket_timeout=opts["socket_timeout"],
        socket_connect_timeout=opts["socket_connect_timeout"],
    )
    parsed = parse_url(url) if url else {}
    conn: dict[str, Any] = {k: v for k, v in parsed.items() if k not in ("host", "port")}
    conn.pop("connection_class", None)  # the sentinel pool picks its own class
    if url.startswith("rediss://"):
        conn["ssl"] = True
    conn.update(opts)
    return sentinel.master_for(master, **conn), sentinel.master_for(master, **conn)


def parse_sentinels(items: Sequence[str]) -> list[tuple[str, int]]:
    """``["host:port", ...]`` -> ``[(host, port), ...]`` (port 26379 when omitted)."""
    out = []
    for item in items:
        host, sep, port = item.strip().rpartition(":")
        if not sep:
            host, port = port, "26379"
        if not host or not port.isdigit():
            raise ValueError(f"redis.sentinels: expected host:port, got {item!r}")
        out.append((host, int(port)))
    return out


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _decode_fields(fields: Mapping[bytes, bytes]) -> Entry | None:
    data = fields.get(ENTRY_FIELD)
    return None if data is None else try_decode_entry(data)
