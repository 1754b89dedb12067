"""KV-event batches as JSON lines: recordings of a server's stream, hashes as hex strings."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from minirad.errors import InvalidArgumentError, KVEventError
from minirad.kv_events.wire import U64_MAX, KVEvent, KVEventBatch

__all__ = [
    "batch_from_json",
    "batch_to_json",
    "load_recording",
    "save_recording",
]


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
    if not 0 <= h <= U64_MAX:
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
