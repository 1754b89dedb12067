"""Typed cache events, a logical clock, and a JSONL recorder.

Every mutation of a cache or pool (match, insert, split, lock, unlock, evict, alloc, free...)
is published as one frozen dataclass with the logical time of the operation. Subscribers (the
visualizer in ``viz/``, statistics, notebook printouts) only ever see these events; nothing
reaches into a cache's internals to draw it.

The clock is an operation counter, not wall time: every public operation takes one tick, and
the nodes it touches get that tick as their ``last_access_time``. Order and ties are therefore
identical on every run, which keeps LRU decisions and notebook outputs deterministic. (SGLang
uses ``time.monotonic()``; the paper's Figure 3 only needs an order.)

Example::

    bus = EventBus()
    recorder = EventRecorder(bus)
    cache = RadixCache(bus=bus)
    cache.insert([1, 2, 3])
    recorder.save("log.jsonl")
    events = load_events("log.jsonl")   # -> [InsertEvent(time=1, ...)]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from minirad.errors import InvalidArgumentError

__all__ = [
    "AllocEvent",
    "BackupEvent",
    "DemoteEvent",
    "HostEvictEvent",
    "LoadBackEvent",
    "PrefetchEvent",
    "BlockRemovedEvent",
    "BlockStoredEvent",
    "Event",
    "EventBus",
    "EventRecorder",
    "EvictEvent",
    "FreeEvent",
    "InsertEvent",
    "JumpForwardEvent",
    "LockEvent",
    "MatchEvent",
    "ResetEvent",
    "SplitEvent",
    "StepEvent",
    "TIER_EVENTS",
    "TouchEvent",
    "UnlockEvent",
    "event_from_dict",
    "load_events",
    "plural",
    "save_events",
]

Subscriber = Callable[["Event"], None]


def plural(n: int, noun: str) -> str:
    """``"1 token"``, ``"2 tokens"``: a count and its noun, for captions and printouts."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@dataclass(frozen=True, slots=True)
class Event:
    """Base of all events. ``time`` is the logical clock value of the operation."""

    kind: ClassVar[str] = "event"
    time: int

    def to_dict(self) -> dict:
        """A JSON-ready dict with a ``kind`` field naming the event class."""
        d = {"kind": self.kind}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    def describe(self) -> str:
        """One line saying what happened, for captions and printouts."""
        return self.kind


@dataclass(frozen=True, slots=True)
class MatchEvent(Event):
    """``RadixCache.match_prefix``: the ids of the nodes on the matched path (root excluded)."""

    kind: ClassVar[str] = "match"
    path: tuple[int, ...]
    num_tokens: int  # tokens matched (cache hits)
    query_len: int  # tokens looked up, after page alignment
    extra_key: str | None = None

    def describe(self) -> str:
        return f"match: {self.num_tokens} of {self.query_len} tokens cached, path {list(self.path)}"


@dataclass(frozen=True, slots=True)
class InsertEvent(Event):
    """``RadixCache.insert``: existing nodes walked, then the new leaf (if any tokens were new).

    ``key`` / ``value`` are the new leaf's token ids and KV slot indices; they are empty and
    ``node_id`` is None when the whole key was already cached.
    """

    kind: ClassVar[str] = "insert"
    path: tuple[int, ...]
    prefix_len: int
    node_id: int | None
    parent_id: int | None
    key: tuple[int, ...] = ()
    value: tuple[int, ...] = ()
    extra_key: str | None = None

    def describe(self) -> str:
        if self.node_id is None:
            return f"insert: all {self.prefix_len} tokens already cached"
        return (
            f"insert: {self.prefix_len} tokens cached, new node {self.node_id} "
            f"({plural(len(self.key), 'token')}) under node {self.parent_id}"
        )


