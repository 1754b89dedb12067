"""The server side of the KV-event stream: our engine publishes through it; tests use it as a
server they control."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from minirad.errors import InvalidArgumentError
from minirad.kv_events.wire import (
    ENCODER,
    END_SEQ,
    KVEvent,
    KVEventBatch,
    check_events,
    connectable,
)

__all__ = [
    "KVEventPublisher",
]


log = logging.getLogger(__name__)


_LOOPBACK_HOSTS = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:")


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the others; and, unlike
    vLLM, bind a loopback address too (``tcp://127.0.0.1:5557``), so that a fixed port can
    listen on this machine alone, where vLLM's rule offers only ``*``, every interface."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://", *_LOOPBACK_HOSTS))
    )


class KVEventPublisher:
    """The server side of vLLM's KV-event protocol: a PUB socket and, optionally, a replay
    ROUTER socket that resends buffered batches, answering exactly as vLLM 0.32's
    ``ZmqEventPublisher`` does (module docstring).

    Args:
        endpoint: PUB address. Bound if it is a loopback address (``"tcp://127.0.0.1:5557"``,
            or ``"tcp://127.0.0.1:*"`` for a free port), contains ``*`` (``"tcp://*:5557"``:
            every network interface) or ``::``, or is ipc/inproc; connected otherwise (to a
            bound subscriber or proxy), as vLLM does.
        replay_endpoint: ROUTER address, always bound (``"tcp://127.0.0.1:*"`` for a free
            port), or None for no replay.
        topic: the topic frame of every message.
        buffer_size: how many recent batches the replay socket keeps (vLLM's ``buffer_steps``).
        data_parallel_rank: stamped on every batch (vLLM stamps 0).

    Attributes:
        endpoint, replay_endpoint: where a subscriber connects (the real port of a ``*`` one,
            127.0.0.1 for a wildcard host).

    Publishing runs on the caller's thread (sends never block: PUB drops what no subscriber
    takes); a daemon thread answers replay requests until :meth:`close`.

    Raises:
        InvalidArgumentError: a bad endpoint or one already in use, ``buffer_size < 1``.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_size: int = 10_000,
        data_parallel_rank: int | None = 0,
    ) -> None:
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise InvalidArgumentError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        # Its own context: terminating it on close() releases the ports before close() returns,
        # so a "restarted server" can bind them again at once.
        self._ctx = ctx = zmq.Context()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 100)  # a moment for the last batches to leave
        self._router: zmq.Socket | None = None
        try:
            if _binds(endpoint):
                self._pub.bind(endpoint)
                self.endpoint = connectable(self._pub)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._router = ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                # One peer's queue holds one whole replay at most: a peer that asks and
                # never reads cannot grow the server (sends past it fail, see _serve_replay).
                self._router.setsockopt(zmq.SNDHWM, buffer_size + 1)
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._router.bind(replay_endpoint)
                self.replay_endpoint = connectable(self._router)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            ctx.term()
            raise InvalidArgumentError(
                f"cannot open KV-event sockets at {endpoint!r} / {replay_endpoint!r}: {e}"
            ) from e
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if self._router is not None:
            self._thread = threading.Thread(
                target=self._serve_replay, name="kv-event-replay", daemon=True
            )
            self._thread.start()

    def publish(
        self, events: Sequence[KVEvent], *, ts: float | None = None, live: bool = True
    ) -> int:
        """Send one batch of ``events`` and keep it for replay. Returns its seq (0, 1, ...).

        Args:
            ts: the batch's timestamp (default: now, ``time.time()``).
            live: False keeps the batch for replay only, as if the PUB socket had dropped it
                (how tests make a gap).

        Raises:
            InvalidArgumentError: the publisher is closed, or an event is not one of ours or
                has a hash outside unsigned 64 bits.
        """
        if self._closed.is_set():
            raise InvalidArgumentError("the publisher is closed")
        check_events(events)
        batch = KVEventBatch(
            time.time() if ts is None else float(ts), list(events), self.data_parallel_rank
        )
        payload = ENCODER.encode(batch)
        with self._lock:
            seq = self._seq
            if live:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
            self._seq += 1
        return seq

    def close(self) -> None:
        """Stop the replay thread (within a second) and close the sockets (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        with self._lock:
            self._pub.close()
        if self._thread is None or not self._thread.is_alive():
            self._ctx.term()  # waits for the sockets to close (the PUB's linger at most)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVEventPublisher({self.endpoint!r}, replay={self.replay_endpoint!r})"

    def _serve_replay(self) -> None:
        router = self._router
        try:
            while not self._closed.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                # [identity, b"", start seq]: what a DEALER's [b"", seq] looks like here.
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    log.warning("ignored a bad replay request of %d frames", len(frames))
                    continue
                identity, start = frames[0], int.from_bytes(frames[2], "big")
                with self._lock:
                    todo = [(s, p) for s, p in self._buffer if s >= start]
                messages = [[identity, b"", self.topic, s.to_bytes(8, "big"), p] for s, p in todo]
                try:
                    for message in [*messages, [identity, b"", b"", END_SEQ, b""]]:
                        router.send_multipart(message, zmq.NOBLOCK)
                except zmq.ZMQError as e:  # its queue is full (it does not read), or it left
                    log.warning("dropped the rest of a replay to a peer: %s", e)
        finally:
            router.close(linger=0)
