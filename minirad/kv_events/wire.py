"""vLLM's KV-cache events on the wire: the msgspec structs and the ZMQ frames that carry them.

A vLLM server started with ``--kv-events-config`` (or an offline ``LLM(kv_events_config=...)``)
tells the world what its prefix cache does, as ZMQ messages of three frames::

    [topic, seq (8 bytes, big-endian unsigned), payload]
    payload = msgpack [ts, events, data_parallel_rank]      (KVEventBatch, an array)
    event   = msgpack map {"type": "BlockStored", "block_hashes": [...], ...}

``seq`` counts batches from 0 in each server process. SGLang publishes the same envelope
(``schema="sglang"``; the batch's rank is its ``attn_dp_rank``, hashes are signed 64-bit), its
events in one of two layouts (:data:`SGLANG_LAYOUTS`), told apart batch by batch:

- ``"maps"``, SGLang 0.5.23: tagged maps ``{"type": "BlockStored", "block_hashes": [...], ...}``,
  vLLM's own encoding, optional fields left out when None (``medium``, ``cache_salt``,
  ``session_id``, ``lora_name``); replay replies carry the topic frame, as vLLM's do;
- ``"arrays"``, earlier SGLang 0.5 releases: tagged arrays ``["BlockStored", hashes, parent,
  tokens, block_size, lora_id, (medium)]``; replay replies carry no topic frame.

The structs are named as vLLM 0.32 names them (``vllm/distributed/kv_events.py``), without
importing vLLM (it cannot live in the course venv, and its import takes seconds).

Block hashes are unsigned 64-bit integers, most of them above 2**53: never hand them to
JavaScript as JSON numbers (recordings write them as hex strings).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import msgspec
import zmq

from minirad.errors import InvalidArgumentError, KVEventError

__all__ = [
    "END_SEQ",
    "SCHEMAS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "Message",
    "SGLANG_LAYOUTS",
    "decode_frames",
    "decode_message",
    "encode_batch",
]

log = logging.getLogger(__name__)

SCHEMAS = ("vllm", "sglang")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
U64_MAX = (1 << 64) - 1
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


# SGLang's layouts (python/sglang/srt/disaggregation/kv_events.py), by what its events look like.
SGLANG_LAYOUTS = {
    "maps": "SGLang 0.5.23 layout: events are tagged maps (vLLM's encoding)",
    "arrays": "earlier SGLang 0.5 layout: events are tagged arrays",
}

# Token ids: an int per position, or (EAGLE's bigram keys) [token, next token]: the first is it.
_Tokens = list[int | list[int]]


# SGLang 0.5.23: maps tagged by "type", fields by name; a field left at None is left out, and
# fields unknown here (cache_salt, session_id, newer ones) are ignored.
class _SGLangMapStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: _Tokens
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class _SGLangMapRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SGLangMapCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _SGLangMapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_SGLangMapStored | _SGLangMapRemoved | _SGLangMapCleared]
    attn_dp_rank: int | None = None


# Earlier SGLang 0.5 releases: array-like tagged events, fields in this order, trailing defaults
# possibly omitted; extra trailing items (its BlockStoredWithMetadata appends a metadata map)
# are ignored.
class _SGLangBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: _Tokens
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


_VLLM_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
# Tried in this order: the current layout first.
_SGLANG_DECODERS = {
    "maps": msgspec.msgpack.Decoder(_SGLangMapBatch),
    "arrays": msgspec.msgpack.Decoder(_SGLangBatch),
}
ENCODER = msgspec.msgpack.Encoder()


def _unsigned(h: int | None) -> int | None:
    """A 64-bit hash as unsigned: SGLang's signed ones then compare equal to vLLM's."""
    return None if h is None else h & U64_MAX


def _token(t: int | list[int]) -> int:
    return t if isinstance(t, int) else (t[0] if t else 0)


def _from_sglang(batch: _SGLangMapBatch | _SGLangBatch) -> KVEventBatch:
    events: list[KVEvent] = []
    for e in batch.events:
        if isinstance(e, _SGLangMapStored | _SGLangBlockStored):
            events.append(
                BlockStored(
                    block_hashes=[h & U64_MAX for h in e.block_hashes],
                    parent_block_hash=_unsigned(e.parent_block_hash),
                    token_ids=[_token(t) for t in e.token_ids],
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=e.medium,
                    lora_name=getattr(e, "lora_name", None),
                    extra_keys=getattr(e, "extra_keys", None),
                )
            )
        elif isinstance(e, _SGLangMapRemoved | _SGLangBlockRemoved):
            events.append(BlockRemoved([h & U64_MAX for h in e.block_hashes], medium=e.medium))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(batch.ts, events, batch.attn_dp_rank)


# ------------------------------------------------------------------------------------ the frames
def check_schema(schema: str) -> None:
    if schema not in SCHEMAS:
        raise InvalidArgumentError(f"schema must be one of {SCHEMAS}, got {schema!r}")


def _payload_hint(schema: str, payload: bytes, error: str) -> str:
    """Why a payload that is valid msgpack is not a batch, when we can tell. (A vLLM batch is
    always an SGLang one too: SGLang 0.5.23 publishes vLLM's encoding.)"""
    if schema == "vllm":
        try:
            _SGLANG_DECODERS["arrays"].decode(payload)
        except msgspec.DecodeError:
            pass
        else:
            return (
                " (it decodes with schema='sglang': is the publisher SGLang? "
                f"{SGLANG_LAYOUTS['arrays']})"
            )
    if "got `bytes`" in error:
        return (
            " (vLLM sends hashes as bytes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; its "
            "default, 1, sends 64-bit integers)"
        )
    return ""


class Message(NamedTuple):
    """One decoded message of the event stream (:func:`decode_message`).

    Attributes:
        seq, topic, batch: as :func:`decode_frames` returns them.
        layout: the key in :data:`SGLANG_LAYOUTS` of the layout an SGLang batch came in, or
            None: a vLLM batch (it has one layout), or an SGLang batch without events (it
            reads the same in both).
    """

    seq: int
    topic: bytes
    batch: KVEventBatch
    layout: str | None = None


def _decode_sglang(seq: int, payload: bytes) -> tuple[KVEventBatch, str | None]:
    errors = []
    for layout, decoder in _SGLANG_DECODERS.items():
        try:
            raw = decoder.decode(payload)
        except msgspec.ValidationError as e:
            errors.append(f"as {layout}: {e}")
            continue
        return _from_sglang(raw), layout if raw.events else None
    error = "; ".join(errors)
    raise KVEventError(
        f"batch {seq} is msgpack but not an SGLang KVEventBatch in either layout "
        f"(tagged maps or tagged arrays): {error}{_payload_hint('sglang', payload, error)}"
    )


def decode_message(frames: Sequence[bytes], schema: Literal["vllm", "sglang"] = "vllm") -> Message:
    """:func:`decode_frames`, and for SGLang the layout its events came in
    (:attr:`Message.layout`): tagged maps (0.5.23) or tagged arrays (earlier 0.5), whichever
    the payload is.

    Raises:
        KVEventError, InvalidArgumentError: as :func:`decode_frames`.
    """
    check_schema(schema)
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
        if schema == "sglang":
            batch, layout = _decode_sglang(seq, payload)
            return Message(seq, topic, batch, layout)
        raw = _VLLM_DECODER.decode(payload)
    except msgspec.ValidationError as e:
        raise KVEventError(
            f"batch {seq} is msgpack but not a {ENGINE_NAMES[schema]} KVEventBatch: "
            f"{e}{_payload_hint(schema, payload, str(e))}"
        ) from e
    except msgspec.DecodeError as e:
        raise KVEventError(f"batch {seq} is not valid msgpack (garbage or truncated): {e}") from e
    for event in raw.events:  # vLLM's are unsigned already; keep one invariant for both
        if not isinstance(event, AllBlocksCleared):
            event.block_hashes = [h & U64_MAX for h in event.block_hashes]
        if isinstance(event, BlockStored):
            event.parent_block_hash = _unsigned(event.parent_block_hash)
    return Message(seq, topic, raw)


def decode_frames(
    frames: Sequence[bytes], schema: Literal["vllm", "sglang"] = "vllm"
) -> tuple[int, bytes, KVEventBatch]:
    """One message of the event stream, ``[topic, seq, payload]``, as ``(seq, topic, batch)``.

    SGLang batches (``schema="sglang"``) come back in vLLM's structs, whichever of its layouts
    they came in (:data:`SGLANG_LAYOUTS`; :func:`decode_message` says which): hashes made
    unsigned, ``attn_dp_rank`` as ``data_parallel_rank``, fields vLLM's structs lack
    (``cache_salt``, ``session_id``, a metadata map) dropped. A vLLM batch decodes with
    ``schema="sglang"`` too: SGLang 0.5.23 publishes vLLM's encoding.

    Raises:
        KVEventError: not three frames, a seq frame that is not 8 bytes, a payload that is not
            msgpack (garbage, truncated), or msgpack that is not a KVEventBatch of ``schema``.
        InvalidArgumentError: an unknown ``schema``.
    """
    return decode_message(frames, schema)[:3]


def encode_batch(seq: int, batch: KVEventBatch, topic: bytes = b"") -> list[bytes]:
    """The message ``[topic, seq, payload]`` of one batch, in vLLM's format (the inverse of
    :func:`decode_frames` with ``schema="vllm"``).

    Every field is written, None included, so vLLM's own decoder (whose ``lora_id``, ``medium``
    and ``lora_name`` have no defaults) reads it.

    Raises:
        InvalidArgumentError: ``seq`` outside ``0 .. 2**64 - 2``, a hash outside unsigned
            64 bits, or something that is not a KVEventBatch of our events.
    """
    if not isinstance(seq, int) or not 0 <= seq < U64_MAX:
        raise InvalidArgumentError(f"seq must be an int in 0 .. 2**64 - 2, got {seq!r}")
    if not isinstance(batch, KVEventBatch):
        raise InvalidArgumentError(f"expected a KVEventBatch, got {type(batch).__name__}")
    check_events(batch.events)
    return [bytes(topic), seq.to_bytes(8, "big"), ENCODER.encode(batch)]


def check_events(events: Sequence[Any]) -> None:
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
            if not isinstance(h, int) or not 0 <= h <= U64_MAX:
                raise InvalidArgumentError(
                    f"block hashes are unsigned 64-bit ints (mask with 2**64 - 1), got {h!r}"
                )


def connectable(sock: zmq.Socket) -> str:
    """Where a peer connects to reach a bound socket: its real port, 127.0.0.1 for a wildcard
    host."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT).replace("0.0.0.0", "127.0.0.1")