@dataclass(frozen=True, slots=True)
class SplitEvent(Event):
    """A node's edge was cut after ``split_len`` tokens.

    The prefix part keeps ``node_id``; the suffix part (which keeps the children and any
    request's reference) gets ``new_node_id``.
    """

    kind: ClassVar[str] = "split"
    node_id: int
    new_node_id: int
    split_len: int

    def describe(self) -> str:
        return (
            f"split node {self.node_id} at token {self.split_len}: "
            f"the rest is node {self.new_node_id}"
        )


@dataclass(frozen=True, slots=True)
class LockEvent(Event):
    """``inc_lock_ref``: ``node_ids`` from the locked node up to (excluding) the root, with
    each node's ``lock_ref`` after the change."""

    kind: ClassVar[str] = "lock"
    node_ids: tuple[int, ...]
    lock_refs: tuple[int, ...]

    def describe(self) -> str:
        return f"lock nodes {list(self.node_ids)}: lock_ref {list(self.lock_refs)}"


@dataclass(frozen=True, slots=True)
class UnlockEvent(Event):
    """``dec_lock_ref``: same fields as :class:`LockEvent`."""

    kind: ClassVar[str] = "unlock"
    node_ids: tuple[int, ...]
    lock_refs: tuple[int, ...]

    def describe(self) -> str:
        return f"unlock nodes {list(self.node_ids)}: lock_ref {list(self.lock_refs)}"


@dataclass(frozen=True, slots=True)
class EvictEvent(Event):
    """A leaf left the tree; ``value`` are the KV slots it freed."""

    kind: ClassVar[str] = "evict"
    node_id: int
    num_tokens: int
    value: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"evicted node {self.node_id}: {plural(self.num_tokens, 'token')}"


@dataclass(frozen=True, slots=True)
class ResetEvent(Event):
    """The cache or pool was emptied."""

    kind: ClassVar[str] = "reset"
    source: str = ""

    def describe(self) -> str:
        return f"reset {self.source}".strip()


@dataclass(frozen=True, slots=True)
class AllocEvent(Event):
    """A pool handed out ``ids`` (token slots or block ids, see ``unit``) to ``owner``."""

    kind: ClassVar[str] = "alloc"
    pool: str
    unit: str  # "slot" or "block"
    ids: tuple[int, ...]
    owner: str | None = None

    def describe(self) -> str:
        owner = f" to {self.owner}" if self.owner else ""
        return f"{self.pool}: allocated {plural(len(self.ids), self.unit)}{owner}"


@dataclass(frozen=True, slots=True)
class FreeEvent(Event):
    """A pool took ``ids`` back (their reference count reached zero)."""

    kind: ClassVar[str] = "free"
    pool: str
    unit: str
    ids: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.pool}: freed {plural(len(self.ids), self.unit)}"


@dataclass(frozen=True, slots=True)
class TouchEvent(Event):
    """Cached blocks were reused by a request: each ``ref_cnt`` went up by one."""

    kind: ClassVar[str] = "touch"
    pool: str
    ids: tuple[int, ...]
    ref_cnts: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.pool}: reused blocks {list(self.ids)}, ref_cnt {list(self.ref_cnts)}"


@dataclass(frozen=True, slots=True)
class BlockStoredEvent(Event):
    """Full blocks were registered in the block-hash table (vLLM's ``BlockStored``)."""

    kind: ClassVar[str] = "block_stored"
    pool: str
    ids: tuple[int, ...]
    block_hashes: tuple[str, ...]  # hex digests

    def describe(self) -> str:
        return f"{self.pool}: cached blocks {list(self.ids)} by hash"


@dataclass(frozen=True, slots=True)
class BlockRemovedEvent(Event):
    """A cached block's hash was dropped because the block was reused (lazy eviction)."""

    kind: ClassVar[str] = "block_removed"
    pool: str
    ids: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.pool}: dropped the hashes of reused blocks {list(self.ids)}"


