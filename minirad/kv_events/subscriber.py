"""The client of a server's KV-event stream: every batch it can still supply, once, in order."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import zmq

from minirad.errors import InvalidArgumentError, KVEventError
from minirad.kv_events.wire import (
    END_SEQ,
    ENGINE_NAMES,
    SGLANG_LAYOUTS,
    KVEventBatch,
    check_schema,
    decode_message,
)

__all__ = [
    "NOTICE_KINDS",
    "KVEventSubscriber",
    "Item",
    "Notice",
]


log = logging.getLogger(__name__)


def _span(first: int, last: int) -> str:
    return f"batch {first}" if first == last else f"batches {first} to {last}"


NOTICE_KINDS = (
    "connected",
    "no_server",
    "silent",
    "restart",
    "lost",
    "recovered",
    "bad_frame",
    "layout",
)
# Each of these says the server's state changed (it answers again, it stopped answering): a
# second one is news, not a repeat.
_STATE_KINDS = ("connected", "no_server")
_BATCH_NUMBER = re.compile(r"\bbatch \d+")


@dataclass(frozen=True)
class Notice:
    """Something the consumer of a :class:`KVEventSubscriber` should know, delivered in order
    with the batches. ``message`` is a plain sentence for a status line.

    Kinds (:data:`NOTICE_KINDS`):

    - ``"connected"``: the replay endpoint answered (at first, or again after ``"no_server"``).
    - ``"no_server"``: the replay endpoint did not answer in time: no server there, a wrong
      port, or a server started without ``replay_endpoint``. The subscriber keeps listening.
    - ``"silent"``: nothing received yet and no replay endpoint to ask, so an idle server, a
      dead one and a wrong port look the same.
    - ``"restart"``: a new server process, whose cache starts empty (seq went backwards, or
      the replay socket no longer has the last batch delivered). Clear the view; the batches
      that follow, from seq 0, rebuild it.
    - ``"lost"``: batches ``seq ..`` were missed and the replay socket cannot supply them (gone
      from its buffer, no replay endpoint, or it stopped answering): the view may lack blocks
      stored or removed then.
    - ``"recovered"``: batches the live stream missed (or sent before this subscriber joined)
      came through the replay socket; they are delivered in their place.
    - ``"bad_frame"``: a malformed or truncated message was skipped (the :class:`KVEventError`
      text). Later messages skipped for the same fault give no notice of their own (they are
      counted in :attr:`KVEventSubscriber.notice_counts`).
    - ``"layout"``: the layout an SGLang server's events came in, when the first batch with
      events shows it (or when it changes): ``"SGLang 0.5.23 layout: events are tagged maps
      (vLLM's encoding)"`` or the earlier 0.5 arrays
      (:data:`~minirad.kv_events.wire.SGLANG_LAYOUTS`).

    No notice is given twice: apart from ``"connected"`` and ``"no_server"`` (each a change of
    state), a notice with the kind and message of one given since the server (re)started is
    not given again, for instance when a replay probe brings back a bad message already
    reported.

    Attributes:
        seq: the batch the notice is about (the first lost one, the one after a restart...),
            or None.
    """

    kind: str
    message: str
    seq: int | None = None


Item = tuple[int, KVEventBatch] | Notice


@dataclass
class _Held:
    """A live batch that waits for the replay (a gap before it, or a check after a
    reconnect)."""

    batch: KVEventBatch
    digest: int
    arrival: int  # live messages received up to and including this one


@dataclass
class _Exchange:
    """One replay request in flight, on its own DEALER socket."""

    sock: zmq.Socket
    check: tuple[int, int] | None  # (seq, digest) of the last batch delivered: asked for first
    sent_after: int  # live messages received before the request went out
    deadline: float
    replied: bool = False
    recovered: list[int] = field(default_factory=list)  # seqs it delivered


class KVEventSubscriber:
    """Follows a vLLM (or SGLang) server's KV events: every batch the server can still supply,
    exactly once, in seq order, with :class:`Notice` items where something went wrong.

    Args:
        endpoint: the server's PUB socket, e.g. ``"tcp://127.0.0.1:5557"`` (a server configured
            with ``"endpoint": "tcp://*:5557"`` binds it on every interface).
        replay_endpoint: its replay ROUTER socket (``"replay_endpoint"`` of the server's
            config), or None if it has none: then gaps and early batches cannot be recovered,
            a dead server cannot be told from an idle one, and a restart is seen only when
            seq goes backwards.
        topic: the topic prefix to subscribe to (vLLM's default is ``""``).
        schema: ``"vllm"`` or ``"sglang"`` (see :func:`~minirad.kv_events.wire.decode_frames`;
            SGLang's two layouts are told apart batch by batch).
        name: what the notices call the server ("minirad serve answering at ..."); by default
            the schema's engine, ``"vLLM"`` or ``"SGLang"``, since other servers speak their
            wire formats too.
        replay_timeout_s: how long a replay request may stay unanswered before the endpoint is
            reported as not answering.
        probe_interval_s: how often the replay endpoint is asked for what came after the last
            batch delivered (see below).

    How it works. A ZMQ ``connect`` never fails, PUB/SUB drops what a subscriber is not
    connected for, and a SUB reconnects silently, so the replay socket does the checking. On
    creation, and every ``probe_interval_s``, a fresh DEALER asks it for everything from the
    last batch delivered on (from 0 at first):

    - what comes back after that batch is delivered in place (batches sent before we joined,
      or dropped at the end of the live stream);
    - any answer says the server is there; none within ``replay_timeout_s`` says it is not;
    - the first batch of the answer must be the one delivered last, the same bytes (compared
      by hash). If it differs, or the server has nothing that far, it is a new server
      process: a restart, seen even before the new server publishes anything.

    A live batch past a gap waits while the gap is asked for (at most ``replay_timeout_s``
    after the replay stops answering). After the SUB loses its connection (a socket monitor
    tells), live batches wait for the next probe to say whether the server is the same one.
    A live seq below the next expected one is a restart too, unless it is the live copy of a
    batch the replay already delivered. One DEALER per request leaves no stale request queued
    for a server that comes back later (ZMQ's "lazy pirate" pattern). A replayed message whose
    payload cannot be decoded still takes its seq's place (with a ``"bad_frame"`` notice, and
    nothing delivered), so the next probe does not ask for it again.

    Attributes:
        layout: for ``schema="sglang"``, the key in
            :data:`~minirad.kv_events.wire.SGLANG_LAYOUTS` of the layout the server's events
            came in (``"maps"`` for SGLang 0.5.23), once a batch with events has shown it;
            else None.
        notice_counts: ``{(kind, message): times}``: how often each notice arose, the ones not
            given again included (a bad message's number is left out of its message here, so
            one fault that skips many messages counts as one notice).

    Raises:
        InvalidArgumentError: a bad schema, endpoint or timeout.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        schema: Literal["vllm", "sglang"] = "vllm",
        *,
        name: str | None = None,
        replay_timeout_s: float = 1.0,
        probe_interval_s: float = 2.0,
    ) -> None:
        check_schema(schema)
        if not replay_timeout_s > 0 or not probe_interval_s > 0:
            raise InvalidArgumentError("replay_timeout_s and probe_interval_s must be > 0")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        for what, value in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint)):
            if not isinstance(value, str) and (value is not None or what == "endpoint"):
                raise InvalidArgumentError(f"{what} must be a ZMQ address string, got {value!r}")
        self.schema = schema
        self.replay_timeout_s = replay_timeout_s
        self.probe_interval_s = probe_interval_s
        self._name = ENGINE_NAMES[schema] if name is None else name
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        # Batches wait here while a replay fills a gap, or while nobody calls recv().
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._monitor: zmq.Socket | None = None
        try:
            self._sub.connect(endpoint)
            if replay_endpoint is not None:  # check its syntax now, not at the first probe
                self._open_dealer().close()
                self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError as e:
            self._sub.close()
            bad = [e for e in (endpoint, replay_endpoint) if e is not None]
            hint = (
                " (a server's '*' means every interface: connect to tcp://127.0.0.1:PORT)"
                if any("*" in e for e in bad)
                else " (write it as tcp://HOST:PORT)"
            )
            raise InvalidArgumentError(f"bad ZMQ endpoint in {bad}: {e}{hint}") from e
        self._next = 0  # the next seq to deliver
        self._restarted = False  # seq went back at least once (then seq 0 was not "before us")
        self._last: tuple[int, int] | None = None  # (seq, digest) of the last batch delivered
        self._pending: dict[int, _Held] = {}
        self._ahead: dict[int, int] = {}  # replayed seq -> digest, until its live copy comes
        self._live_count = 0
        self._held_since: int | None = None  # live count at a disconnect, until a check passes
        self._exchange: _Exchange | None = None
        self._next_probe_at = time.monotonic()  # ask at once: what did we miss before joining?
        self._answering: bool | None = None
        self._silent_at: float | None = time.monotonic() + probe_interval_s
        self._out: list[Item] = []
        self.layout: str | None = None
        self.notice_counts: dict[tuple[str, str], int] = {}
        self._given: set[tuple[str, str]] = set()  # notices given since the last restart
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public API
    def recv(self, timeout_s: float = 0.1) -> list[Item]:
        """What arrived, waiting up to ``timeout_s`` for something: ``(seq, batch)`` pairs in
        seq order and :class:`Notice` items in their place. Returns an empty list if nothing
        came. Never raises on what the server sends.

        Raises:
            InvalidArgumentError: the subscriber is closed, or runs in its background thread.
        """
        if self._closed.is_set():
            raise InvalidArgumentError("the subscriber is closed")
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise InvalidArgumentError("the subscriber runs in its background thread (start())")
        return self._recv(timeout_s)

    def start(self, on_item: Callable[[Item], None], poll_s: float = 0.1) -> None:
        """Deliver items to ``on_item`` from a background thread until :meth:`close` (which
        stops it within a second). ``on_item`` runs in that thread; an exception in it is
        logged and the thread goes on.

        Raises:
            InvalidArgumentError: already started, closed, or ``poll_s`` outside (0, 0.5].
        """
        if self._closed.is_set() or self._thread is not None:
            raise InvalidArgumentError("the subscriber is closed or already started")
        if not 0 < poll_s <= 0.5:
            raise InvalidArgumentError(f"poll_s must be in (0, 0.5], got {poll_s}")

        def run() -> None:
            try:
                while not self._closed.is_set():
                    for item in self._recv(poll_s):
                        try:
                            on_item(item)
                        except Exception:
                            log.exception("KV-event callback failed on %r", item)
            finally:
                self._close_sockets()

        self._thread = threading.Thread(target=run, name="kv-event-subscriber", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the background thread if any and close the sockets (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # the thread closes the sockets on its way out
        else:
            self._close_sockets()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"KVEventSubscriber({self.endpoint!r}, replay={self.replay_endpoint!r}, "
            f"schema={self.schema!r}, next_seq={self._next})"
        )

    # ------------------------------------------------------------------ the loop
    def _recv(self, timeout_s: float) -> list[Item]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            now = time.monotonic()
            self._tick(now)
            poller = zmq.Poller()
            poller.register(self._sub, zmq.POLLIN)
            if self._monitor is not None:
                poller.register(self._monitor, zmq.POLLIN)
            if self._exchange is not None:
                poller.register(self._exchange.sock, zmq.POLLIN)
            wake = min(deadline, self._wake_time())
            ready = dict(poller.poll(max(0.0, wake - now) * 1000))
            if self._monitor in ready:
                self._drain_monitor()
            if self._exchange is not None and self._exchange.sock in ready:
                self._drain_replay()
            if self._sub in ready:
                self._drain_live()
            if self._out or time.monotonic() >= deadline:
                out, self._out = self._out, []
                return out

    def _wake_time(self) -> float:
        if self._exchange is not None:
            return self._exchange.deadline
        if self.replay_endpoint is not None:
            return self._next_probe_at
        return self._silent_at if self._silent_at is not None else float("inf")

    def _tick(self, now: float) -> None:
        """Timeouts and probes that are due."""
        ex = self._exchange
        if ex is not None and now >= ex.deadline:
            self._finish_exchange(complete=False)
        if self.replay_endpoint is None:
            if self._silent_at is not None and now >= self._silent_at:
                self._silent_at = None
                self._notice(
                    "silent",
                    f"nothing received from {self.endpoint} yet, and without a replay endpoint "
                    f"an idle {self._name}, a dead one and a wrong port look the same; still "
                    "listening",
                )
        elif self._exchange is None and now >= self._next_probe_at:
            self._ask_replay()

    def _notice(self, kind: str, message: str, seq: int | None = None) -> None:
        """Give a notice, unless the same one was given since the server (re)started."""
        key = (kind, _BATCH_NUMBER.sub("batch N", message) if kind == "bad_frame" else message)
        self.notice_counts[key] = self.notice_counts.get(key, 0) + 1
        if kind not in _STATE_KINDS:
            if key in self._given:
                return
            self._given.add(key)
        self._out.append(Notice(kind, message, seq))

    def _decode(self, frames: list[bytes]) -> tuple[int, KVEventBatch | None] | None:
        """``(seq, batch)`` of a message; ``(seq, None)`` for one whose payload cannot be
        decoded, None without a readable seq. Says which layout an SGLang server speaks the
        first time a batch shows it."""
        try:
            seq, _, batch, layout = decode_message(frames, self.schema)
        except KVEventError as e:
            self._notice(
                "bad_frame",
                f"skipped a bad message from {self._name}: {e} (later messages with this fault "
                "are skipped without another notice)",
            )
            seq_frame = frames[1] if len(frames) == 3 else b""
            if isinstance(seq_frame, bytes) and len(seq_frame) == 8 and seq_frame != END_SEQ:
                return int.from_bytes(seq_frame, "big"), None
            return None
        if layout is not None and layout != self.layout:
            self.layout = layout
            self._notice("layout", f"{SGLANG_LAYOUTS[layout]}, at {self.endpoint}")
        return seq, batch

    def _drain_monitor(self) -> None:
        """The SUB lost its server: whatever it reconnects to may be a new process, so hold
        live batches until a probe has checked."""
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if self._last is not None and self._held_since is None:
                self._held_since = self._live_count

    def _restart(self, message: str, seq: int) -> None:
        """A new server process: say so, and start again from its seq 0."""
        self._notice("restart", message, seq)
        self._given.clear()  # a new server: its notices are news
        self._next = 0
        self._restarted = True
        self._last = None
        self._ahead.clear()
        held_since, self._held_since = self._held_since, None
        # Live batches that arrived since the disconnect are the new server's: keep them.
        self._pending = {
            s: h
            for s, h in self._pending.items()
            if held_since is not None and h.arrival > held_since
        }
        if self._exchange is not None:  # it asked the old server, or for the old seqs
            self._exchange.sock.close(linger=0)
            self._exchange = None

    # ------------------------------------------------------------------ live stream
    def _drain_live(self) -> None:
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._silent_at = None
            decoded = self._decode(frames)
            # A bad live message is only skipped: anything can send it. The replay socket,
            # asked about the gap it leaves, says whether the server sent it.
            if decoded is not None and decoded[1] is not None:
                self._on_live(*decoded, hash(frames[2]))

    def _on_live(self, seq: int, batch: KVEventBatch, digest: int) -> None:
        self._live_count += 1
        if seq < self._next:
            if self._ahead.get(seq) == digest:  # the live copy of a replayed batch
                self._prune_ahead(seq)
                return
            self._restart(
                f"{self._name} restarted: batch {seq} came after batch {self._next - 1} (seq "
                "starts again at 0 in a new server process, whose cache is empty), so the view "
                "starts again",
                seq,
            )
        self._prune_ahead(seq)
        if seq == self._next and self._held_since is None:
            self._deliver(seq, batch, digest)
        elif self.replay_endpoint is None:
            joined = self._next == 0 and not self._restarted
            why = "sent before this subscriber connected" if joined else "dropped"
            self._lost(seq, f"{why}, and there is no replay endpoint to ask for them")
            self._deliver(seq, batch, digest)
        else:
            self._pending[seq] = _Held(batch, digest, self._live_count)
            if self._exchange is None:
                self._ask_replay()

    def _prune_ahead(self, seq: int) -> None:
        if self._ahead:
            for s in [s for s in self._ahead if s <= seq]:
                del self._ahead[s]

    def _deliver(self, seq: int, batch: KVEventBatch | None, digest: int) -> None:
        if batch is not None:
            self._out.append((seq, batch))
        self._next = seq + 1
        self._last = (seq, digest)
        self._flush()

    def _flush(self) -> None:
        """Deliver the held batches that are next in line (unless a check is due)."""
        while self._held_since is None and self._next in self._pending:
            held = self._pending.pop(self._next)
            self._out.append((self._next, held.batch))
            self._last = (self._next, held.digest)
            self._next += 1

    def _lost(self, upto: int, why: str) -> None:
        """Batches ``_next .. upto - 1`` will never come: say so and move on."""
        self._notice(
            "lost",
            f"{_span(self._next, upto - 1)} missed ({why}): the view may lack blocks stored or "
            "removed then",
            self._next,
        )
        self._next = upto

    # ------------------------------------------------------------------ replay socket
    def _open_dealer(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # a replay of the whole buffer must not be cut short
        try:
            sock.connect(self.replay_endpoint)
        except zmq.ZMQError:
            sock.close()
            raise
        return sock

    def _ask_replay(self) -> None:
        """Ask for every batch from the last one delivered (DEALER, ``[b"", seq]``)."""
        start = self._last[0] if self._last is not None else self._next
        sock = self._open_dealer()
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            pass  # no pipe to queue on: the exchange times out like an unanswered one
        deadline = time.monotonic() + self.replay_timeout_s
        self._exchange = _Exchange(sock, self._last, self._live_count, deadline)

    def _drain_replay(self) -> None:
        ex = self._exchange
        while ex is self._exchange:
            try:
                frames = ex.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ex.replied = True
            ex.deadline = time.monotonic() + self.replay_timeout_s  # inactivity, not total
            # vLLM and SGLang 0.5.23: [b"", topic, seq, payload]; earlier SGLang 0.5:
            # [b"", seq, payload] (no topic frame).
            if len(frames) not in (3, 4) or frames[0] != b"":
                self._notice(
                    "bad_frame",
                    f"skipped a bad reply from the replay socket {self.replay_endpoint} "
                    f"({len(frames)} frames)",
                )
                continue
            body = frames[1:] if len(frames) == 4 else [b"", *frames[1:]]
            if body[1] == END_SEQ:
                self._finish_exchange(complete=True)
                return
            decoded = self._decode(body)
            if decoded is None:
                continue
            seq, batch = decoded
            digest = hash(body[2])
            if ex.check is not None:
                check, ex.check = ex.check, None
                if seq == check[0] and digest != check[1]:
                    self._restarted_under(check[0])
                    return
                self._held_since = None  # the same server (or one we cannot tell apart)
                self._flush()
            if seq < self._next:
                continue  # delivered already
            if seq > self._next:
                self._lost(seq, "no longer in the server's replay buffer")
            self._ahead[seq] = digest
            self._pending.pop(seq, None)
            if batch is not None:  # a bad one takes its place, but is not recovered
                ex.recovered.append(seq)
            self._deliver(seq, batch, digest)

    def _restarted_under(self, seq: int) -> None:
        """The replay socket does not have batch ``seq`` as we got it: a new server there."""
        self._restart(
            f"{self._name} restarted: the server at {self.replay_endpoint} no longer has batch "
            f"{seq} as it sent it before (a new server process starts again at seq 0, with an "
            "empty cache), so the view starts again",
            0,
        )
        self._ask_replay()  # from 0: what the new server published already

    def _finish_exchange(self, complete: bool) -> None:
        ex = self._exchange
        ex.sock.close(linger=0)
        self._exchange = None
        self._next_probe_at = time.monotonic() + self.probe_interval_s
        if ex.recovered:
            self._notice(
                "recovered",
                f"recovered {_span(ex.recovered[0], ex.recovered[-1])} through the replay "
                "socket (missed by the live stream, or sent before this subscriber joined)",
                ex.recovered[0],
            )
        if ex.replied and self._answering is not True:
            self._answering = True
            self._notice("connected", f"{self._name} answering at {self.replay_endpoint}")
        elif not ex.replied and self._answering is not False:
            self._answering = False
            self._notice(
                "no_server",
                f"no {self._name} answering at {self.replay_endpoint} (no reply to a replay "
                f"request within {self.replay_timeout_s:g} s): not started yet, stopped, or a "
                f"wrong port; still listening on {self.endpoint}",
            )
        if complete and ex.check is not None:
            # Nothing at or after a batch this server sent us: it is not that server any more.
            self._restarted_under(ex.check[0])
            return
        if not complete and self._held_since is not None and self._pending:
            self._held_since = None  # no check possible: do not hold live batches forever
        if not self._pending or min(self._pending) <= self._next:
            self._flush()
            return
        first = min(self._pending)
        if not complete:
            self._lost(first, "the replay socket did not answer")
        elif self._pending[first].arrival <= ex.sent_after:
            # The server had published `first` before it read our request, so it would have
            # sent the batches before it, had it still held them.
            self._lost(first, "no longer in the server's replay buffer")
        else:  # `first` arrived after we asked: the gap may be newer than the request
            self._ask_replay()
            return
        self._flush()

    def _close_sockets(self) -> None:
        if self._exchange is not None:
            self._exchange.sock.close(linger=0)
            self._exchange = None
        if self._monitor is not None:
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
        self._sub.close(linger=0)
