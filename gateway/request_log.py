"""The request log: one line per routed request, for replaying production traffic offline.

``kvroute simulate --from-log`` (``loadtest/replay.py``) replays it in the cluster simulator
against any policy, so a policy change is tried on the real request mix before it serves it.

A record holds what routing needs and nothing a person wrote: when the request was routed,
its pool and block size, its canonical block keys, prompt and output token counts (output
from the engine's ``usage`` when the response ended), the chosen worker with the policy's
reason, and the candidate workers at that moment. No text, no token ids.

Block keys (and session keys) are **re-hashed** with a keyed BLAKE2b under
``request_log.salt`` before they are written. Equal prefixes still get equal keys, which is
all a replay needs; but the log cannot be joined with the live index (Redis streams,
snapshots, ``/debug/index``) to learn which worker holds whose prefix, and testing whether a
guessed document was sent takes the log's salt on top of the deployment's hash seed. A log
is meant to be copied off the serving path and kept longer than any cache, so it gets its
own secret (by default derived from the hash seed, so all replicas of a deployment write
keys that join with each other).

Writing never blocks or fails a request: ``record`` is a non-blocking put on a bounded queue
(a full queue drops the record and counts it); a background thread re-hashes, encodes and
appends, and a failed write (disk full, file gone) drops that batch, counts it and retries
the file later. With ``--workers N`` every process writes its own file (``<path>.<i>``): one
writer per file makes rotation safe, and the replay merges the files by time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import msgspec

from gateway.config import RequestLogSettings
from gateway.contract.settings import ConfigError

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics
    from gateway.routing.policy import Decision

__all__ = ["LogRecord", "RequestLog", "RequestLogError", "process_path"]

log = logging.getLogger("kvroute.request_log")

#: format version written in every record (``v``)
VERSION = 1
_STOP = object()


class LogRecord(msgspec.Struct, kw_only=True):
    """One routed request (one JSON object per line)."""

    v: int = VERSION
    t: float  # wall-clock seconds (Unix time) of the routing decision
    pool: str
    block_size: int
    keys: list[str]  # re-hashed canonical block keys, 16 hex digits each, from the root
    prompt_tokens: int
    output_tokens: int | None  # from usage; None when the engine reported none
    cached_tokens: int | None  # the engine's usage.cached_tokens, when reported
    status: int  # HTTP status the worker answered
    worker: str
    policy: str
    reason: str
    matched_tokens: int
    workers: list[str]  # the candidates the policy chose among (sorted)
    session: str | None = None  # re-hashed session key, when the request carried one


class RequestLogError(ConfigError):
    """The request log cannot be written (raised at start-up, naming the setting)."""


def process_path(path: str, process_index: int | None) -> str:
    """The file one gateway process writes: ``path``, or ``<path>.<i>`` for process i of N."""
    return path if process_index is None else f"{path}.{process_index}"


def _salt(settings: RequestLogSettings, hash_seed: str) -> bytes:
    raw = settings.salt or hash_seed
    return hashlib.blake2b(raw.encode(), digest_size=32, person=b"kvroute-reqlog").digest()


class RequestLog:
    """A bounded queue in front of a background writer thread (see the module docstring)."""

    def __init__(
        self,
        settings: RequestLogSettings,
        hash_seed: str,
        metrics: GatewayMetrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.path = Path(settings.path)
        self.metrics = metrics
        self._rng = rng or random.Random()
        self._hasher = hashlib.blake2b(digest_size=8, key=_salt(settings, hash_seed))
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=settings.queue_size)
        self._file: IO[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._retry_at = 0.0
        self._encode = msgspec.json.Encoder().encode
        #: counters (also exported as metrics): records written, dropped by reason
        self.written = 0
        self.dropped: dict[str, int] = {"queue_full": 0, "write_error": 0}

    # -- lifecycle --------------------------------------------------------------------------

    def open(self) -> None:
        """Open the file for appending and start the writer; a clear error if it cannot."""
        try:
            self._file = open(self.path, "ab")  # noqa: SIM115 (owned by the writer thread)
        except OSError as exc:
            raise RequestLogError(
                f"request_log.path: cannot append to {self.path}: {exc.strerror or exc}"
            ) from None
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (within ``timeout``), then stop the writer."""
        if self._thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._thread = None
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- the request path ---------------------------------------------------------------------

    def record(
        self,
        pool: str,
        block_size: int,
        keys: Sequence[int],
        prompt_tokens: int,
        decision: Decision,
        candidates: Sequence[str],
        age_s: float,
        usage: Any = None,
        status: int = 200,
        session_key: str | None = None,
    ) -> None:
        """Queue one routed request (``age_s``: seconds since its routing decision).

        Never blocks or raises for a full queue: the record is dropped and counted. The
        heavy part (re-hashing, encoding, writing) runs on the writer thread.
        """
        s = self.settings
        if s.sample < 1.0 and self._rng.random() >= s.sample:
            return
        item = (
            time.time() - age_s,
            pool,
            block_size,
            keys,
            prompt_tokens,
            decision,
            candidates,
            usage,
            status,
            session_key,
        )
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._drop("queue_full", 1)

    # -- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        q = self._queue
        while True:
            batch = [q.get()]
            while len(batch) < 1000:
                try:
                    batch.append(q.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            lines = [self._line(item) for item in batch if item is not _STOP]
            if lines:
                self._write(b"".join(lines), len(lines))
            if stop:
                return

    def _hash(self, data: bytes) -> str:
        h = self._hasher.copy()
        h.update(data)
        return h.hexdigest()

    def _line(self, item: tuple[Any, ...]) -> bytes:
        at, pool, block_size, keys, prompt, decision, cands, usage, status, session = item
        rehash = self._hash
        rec = LogRecord(
            t=round(at, 6),
            pool=pool,
            block_size=block_size,
            keys=[rehash(k.to_bytes(16, "little")) for k in keys],
            prompt_tokens=prompt,
            output_tokens=None if usage is None else usage.completion_tokens,
            cached_tokens=None if usage is None else usage.cached_tokens,
            status=status,
            worker=decision.worker,
            policy=decision.policy,
            reason=decision.reason,
            matched_tokens=decision.matched_tokens,
            workers=sorted(cands),
            session=None if session is None else rehash(b"session\0" + session.encode()),
        )
        return self._encode(rec) + b"\n"

    def _write(self, data: bytes, n: int) -> None:
        if self._file is None and not self._reopen():
            self._drop("write_error", n)
            return
        assert self._file is not None
        try:
            self._file.write(data)
            self._file.flush()
        except OSError as exc:
            log.warning("request log: cannot write %s (%s); %d records dropped", self.path, exc, n)
            self._drop("write_error", n)
            self._discard_file()
            return
        self.written += n
        if self.metrics is not None:
            self.metrics.request_log_records.inc(n)
        max_bytes = self.settings.max_bytes
        if max_bytes and self._file.tell() >= max_bytes:
            self._rotate()

    def _discard_file(self) -> None:
        """Forget a failing file (a buffered, unwritable file may fail again on close)."""
        f, self._file = self._file, None
        self._retry_at = time.monotonic() + 1.0
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def _reopen(self) -> bool:
        if time.monotonic() < self._retry_at:
            return False
        try:
            self._file = open(self.path, "ab")  # noqa: SIM115
        except OSError as exc:
            log.warning("request log: cannot reopen %s: %s", self.path, exc)
            self._retry_at = time.monotonic() + 1.0
            return False
        return True

    def _rotate(self) -> None:
        """``path`` -> ``path.1`` -> ... -> ``path.<backups>`` (the oldest is removed)."""
        assert self._file is not None
        self._file.close()
        self._file = None
        n = self.settings.backups
        try:
            if n == 0:
                os.truncate(self.path, 0)
            else:
                for i in range(n - 1, 0, -1):
                    older = Path(f"{self.path}.{i}")
                    if older.exists():
                        older.replace(f"{self.path}.{i + 1}")
                self.path.replace(f"{self.path}.1")
        except OSError as exc:
            log.warning("request log: cannot rotate %s: %s", self.path, exc)
        self._reopen()

    def _drop(self, reason: str, n: int) -> None:
        self.dropped[reason] += n
        if self.metrics is not None:
            self.metrics.request_log_dropped.labels(reason).inc(n)