@dataclass(frozen=True, slots=True)
class StepEvent(Event):
    """One engine step (``LLMEngine.step``): its forward batch and the scheduler's decisions.

    The batch is given as parallel tuples, one entry per scheduled request in batch order:
    request ``rids[i]`` computed tokens ``starts[i] .. starts[i] + num_tokens[i] - 1``, a
    prefill chunk if ``is_prefill[i]`` else a decode. ``preempted`` lost their KV this step,
    ``deferred`` waited for a prefix another request of this step computes, ``finished``
    ended with this step's token (vLLM's ``SchedulerOutput``, SGLang's ``ScheduleBatch``).
    """

    kind: ClassVar[str] = "step"
    rids: tuple[str, ...]
    starts: tuple[int, ...]
    num_tokens: tuple[int, ...]
    is_prefill: tuple[bool, ...]
    preempted: tuple[str, ...] = ()
    deferred: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()

    def describe(self) -> str:
        prefill = sum(n for n, p in zip(self.num_tokens, self.is_prefill, strict=True) if p)
        decode = sum(n for n, p in zip(self.num_tokens, self.is_prefill, strict=True) if not p)
        text = f"step: {len(self.rids)} requests, {prefill} prefill + {decode} decode tokens"
        if self.preempted:
            text += f"; preempted {', '.join(self.preempted)}"
        if self.finished:
            text += f"; finished {', '.join(self.finished)}"
        return text


@dataclass(frozen=True, slots=True)
class JumpForwardEvent(Event):
    """A request's grammar forced ``num_tokens`` output tokens, appended at once (jump-forward
    decoding, SGLang paper §4): tokens ``start .. start + num_tokens - 1`` of the request's
    sequence (prompt included) will be computed in its next prefill chunk, not decoded."""

    kind: ClassVar[str] = "jump_forward"
    rid: str
    start: int
    num_tokens: int

    def describe(self) -> str:
        return f"jump-forward: {self.rid} + {plural(self.num_tokens, 'forced token')}"


# --------------------------------------------------------------------------- tiers (HiCache)
@dataclass(frozen=True, slots=True)
class BackupEvent(Event):
    """``write_backup``: the KV of ``node_ids`` (a path, root side first) was copied to a lower
    tier: ``medium`` ``"CPU"`` (the host pool, ``host_value`` its slots in path order) or
    ``"STORAGE"`` (the disk tier, ``host_value`` empty). The nodes keep their device slots."""

    kind: ClassVar[str] = "backup"
    node_ids: tuple[int, ...]
    host_value: tuple[int, ...] = ()
    medium: str = "CPU"

    def describe(self) -> str:
        where = "disk" if self.medium == "STORAGE" else "host"
        return f"backup: nodes {list(self.node_ids)} copied to the {where}"


@dataclass(frozen=True, slots=True)
class DemoteEvent(Event):
    """A backed-up node left the device: its device slots ``value`` were freed, the node stays
    in the tree, host-only (SGLang's ``_evict_backuped``)."""

    kind: ClassVar[str] = "demote"
    node_id: int
    num_tokens: int
    value: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"demoted node {self.node_id} to the host: {plural(self.num_tokens, 'token')}"


@dataclass(frozen=True, slots=True)
class LoadBackEvent(Event):
    """Host-only ``node_ids`` (root side first) are on the device again, in the new slots
    ``value``: copied from their host copies (``load_back``), or, when ``recomputed``, given
    the slots of a request that computed the same tokens again (an insert over them)."""

    kind: ClassVar[str] = "load_back"
    node_ids: tuple[int, ...]
    value: tuple[int, ...] = ()
    recomputed: bool = False

    def describe(self) -> str:
        how = "recomputed" if self.recomputed else "loaded back"
        n = plural(len(self.value), "token")
        return f"{how}: nodes {list(self.node_ids)}, {n} on the device"


@dataclass(frozen=True, slots=True)
class HostEvictEvent(Event):
    """A host-only leaf left the tree (``evict_host``); ``host_value`` are the host slots it
    freed. Its pages may still be on disk."""

    kind: ClassVar[str] = "evict_host"
    node_id: int
    num_tokens: int
    host_value: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"evicted node {self.node_id} from the host: {plural(self.num_tokens, 'token')}"


