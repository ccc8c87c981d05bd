"""ZMQ transport of KV events, as vLLM's ``ZmqEventPublisher`` (and SGLang's copy) does it.

* Live: a PUB socket sends ``[topic, seq (8 bytes big-endian), payload]``; ``seq`` counts
  from 0 at every start.
* Replay: a ROUTER socket takes ``[identity, b"", start_seq]`` and answers one message per
  buffered batch with ``seq >= start_seq``, then an end marker whose seq is ``ff``×8. Frame
  layouts: ``[identity, b"", topic, seq, payload]`` (vLLM >= 0.26, SGLang >= 0.5.22) or
  ``[identity, b"", seq, payload]`` (older); the end marker has an empty topic / payload.
  The buffer keeps the last ``buffer_steps`` batches.

A fault hook drops the next N batches on the live path only (they stay in the replay
buffer), which is how tests make sequence gaps that replay can fill.

``replay_queue_bound`` reproduces vLLM 0.23's and SGLang 0.5.23's replay sockets, which send
the whole buffer in one burst through a ROUTER with the default send queue: past ~1,000
queued messages the socket drops the rest of the reply silently, end marker included. With a
bound B, each reply sends its first B messages and drops the others (deterministically, so
tests can count on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

__all__ = ["END_SEQ", "EventPublisher"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_BIND_RETRY_S = 2.0  # a just-closed port may take a moment to come back after a restart


class EventPublisher:
    """One engine's PUB + replay ROUTER pair (see the module docstring)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        host: str,
        port: int = 0,
        replay_port: int | None = 0,
        *,
        topic: str = "",
        buffer_steps: int = 10000,
        hwm: int = 100000,
        replay_topic_frame: bool = True,
        replay_queue_bound: int | None = None,
    ) -> None:
        self._ctx = ctx
        self.host = host
        self.port = port
        self.replay_port = replay_port
        self.topic = topic.encode("utf-8")
        self.replay_topic_frame = replay_topic_frame
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._hwm = hwm
        self._seq = 0
        self._drop = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.replay_queue_bound = replay_queue_bound
        self.replays_served = 0
        self.replay_dropped = 0  # reply messages dropped past the queue bound

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> EventPublisher:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(self._hwm)
        self._pub = pub
        self.port = await _bind(pub, self.host, self.port)
        if self.replay_port is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 2 * ((self._buffer.maxlen or 0) + 1))
            self._router = router
            self.replay_port = await _bind(router, self.host, self.replay_port)
            self._replay_task = asyncio.create_task(self._serve_replay())
        return self

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    # -- publishing ------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://{self.host}:{self.replay_port}"

    @property
    def next_seq(self) -> int:
        return self._seq

    def drop_next(self, n: int) -> None:
        """Do not send the next ``n`` batches live (they are still numbered and buffered)."""
        self._drop += max(0, n)

    async def publish(self, payload: bytes) -> int:
        """Send one batch; returns its sequence number."""
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1
        elif self._pub is not None:
            await self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    async def publish_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the live socket (fault injection: not numbered, not
        buffered for replay)."""
        if self._pub is not None:
            await self._pub.send_multipart(frames)

    # -- replay ----------------------------------------------------------------------------

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("Invalid replay request: %d frames", len(frames))
                continue
            await self._replay(router, frames[0], int.from_bytes(frames[2], "big"))

    async def _replay(self, router: zmq.asyncio.Socket, ident: bytes, start: int) -> None:
        head = [ident, b""] + ([self.topic] if self.replay_topic_frame else [])
        end = [ident, b""] + ([b""] if self.replay_topic_frame else [])
        reply = [
            [*head, seq.to_bytes(8, "big"), payload]
            for seq, payload in list(self._buffer)
            if seq >= start
        ]
        reply.append([*end, END_SEQ, b""])
        bound = self.replay_queue_bound
        if bound is not None and len(reply) > bound:
            self.replay_dropped += len(reply) - bound
            reply = reply[:bound]
        for frames in reply:
            await router.send_multipart(frames)
        self.replays_served += 1


async def _bind(sock: zmq.asyncio.Socket, host: str, port: int) -> int:
    """Bind ``sock`` (port 0: any free port), retrying briefly while the port is in use."""
    addr = f"tcp://{host}:{port or '*'}"
    deadline = time.monotonic() + _BIND_RETRY_S
    while True:
        try:
            sock.bind(addr)
            break
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    return int(last.rsplit(b":", 1)[1])
