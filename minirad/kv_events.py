"""vLLM's KV-cache events on the wire: the message format, a subscriber, a publisher, recordings.

A vLLM server started with ``--kv-events-config`` (or an offline ``LLM(kv_events_config=...)``)
tells the world what its prefix cache does, as ZMQ messages of three frames::

    [topic, seq (8 bytes, big-endian unsigned), payload]
    payload = msgpack [ts, events, data_parallel_rank]      (KVEventBatch, an array)
    event   = msgpack map {"type": "BlockStored", "block_hashes": [...], ...}

``seq`` counts batches from 0 in each server process. A *replay* ROUTER socket, if the server
has one, resends what it still holds: a DEALER sends ``[b"", start_seq (8 bytes)]`` and gets one
``[b"", topic, seq, payload]`` per batch with ``seq >= start_seq``, then the end marker
``[b"", b"", -1 (8 bytes, signed), b""]``. SGLang publishes the same envelope with its own
schema (``schema="sglang"``): events are arrays ``[tag, fields...]``, hashes are signed 64-bit,
the batch's rank is ``attn_dp_rank``, and replay replies carry no topic frame.

This module is the client side of that protocol, without importing vLLM (it cannot live in the
course venv, and its import takes seconds): msgspec structs named as vLLM 0.32 names them
(``vllm/distributed/kv_events.py``), :func:`decode_frames` / :func:`encode_batch`, a
:class:`KVEventSubscriber` that delivers every batch the server can still supply exactly once
and in order, a :class:`KVEventPublisher` that speaks the server side (our engine publishes
through it; tests use it as a server they control), and JSON-lines recordings.

Block hashes are unsigned 64-bit integers, most of them above 2**53: never hand them to
JavaScript as JSON numbers (recordings write them as hex strings).

Example::

    with KVEventSubscriber("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558") as sub:
        for item in sub.recv(timeout_s=1.0):
            if isinstance(item, Notice):
                print(item.message)         # restart, lost batches, no server answering...
            else:
                seq, batch = item
                for event in batch.events:  # BlockStored | BlockRemoved | AllBlocksCleared
                    ...
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import zmq

from .errors import InvalidArgumentError, KVEventError

__all__ = [
    "END_SEQ",
    "NOTICE_KINDS",
    "SCHEMAS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventSubscriber",
    "Item",
    "Notice",
    "batch_from_json",
    "batch_to_json",
    "decode_frames",
    "encode_batch",
    "load_recording",
    "save_recording",
]

log = logging.getLogger(__name__)

SCHEMAS = ("vllm", "sglang")
_ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
_U64 = (1 << 64) - 1
# The replay socket's end-of-stream marker: seq -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ---------------------------------------------------------------------------------- the structs
# vLLM's wire format, lenient: fields unknown here (newer vLLMs add locality, ownership,
# session_id...) are ignored, and every field after block_size may be missing. Events are maps
# tagged by "type" with the class name, the batch an array, as vLLM's msgspec structs encode them.
class BlockStored(msgspec.Struct, tag=True):
    """Blocks that entered the prefix cache, in chain order: block ``i`` extends block
    ``i - 1``, and block 0 extends ``parent_block_hash`` (None: the start of a prompt).

    Attributes:
        block_hashes: one unsigned 64-bit hash per block (vLLM's chained block hash).
        parent_block_hash: the hash of the block before the first one, or None.
        token_ids: the tokens of all the blocks, concatenated (``block_size`` per block);
            image positions hold the image placeholder id: images are told apart by the
            hashes and ``extra_keys``, not by these ids.
        block_size: tokens per block.
        lora_id, lora_name: the LoRA adapter the KV belongs to (None: the base model).
        medium: where the blocks live ("GPU" for vLLM's device cache, also on its CPU backend;
            SGLang: "GPU", "CPU_PINNED", "DISK", "EXTERNAL").
        extra_keys: one entry per block, what else went into its hash besides the tokens:
            ``[(mm_hash_hex, offset of the image's first token from the block's start), ...]``
            for the images the block overlaps (the offset is negative when the image began in
            an earlier block), or None.
        group_idx, kv_cache_spec_kind: the KV-cache group the blocks belong to (one group,
            ``"full_attention"``, for our models).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    """Blocks that left the prefix cache (evicted to make room), by hash."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    """The whole prefix cache was dropped (vLLM's ``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    """The events of one engine step, as one message.

    Attributes:
        ts: the publisher's wall clock when the batch was made (seconds since the epoch).
        events: in the order the cache changed.
        data_parallel_rank: which data-parallel replica's cache they describe (vLLM stamps 0
            without data parallelism; SGLang's ``attn_dp_rank``).
    """

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# SGLang 0.5's schema (python/sglang/srt/disaggregation/kv_events.py): array-like tagged events,
# fields in this order, trailing defaults possibly omitted; extra trailing items (its
# BlockStoredWithMetadata appends a metadata map) are ignored.
class _SGLangBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _SGLangBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SGLangAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _SGLangBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_SGLangBlockStored | _SGLangBlockRemoved | _SGLangAllBlocksCleared]
    attn_dp_rank: int | None = None


_DECODERS = {
    "vllm": msgspec.msgpack.Decoder(KVEventBatch),
    "sglang": msgspec.msgpack.Decoder(_SGLangBatch),
}
_ENCODER = msgspec.msgpack.Encoder()


def _unsigned(h: int | None) -> int | None:
    """A 64-bit hash as unsigned: SGLang's signed ones then compare equal to vLLM's."""
    return None if h is None else h & _U64


def _from_sglang(batch: _SGLangBatch) -> KVEventBatch:
    events: list[KVEvent] = []
    for e in batch.events:
        if isinstance(e, _SGLangBlockStored):
            events.append(
                BlockStored(
                    block_hashes=[h & _U64 for h in e.block_hashes],
                    parent_block_hash=_unsigned(e.parent_block_hash),
                    token_ids=e.token_ids,
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=e.medium,
                )
            )
        elif isinstance(e, _SGLangBlockRemoved):
            events.append(BlockRemoved([h & _U64 for h in e.block_hashes], medium=e.medium))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(batch.ts, events, batch.attn_dp_rank)


# ------------------------------------------------------------------------------------ the frames
def _check_schema(schema: str) -> None:
    if schema not in SCHEMAS:
        raise InvalidArgumentError(f"schema must be one of {SCHEMAS}, got {schema!r}")


def _payload_hint(schema: str, payload: bytes, error: str) -> str:
    """Why a payload that is valid msgpack is not a batch, when we can tell."""
    other = "sglang" if schema == "vllm" else "vllm"
    try:
        _DECODERS[other].decode(payload)
    except msgspec.DecodeError:
        pass
    else:
        return f" (it decodes with schema={other!r}: is the publisher {_ENGINE_NAMES[other]}?)"
    if "got `bytes`" in error:
        return (
            " (vLLM sends hashes as bytes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; its "
            "default, 1, sends 64-bit integers)"
        )
    return ""


def decode_frames(
    frames: Sequence[bytes], schema: Literal["vllm", "sglang"] = "vllm"
) -> tuple[int, bytes, KVEventBatch]:
    """One message of the event stream, ``[topic, seq, payload]``, as ``(seq, topic, batch)``.

    SGLang batches (``schema="sglang"``) come back in vLLM's structs: hashes made unsigned,
    ``attn_dp_rank`` as ``data_parallel_rank``.

    Raises:
        KVEventError: not three frames, a seq frame that is not 8 bytes, a payload that is not
            msgpack (garbage, truncated), or msgpack that is not a KVEventBatch of ``schema``.
        InvalidArgumentError: an unknown ``schema``.
    """
    _check_schema(schema)
    if len(frames) != 3:
        raise KVEventError(
            f"a KV-event message has 3 frames (topic, seq, payload), this one has {len(frames)}"
        )
    if not all(isinstance(f, bytes | bytearray | memoryview) for f in frames):
        raise KVEventError("KV-event frames must be bytes")
    topic, seq_bytes, payload = (bytes(f) for f in frames)
    if len(seq_bytes) != 8:
        raise KVEventError(f"the seq frame must be 8 bytes (big-endian), got {len(seq_bytes)}")
    seq = int.from_bytes(seq_bytes, "big")
    try:
        raw = _DECODERS[schema].decode(payload)
    except msgspec.ValidationError as e:
        raise KVEventError(
            f"batch {seq} is msgpack but not a {_ENGINE_NAMES[schema]} KVEventBatch: "
            f"{e}{_payload_hint(schema, payload, str(e))}"
        ) from e
    except msgspec.DecodeError as e:
        raise KVEventError(f"batch {seq} is not valid msgpack (garbage or truncated): {e}") from e
    if schema == "sglang":
        return seq, topic, _from_sglang(raw)
    for event in raw.events:  # vLLM's are unsigned already; keep one invariant for both
        if not isinstance(event, AllBlocksCleared):
            event.block_hashes = [h & _U64 for h in event.block_hashes]
        if isinstance(event, BlockStored):
            event.parent_block_hash = _unsigned(event.parent_block_hash)
    return seq, topic, raw


def encode_batch(seq: int, batch: KVEventBatch, topic: bytes = b"") -> list[bytes]:
    """The message ``[topic, seq, payload]`` of one batch, in vLLM's format (the inverse of
    :func:`decode_frames` with ``schema="vllm"``).

    Every field is written, None included, so vLLM's own decoder (whose ``lora_id``, ``medium``
    and ``lora_name`` have no defaults) reads it.

    Raises:
        InvalidArgumentError: ``seq`` outside ``0 .. 2**64 - 2``, a hash outside unsigned
            64 bits, or something that is not a KVEventBatch of our events.
    """
    if not isinstance(seq, int) or not 0 <= seq < _U64:
        raise InvalidArgumentError(f"seq must be an int in 0 .. 2**64 - 2, got {seq!r}")
    if not isinstance(batch, KVEventBatch):
        raise InvalidArgumentError(f"expected a KVEventBatch, got {type(batch).__name__}")
    _check_events(batch.events)
    return [bytes(topic), seq.to_bytes(8, "big"), _ENCODER.encode(batch)]


def _check_events(events: Sequence[Any]) -> None:
    for event in events:
        if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
            raise InvalidArgumentError(
                "events must be BlockStored, BlockRemoved or AllBlocksCleared, "
                f"got {type(event).__name__}"
            )
        hashes = [] if isinstance(event, AllBlocksCleared) else list(event.block_hashes)
        if isinstance(event, BlockStored) and event.parent_block_hash is not None:
            hashes.append(event.parent_block_hash)
        for h in hashes:
            if not isinstance(h, int) or not 0 <= h <= _U64:
                raise InvalidArgumentError(
                    f"block hashes are unsigned 64-bit ints (mask with 2**64 - 1), got {h!r}"
                )


def _connectable(sock: zmq.Socket) -> str:
    """Where a peer connects to reach a bound socket: its real port, 127.0.0.1 for a wildcard
    host."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT).replace("0.0.0.0", "127.0.0.1")