@dataclass(frozen=True, slots=True)
class PrefetchEvent(Event):
    """Pages found on disk became a new host-only leaf ``node_id`` under ``parent_id``:
    ``key`` its tokens, ``host_value`` the host slots they were read into."""

    kind: ClassVar[str] = "prefetch"
    node_id: int
    parent_id: int
    key: tuple[int, ...] = ()
    host_value: tuple[int, ...] = ()
    extra_key: str | None = None

    def describe(self) -> str:
        return (
            f"prefetched node {self.node_id} from disk to the host: "
            f"{plural(len(self.key), 'token')} under node {self.parent_id}"
        )


# A hierarchical cache's moves between its tiers (HiRadixCache).
TIER_EVENTS: tuple[type[Event], ...] = (
    BackupEvent,
    DemoteEvent,
    LoadBackEvent,
    HostEvictEvent,
    PrefetchEvent,
)

_EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        MatchEvent,
        InsertEvent,
        SplitEvent,
        LockEvent,
        UnlockEvent,
        EvictEvent,
        ResetEvent,
        AllocEvent,
        FreeEvent,
        TouchEvent,
        BlockStoredEvent,
        BlockRemovedEvent,
        StepEvent,
        JumpForwardEvent,
        *TIER_EVENTS,
    )
}


def event_from_dict(d: dict) -> Event:
    """Inverse of :meth:`Event.to_dict`.

    Raises:
        KeyError: unknown ``kind``.
        InvalidArgumentError: a required field is missing.
    """
    cls = _EVENT_TYPES[d["kind"]]
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
        elif f.default is not dataclasses.MISSING:
            v = f.default
        else:
            raise InvalidArgumentError(f"{d['kind']} event without its {f.name!r} field: {d}")
        kwargs[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)


class EventBus:
    """The logical clock and the subscriber list shared by caches and pools.

    Pass one bus to every component of an engine so their events share one timeline.
    """

    def __init__(self) -> None:
        self.time = 0
        self._subscribers: list[Subscriber] = []

    def tick(self) -> int:
        """Advance the clock by one operation and return the new time."""
        self.time += 1
        return self.time

    @property
    def active(self) -> bool:
        """True when someone listens; emitters skip building events otherwise."""
        return bool(self._subscribers)

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call ``fn(event)`` for every event from now on; returns an unsubscribe function."""
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    def emit(self, event: Event) -> None:
        for fn in self._subscribers:
            fn(event)


class EventRecorder:
    """Collects events (live from a bus, or loaded from a file) and saves them as JSONL."""

    def __init__(self, bus: EventBus | None = None, events: Iterable[Event] = ()) -> None:
        self.events: list[Event] = list(events)
        self._unsubscribe = bus.subscribe(self.events.append) if bus is not None else None

    def close(self) -> None:
        """Stop recording (the events collected so far stay)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def save(self, path: str | Path) -> None:
        save_events(self.events, path)

    @classmethod
    def load(cls, path: str | Path) -> EventRecorder:
        return cls(events=load_events(path))

    def replay(self, fn: Subscriber) -> None:
        """Feed every recorded event, in order, to ``fn``."""
        for event in self.events:
            fn(event)

    def __len__(self) -> int:
        return len(self.events)


def save_events(events: Iterable[Event], path: str | Path) -> None:
    """Write one JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for event in events:
            # default=int: token ids may be numpy integers (the caches accept them as keys).
            f.write(json.dumps(event.to_dict(), separators=(",", ":"), default=int) + "\n")


def load_events(path: str | Path) -> list[Event]:
    """Read a JSONL event log written by :func:`save_events`."""
    with open(path, encoding="utf-8") as f:
        return [event_from_dict(json.loads(line)) for line in f if line.strip()]
