"""vLLM's KV-cache events on the wire: the message format, a subscriber, a publisher, recordings.

A vLLM server started with ``--kv-events-config`` (or an offline ``LLM(kv_events_config=...)``)
tells the world what its prefix cache does, as ZMQ messages of three frames::

    [topic, seq (8 bytes, big-endian unsigned), payload]
    payload = msgpack [ts, events, data_parallel_rank]      (KVEventBatch, an array)
    event   = msgpack map {"type": "BlockStored", "block_hashes": [...], ...}

``seq`` counts batches from 0 in each server process. A *replay* ROUTER socket, if the server
has one, resends what it still holds: a DEALER sends ``[b"", start_seq (8 bytes)]`` and gets one
``[b"", topic, seq, payload]`` per batch with ``seq >= start_seq``, then the end marker
``[b"", b"", -1 (8 bytes, signed), b""]``. SGLang publishes the same envelope
(``schema="sglang"``: hashes are signed 64-bit, the batch's rank is ``attn_dp_rank``), its
events in one of two layouts, told apart batch by batch (:data:`SGLANG_LAYOUTS`): SGLang
0.5.23's tagged maps, vLLM's own encoding, or the tagged arrays ``[tag, fields...]`` of earlier
0.5 releases, whose replay replies carry no topic frame. :func:`decode_message` says which
layout a batch came in; the subscriber says it once, as a ``"layout"`` notice.

This package is the client side of that protocol, without importing vLLM (it cannot live in the
course venv, and its import takes seconds): msgspec structs named as vLLM 0.32 names them
(``vllm/distributed/kv_events.py``), :func:`decode_frames` / :func:`encode_batch` (``wire.py``), a
:class:`KVEventSubscriber` (``subscriber.py``) that delivers every batch the server can still
supply exactly once and in order, a :class:`KVEventPublisher` (``publisher.py``) that speaks the
server side (our engine publishes through it; tests use it as a server they control), and
JSON-lines recordings (``recording.py``).

:mod:`~minirad.kv_events.block_events` turns our radix cache's events into vLLM's block events,
and :mod:`~minirad.kv_events.event_tree` rebuilds a cache's tree from any of these streams.

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

from minirad.kv_events.publisher import KVEventPublisher
from minirad.kv_events.recording import (
    batch_from_json,
    batch_to_json,
    load_recording,
    save_recording,
)
from minirad.kv_events.subscriber import NOTICE_KINDS, Item, KVEventSubscriber, Notice
from minirad.kv_events.wire import (
    END_SEQ,
    SCHEMAS,
    SGLANG_LAYOUTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    Message,
    decode_frames,
    decode_message,
    encode_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "END_SEQ",
    "Item",
    "KVEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventSubscriber",
    "NOTICE_KINDS",
    "Message",
    "Notice",
    "SCHEMAS",
    "SGLANG_LAYOUTS",
    "batch_from_json",
    "batch_to_json",
    "decode_frames",
    "decode_message",
    "encode_batch",
    "load_recording",
    "save_recording",
]