def _span(first: int, last: int) -> str:
    return f"batch {first}" if first == last else f"batches {first} to {last}"


# ---------------------------------------------------------------------------------- subscriber
NOTICE_KINDS = ("connected", "no_server", "silent", "restart", "lost", "recovered", "bad_frame")


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
      text).

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
        schema: ``"vllm"`` or ``"sglang"`` (see :func:`decode_frames`).
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
    for a server that comes back later (ZMQ's "lazy pirate" pattern).

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
        _check_schema(schema)
        if not replay_timeout_s > 0 or not probe_interval_s > 0:
            raise InvalidArgumentError("replay_timeout_s and probe_interval_s must be > 0")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.schema = schema
        self.replay_timeout_s = replay_timeout_s
        self.probe_interval_s = probe_interval_s
        self._name = _ENGINE_NAMES[schema] if name is None else name
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
        self._out.append(Notice(kind, message, seq))

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
            try:
                seq, _, batch = decode_frames(frames, self.schema)
            except KVEventError as e:
                self._notice("bad_frame", f"skipped a bad message from {self.endpoint}: {e}")
                continue
            self._on_live(seq, batch, hash(frames[2]))

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

    def _deliver(self, seq: int, batch: KVEventBatch, digest: int) -> None:
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
            # vLLM: [b"", topic, seq, payload]; SGLang: [b"", seq, payload] (no topic frame).
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
            try:
                seq, _, batch = decode_frames(body, self.schema)
            except KVEventError as e:
                self._notice("bad_frame", f"skipped a bad replayed message: {e}")
                continue
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


# ---------------------------------------------------------------------------------- publisher
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
                self.endpoint = _connectable(self._pub)
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
                self.replay_endpoint = _connectable(self._router)
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
        _check_events(events)
        batch = KVEventBatch(
            time.time() if ts is None else float(ts), list(events), self.data_parallel_rank
        )
        payload = _ENCODER.encode(batch)
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


# ---------------------------------------------------------------------------------- recordings
def _event_to_json(event: KVEvent) -> dict:
    """A JSON-ready dict: hashes as 16-digit hex strings, optional fields left out when None."""
    d: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if name == "block_hashes":
            value = [f"{h:016x}" for h in value]
        elif name == "parent_block_hash":
            d[name] = None if value is None else f"{value:016x}"
            continue
        if value is not None:
            d[name] = value
    return d


def _hash_from_json(value: Any) -> int:
    if not isinstance(value, str):
        raise ValueError(f"a block hash must be a hex string, got {value!r}")
    h = int(value, 16)
    if not 0 <= h <= _U64:
        raise ValueError(f"block hash {value!r} does not fit 64 bits")
    return h


def _event_from_json(d: Any) -> KVEvent:
    if not isinstance(d, dict):
        raise ValueError(f"an event must be an object, got {d!r}")
    d = dict(d)
    if "block_hashes" in d:
        if not isinstance(d["block_hashes"], list):
            raise ValueError("block_hashes must be a list")
        d["block_hashes"] = [_hash_from_json(h) for h in d["block_hashes"]]
    if d.get("parent_block_hash") is not None:
        d["parent_block_hash"] = _hash_from_json(d["parent_block_hash"])
    return msgspec.convert(d, KVEvent)


def batch_to_json(seq: int, batch: KVEventBatch) -> dict:
    """One recorded batch as a JSON-ready dict (a line of :func:`save_recording`)::

        {"seq": 0, "ts": 1712.5, "data_parallel_rank": 0, "events": [{"type": "BlockStored",
         "block_hashes": ["96b1e2f0c3a4d5e6", ...], "parent_block_hash": null, ...}]}

    Hashes are 16-digit hex strings (JSON numbers lose precision above 2**53); fields that are
    None are left out, except ``parent_block_hash``. ``ts`` is kept but nothing needs it to
    replay.

    Raises:
        InvalidArgumentError: ``batch`` is not a :class:`KVEventBatch`.
    """
    if not isinstance(batch, KVEventBatch):
        raise InvalidArgumentError(f"expected a KVEventBatch, got {batch!r}")
    line = {"seq": int(seq), "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank}
    line["events"] = [_event_to_json(e) for e in batch.events]
    return line


def batch_from_json(line: dict) -> tuple[int, KVEventBatch]:
    """The ``(seq, batch)`` of a dict made by :func:`batch_to_json` (extra keys are ignored).

    Raises:
        KVEventError: not a recorded batch (the message says what is wrong).
    """
    try:
        seq = line["seq"]
        if not isinstance(seq, int) or seq < 0:
            raise ValueError(f"seq must be an int >= 0, got {seq!r}")
        events = [_event_from_json(e) for e in line["events"]]
        return seq, KVEventBatch(float(line["ts"]), events, line.get("data_parallel_rank"))
    except (ValueError, KeyError, TypeError, msgspec.ValidationError) as e:
        raise KVEventError(f"not a recorded KV-event batch: {e}") from e


def save_recording(batches: Iterable[tuple[int, KVEventBatch]], path: str | os.PathLike) -> Path:
    """Write ``(seq, batch)`` pairs as JSON lines, one batch a line (:func:`batch_to_json`).
    The same batches give the same bytes. Returns the path.

    Raises:
        InvalidArgumentError: an item is not a ``(seq, KVEventBatch)`` pair.
    """
    lines = []
    for item in batches:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], KVEventBatch)):
            raise InvalidArgumentError(f"expected (seq, KVEventBatch) pairs, got {item!r}")
        lines.append(json.dumps(batch_to_json(*item)) + "\n")
    path = Path(path)
    path.write_text("".join(lines))
    return path


def load_recording(path: str | os.PathLike) -> list[tuple[int, KVEventBatch]]:
    """Read a file written by :func:`save_recording`.

    Raises:
        KVEventError: no readable text file there, or a line that is not a recorded batch
            (the message gives its number).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KVEventError(f"cannot read a KV-event recording at {path}: {e}") from e
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise KVEventError(f"{path}:{lineno}: not a recorded KV-event batch: {e}") from e
        try:
            out.append(batch_from_json(d))
        except KVEventError as e:
            raise KVEventError(f"{path}:{lineno}: {e}") from e
    return out
