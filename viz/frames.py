"""Frames of the radix-tree animation, computed from ``minirad`` events only.

A :class:`FrameBuilder` is an event subscriber. It rebuilds the tree from what the events
say (insert adds a leaf, split cuts an edge, evict removes a leaf, lock/unlock set
``lock_ref``), keeps track of which KV-pool page belongs to which tree node or running request,
and on :meth:`FrameBuilder.snapshot` freezes the state into a :class:`Frame`: every node with
its cell in a :class:`~viz.layout.StableLayout`, its token count, ``lock_ref``, last access
time and its *state* in this frame, plus the pool and a caption made from the events.

States, as in Figure 3 of the SGLang paper (and :mod:`minirad.scenario`):

- ``added`` (green): a new leaf;
- ``accessed`` (blue): walked by a match or an insert;
- ``split``: the lower half of an edge that was cut (the new node id), unless its tokens were
  already added or accessed within the frame (it keeps that state then); the upper half
  keeps the old id and is usually ``accessed`` too, since a split happens on a match's path;
- ``evicted`` (red, dashed): the leaf left the tree. It is drawn in this frame, where it was,
  and is gone from the next one;
- ``idle`` (grey): untouched since the previous frame.

A node's state covers every event since the previous frame, the strongest state winning
(evicted > added > accessed > split > idle). With ``every_event=True`` (the default) there is
one frame per event; with False, the caller decides with :meth:`FrameBuilder.snapshot` (one
frame per scenario step...). Two events always end a frame: a cache reset, because the cache
numbers its nodes from 0 again afterwards, and an engine step
(:class:`minirad.events.StepEvent`, published at the end of ``LLMEngine.step``), so that
with ``every_event=False`` an engine gives one frame per step by itself. Such a frame says
which requests the step computed (:class:`StepView`), and its caption starts with them::

    step 4: prefill r1 (tokens 0-63), decode r0; finished r2 | evicted node 3: 10 tokens

Node ids are the cache's ``TreeNode.id``: a split keeps the id on the prefix part and gives
the suffix a new one (:class:`minirad.events.SplitEvent`), so a node never changes identity
in the drawing.

Example::

    builder = FrameBuilder(decode=tokenizer.decode, pool_size=allocator.size)
    unsubscribe = builder.attach(cache.bus)
    cache.insert(ids, slots)
    builder.frames[-1].caption    # 'insert: 0 tokens cached, new node 1 (12 tokens) under node 0'
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from minirad.events import (
    AllocEvent,
    Event,
    EventBus,
    EvictEvent,
    FreeEvent,
    InsertEvent,
    LockEvent,
    MatchEvent,
    ResetEvent,
    SplitEvent,
    StepEvent,
    UnlockEvent,
    load_events,
)
from minirad.multimodal import pad_value

from .layout import StableLayout

__all__ = [
    "STATES",
    "Frame",
    "FrameBuilder",
    "Label",
    "NodeView",
    "PoolView",
    "StepView",
    "frame_labels",
    "frames_from_events",
    "frames_to_wire",
    "image_names",
]

STATES = ("idle", "split", "accessed", "added", "evicted")  # weakest first
_RANK = {s: i for i, s in enumerate(STATES)}
TREE_POOL = "token_pool"  # the allocator of the radix tree (minirad.kv_pool)
FULL_TEXT_CHARS = 2000  # longer edges are cut in the hover text


# ------------------------------------------------------------------ what a frame holds
@dataclass(frozen=True, slots=True)
class Label:
    """What one edge holds, for display. Made once per insert or split and shared by every
    frame in which the edge is unchanged.

    Attributes:
        index: unique within a builder; frames refer to labels by it on the wire.
        parts: the first ``max_chars`` characters as ``(kind, text)`` runs, ``kind`` being
            ``"text"`` or ``"image"`` (an image chip such as ``"img 3fa2c1 x64"``); line
            breaks shown as ``⏎``.
        full: the whole edge as text (images as ``[img 3fa2c1 x64]``), cut at 2000 chars.
        tokens: the first 16 token ids.
        images: ``(offset, num_tokens, name)`` of every image span (pad ids) on the edge.
    """

    index: int
    parts: tuple[tuple[str, str], ...]
    full: str
    tokens: tuple[int, ...]
    images: tuple[tuple[int, int, str], ...]

    @property
    def text(self) -> str:
        """The short text, images included as their chip text."""
        return "".join(t for _, t in self.parts)

    def to_dict(self) -> dict:
        return {
            "parts": [list(p) for p in self.parts],
            "full": self.full,
            "tokens": list(self.tokens),
            "images": [list(i) for i in self.images],
        }


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node in one frame. ``col``/``depth`` are its layout cell; the root has id 0,
    no parent and no label."""

    id: int
    parent: int | None
    col: int
    depth: int
    num_tokens: int
    lock_ref: int
    last_access: int
    state: str
    label: Label | None
    extra_key: str | None = None

    def to_wire(self) -> tuple:
        """``(id, parent, col, depth, num_tokens, lock_ref, last_access, state, label index,
        extra_key)``: an array in JSON, not an object, because a live view sends a whole tree
        per event (radix_view.js ``unpackNode`` reads it back)."""
        label = None if self.label is None else self.label.index
        return (
            self.id,
            self.parent,
            self.col,
            self.depth,
            self.num_tokens,
            self.lock_ref,
            self.last_access,
            self.state,
            label,
            self.extra_key,
        )


@dataclass(frozen=True, slots=True)
class PoolView:
    """The KV pool in one frame: ``num_cells`` cells (one per page; a page is one slot when
    ``page_size`` is 1), described as runs ``(first cell, length, owner)``. ``owner`` is a
    tree node id (int), a running request's id (str), or None (free)."""

    num_cells: int
    page_size: int
    runs: tuple[tuple[int, int, int | str | None], ...]

    def owners(self) -> list[int | str | None]:
        """One owner per cell."""
        return [o for start, n, o in self.runs for _ in range(n)]

    def to_dict(self) -> dict:
        return {
            "cells": self.num_cells,
            "page_size": self.page_size,
            "runs": [list(r) for r in self.runs],
        }


@dataclass(frozen=True, slots=True)
class StepView:
    """One engine step, as its :class:`~minirad.events.StepEvent` tells it.

    Attributes:
        number: 1 for the first step the builder saw, 2 for the next...
        batch: ``(rid, start, num_tokens, is_prefill)`` per scheduled request, in batch order:
            the request computed tokens ``start .. start + num_tokens - 1`` of its sequence.
        preempted: requests that lost their KV in this step (they wait to be recomputed).
        deferred: requests that waited for a prefix another request of the step computes.
        finished: requests that ended with this step's token.
    """

    number: int
    batch: tuple[tuple[str, int, int, bool], ...]
    preempted: tuple[str, ...] = ()
    deferred: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()

    @classmethod
    def from_event(cls, number: int, e: StepEvent) -> StepView:
        batch = zip(e.rids, e.starts, e.num_tokens, e.is_prefill, strict=True)
        return cls(number, tuple(batch), e.preempted, e.deferred, e.finished)

    @property
    def running(self) -> tuple[str, ...]:
        """Requests still running after the step: the batch minus those that finished (the
        preempted ones were not in the batch)."""
        done = set(self.finished)
        return tuple(rid for rid, *_ in self.batch if rid not in done)

    def describe(self) -> str:
        """``"step 4: prefill r1 (tokens 0-63), decode r0, r3; finished r3"``: prefill chunks
        first (with the token range they computed), then the decodes, then what ended."""
        work = []
        for rid, start, n, prefill in self.batch:
            if prefill:
                span = f"token {start}" if n == 1 else f"tokens {start}-{start + n - 1}"
                work.append(f"prefill {rid} ({span})")
        decodes = [rid for rid, _, _, prefill in self.batch if not prefill]
        if decodes:
            work.append("decode " + ", ".join(decodes))
        text = f"step {self.number}: " + (", ".join(work) or "nothing computed")
        for word in ("finished", "preempted", "deferred"):
            if rids := getattr(self, word):
                text += f"; {word} {', '.join(rids)}"
        return text

    def to_dict(self) -> dict:
        return {
            "number": self.number,
            "batch": [list(b) for b in self.batch],
            "running": list(self.running),
            "preempted": list(self.preempted),
            "deferred": list(self.deferred),
            "finished": list(self.finished),
        }


@dataclass(frozen=True, slots=True)
class Frame:
    """The tree and the pool after some events.

    Attributes:
        index: position in the builder's frame list.
        time: logical time of the last event (0 before any).
        title: what the driver called this part of the story (a scenario step...), or None.
        caption: one line made from the events (their ``describe()``; for an engine step,
            :meth:`StepView.describe` first).
        events: ``describe()`` of every event since the previous frame, in order.
        nodes: the root first, then every node and ghost, in creation order.
        pool: the KV pool.
        step: the engine step that ended this frame, or None (no engine, or a frame taken
            between steps).
    """

    index: int
    time: int
    title: str | None
    caption: str
    events: tuple[str, ...]
    nodes: tuple[NodeView, ...]
    pool: PoolView
    step: StepView | None = None

    def node(self, node_id: int) -> NodeView:
        """The node with this id. Raises KeyError if it is not in the frame."""
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    @property
    def live(self) -> list[NodeView]:
        """The nodes in the tree after the frame's events (root and ghosts excluded)."""
        return [n for n in self.nodes if n.id != 0 and n.state != "evicted"]

    @property
    def num_tokens(self) -> int:
        """Tokens cached in the tree."""
        return sum(n.num_tokens for n in self.live)

    @property
    def locked(self) -> list[int]:
        """Ids of the nodes with ``lock_ref > 0`` (the locked paths)."""
        return [n.id for n in self.live if n.lock_ref]

    def summary(self) -> str:
        """``"6 nodes, 120 tokens, 2 locked: 'caption'"``."""
        return (
            f"{len(self.live)} nodes, {self.num_tokens} tokens, {len(self.locked)} locked: "
            f"{self.caption!r}"
        )

    def to_dict(self, memo: dict | None = None) -> dict:
        """JSON-ready; nodes as :meth:`NodeView.to_wire` lists, labels by index (see
        :func:`frames_to_wire`); ``step`` is :meth:`StepView.to_dict` or None (the player
        shows it through the caption). ``memo`` caches the wire form of the node views and
        pools that frames share."""
        memo = {} if memo is None else memo

        def wire(obj, convert):
            hit = memo.get(id(obj))
            if hit is None:  # the memo keeps obj alive, so its id() is not reused
                hit = memo[id(obj)] = (obj, convert(obj))
            return hit[1]

        return {
            "index": self.index,
            "time": self.time,
            "title": self.title,
            "caption": self.caption,
            "events": list(self.events),
            "nodes": [wire(n, NodeView.to_wire) for n in self.nodes],
            "pool": wire(self.pool, PoolView.to_dict),
            "step": None if self.step is None else self.step.to_dict(),
        }


def frame_labels(frames: Iterable[Frame]) -> dict[int, Label]:
    """Every label the frames show, by index."""
    labels: dict[int, Label] = {}
    for f in frames:
        for n in f.nodes:
            if n.label is not None:
                labels[n.label.index] = n.label
    return labels


def frames_to_wire(frames: Sequence[Frame], memo: dict | None = None) -> dict:
    """``{"frames": [...], "labels": [...]}``: what the widget and the HTML export send to the
    browser. ``labels[i]`` is the :class:`Label` with index ``i``, or None if no frame here
    shows it (labels are shared between frames, so each is sent once). ``memo``: see
    :meth:`Frame.to_dict` (a live view passes the same dict for every new frame)."""
    labels = frame_labels(frames)
    size = max(labels, default=-1) + 1
    table = [labels[i].to_dict() if i in labels else None for i in range(size)]
    return {"frames": [f.to_dict(memo) for f in frames], "labels": table}


# ------------------------------------------------------------------ images
def image_names(hashes: Iterable[str], vocab_size: int) -> dict[int, str]:
    """``{pad id: "img <hash prefix>"}`` for images given by their
    :func:`minirad.multimodal.hash_image` digests: the names the frames show for image spans."""
    return {pad_value(h, vocab_size): f"img {h[:6]}" for h in hashes}


# ------------------------------------------------------------------ the builder
class _Node:
    """The builder's record of one node (what the events told it)."""

    __slots__ = ("key", "value", "lock_ref", "last_access", "label", "extra_key")

    def __init__(self, key, value, time, label, extra_key=None) -> None:
        self.key: tuple[int, ...] = key
        self.value: tuple[int, ...] = value
        self.lock_ref = 0
        self.last_access = time
        self.label: Label | None = label
        self.extra_key: str | None = extra_key


class FrameBuilder:
    """Turns a stream of ``minirad`` events into :class:`Frame` objects.

    Args:
        decode: token ids -> text (e.g. ``tokenizer.decode``); None shows the ids.
        vocab_size: token ids at or above it are image pad ids
            (:func:`minirad.multimodal.pad_value`); None: only the ids in ``images`` are.
        images: ``{pad id: name}`` for image spans (see :func:`image_names`); other pad ids
            are named ``"img #<pad id - vocab_size in hex>"``.
        pool_size: KV pool capacity in tokens (``TokenToKVPoolAllocator.size``); None: the
            pool grows to the highest slot seen.
        page_size: tokens per KV page; the pool panel shows one cell per page.
        every_event: take a frame after every event (else only on :meth:`snapshot`, a cache
            reset and an engine step).
        max_chars: characters of edge text shown in a node box.
        pool_name: the ``pool`` whose alloc/free events are tracked (the radix tree's
            token allocator); other pools' events are ignored.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str] | None = None,
        *,
        vocab_size: int | None = None,
        images: Mapping[int, str] | None = None,
        pool_size: int | None = None,
        page_size: int = 1,
        every_event: bool = True,
        max_chars: int = 24,
        pool_name: str = TREE_POOL,
    ) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.decode = decode
        self.vocab_size = vocab_size
        self.images = dict(images or {})
        self.page_size = page_size
        self.every_event = every_event
        self.max_chars = max_chars
        self.pool_name = pool_name
        self.title: str | None = None  # copied into every frame; set it between story parts
        self.frames: list[Frame] = []
        self._num_labels = 0
        self._fixed_pool = pool_size is not None
        num_pages = -(-pool_size // page_size) if pool_size else 0
        self._owner: list[int | str | None] = [None] * num_pages  # per page
        self._pool_view: PoolView | None = None  # cached until the pool changes
        self._pending: list[Event] = []  # events since the last frame
        self._step: StepView | None = None  # the engine step that ends the pending frame
        self.num_steps = 0  # engine steps seen
        self._time = 0
        self.layout = StableLayout()
        self._nodes: dict[int, _Node] = {0: _Node((), (), 0, None)}
        self._ghosts: dict[int, _Node] = {}
        self._states: dict[int, str] = {}  # non-idle states since the last frame
        # Views of the last frame, reused for nodes that did not change: a frame of a big
        # tree then costs one dict lookup per untouched node.
        self._views: dict[int, NodeView] = {}
        self._touched: set[int] = set()  # lock_ref or last access changed
        self._was_marked: set[int] = set()  # non-idle in the last frame (idle again now)

    # ------------------------------------------------------------------ input
    def attach(self, bus: EventBus) -> Callable[[], None]:
        """Subscribe to ``bus``; returns the unsubscribe function."""
        return bus.subscribe(self)

    def __call__(self, event: Event) -> None:
        self.apply(event)

    def apply(self, event: Event) -> None:
        """Update the state for one event (and take a frame if ``every_event``)."""
        handler = _HANDLERS.get(type(event))
        if handler is None or not self._concerns_us(event):
            return
        handler(self, event)
        self._pending.append(event)
        self._time = event.time
        if (
            self.every_event
            or isinstance(event, StepEvent)
            or (isinstance(event, ResetEvent) and event.source == "radix_cache")
        ):
            self.snapshot()

    def _concerns_us(self, event: Event) -> bool:
        """False for another pool's events (e.g. the vLLM block pool sharing the bus)."""
        if isinstance(event, ResetEvent):
            return event.source in ("radix_cache", self.pool_name)
        return getattr(event, "pool", self.pool_name) == self.pool_name

    @property
    def has_pending(self) -> bool:
        """True if events arrived since the last frame."""
        return bool(self._pending)

    def extend(self, events: Iterable[Event]) -> None:
        """:meth:`apply` each event in order."""
        for e in events:
            self.apply(e)

    def _mark(self, node_id: int, state: str) -> None:
        if _RANK[state] > _RANK[self._states.get(node_id, "idle")]:
            self._states[node_id] = state

    def _on_match(self, e: MatchEvent) -> None:
        for i in e.path:
            self._nodes[i].last_access = e.time
            self._mark(i, "accessed")

    def _on_insert(self, e: InsertEvent) -> None:
        self._on_match(e)
        if e.node_id is None:
            return
        self._nodes[e.node_id] = _Node(e.key, e.value, e.time, self._label(e.key), e.extra_key)
        self.layout.add(e.node_id, e.parent_id)
        self._mark(e.node_id, "added")
        self._set_owner(e.value, e.node_id)

    def _on_split(self, e: SplitEvent) -> None:
        # RadixCache: the prefix keeps the id, the suffix (new id) keeps lock_ref and
        # children; both were just walked, so both carry the split's time.
        old = self._nodes[e.node_id]
        m = e.split_len
        suffix = _Node(old.key[m:], old.value[m:], e.time, self._label(old.key[m:]), old.extra_key)
        suffix.lock_ref = old.lock_ref
        old.key, old.value, old.label = old.key[:m], old.value[:m], self._label(old.key[:m])
        old.last_access = e.time
        self._nodes[e.new_node_id] = suffix
        self.layout.split(e.node_id, e.new_node_id)
        # The lower half is "split" (grey, cut) unless its tokens were already added or
        # accessed since the last frame: then it keeps that colour.
        self._mark(e.new_node_id, self._states.get(e.node_id, "split"))
        self._mark(e.new_node_id, "split")
        self._mark(e.node_id, "split")
        self._set_owner(suffix.value, e.new_node_id)

    def _on_lock(self, e: LockEvent | UnlockEvent) -> None:
        for i, ref in zip(e.node_ids, e.lock_refs, strict=True):
            self._nodes[i].lock_ref = ref
        self._touched.update(e.node_ids)

    def _on_evict(self, e: EvictEvent) -> None:
        node = self._nodes.pop(e.node_id)
        node.lock_ref = 0
        self._ghosts[e.node_id] = node
        self.layout.remove(e.node_id)
        self._mark(e.node_id, "evicted")
        self._set_owner(node.value, None)

    def _on_reset(self, e: ResetEvent) -> None:
        if e.source == "radix_cache":
            for i in list(self._nodes):
                if i != 0:
                    self._on_evict(EvictEvent(e.time, i, len(self._nodes[i].key)))
            # The cache hands out ids from 0 again: ghosts are dropped with this frame.
        else:  # the pool
            self._owner = [None] * len(self._owner)
            self._pool_view = None

    def _on_step(self, e: StepEvent) -> None:
        # The step's cache and pool events came before it (LLMEngine.step publishes it last),
        # so the frame it ends shows the step's whole effect.
        self.num_steps += 1
        self._step = StepView.from_event(self.num_steps, e)

    def _on_alloc(self, e: AllocEvent) -> None:
        self._set_owner(e.ids, e.owner if e.owner is not None else "request")

    def _on_free(self, e: FreeEvent) -> None:
        self._set_owner(e.ids, None)

    def _set_owner(self, slots: Sequence[int], owner: int | str | None) -> None:
        if not slots:
            return
        ps = self.page_size
        need = max(slots) // ps + 1
        if need > len(self._owner):
            if self._fixed_pool:
                raise ValueError(f"slot {max(slots)} is beyond the pool of {len(self._owner)}")
            self._owner.extend([None] * (need - len(self._owner)))
        for s in slots:
            self._owner[s // ps] = owner
        self._pool_view = None

    # ------------------------------------------------------------------ labels
    def _is_image(self, t: int) -> bool:
        return t in self.images or (self.vocab_size is not None and t >= self.vocab_size)

    def _image_name(self, t: int) -> str:
        if t in self.images:
            return self.images[t]
        return f"img #{t - self.vocab_size:x}"

    def _text(self, ids: list[int]) -> str:
        if self.decode is None:
            return " ".join(map(str, ids)) + " "
        return self.decode(ids)

    def _label(self, key: tuple[int, ...]) -> Label:
        """Decode an edge: text runs through ``decode``, image runs (pad ids) as chips."""
        runs: list[tuple[str, str]] = []
        images = []
        offset = 0
        for is_image, group in itertools.groupby(key, self._is_image):
            ids = list(group)
            if is_image:
                # One image is one run of a single pad id; two images in a row are two runs.
                for pad, same in itertools.groupby(ids):
                    n = len(list(same))
                    name = self._image_name(pad)
                    images.append((offset, n, name))
                    runs.append(("image", f"{name} x{n}"))
                    offset += n
            else:
                runs.append(("text", self._text(ids)))
                offset += len(ids)
        full = "".join(t if k == "text" else f"[{t}]" for k, t in runs)
        if len(full) > FULL_TEXT_CHARS:
            full = full[: FULL_TEXT_CHARS - 1] + "…"
        parts, room = [], self.max_chars
        for kind, t in runs:
            if room <= 0:
                break
            t = t.replace("\n", "⏎") if kind == "text" else t
            if len(t) > room:
                t = t[: max(room - 1, 0)] + "…"
            parts.append((kind, t))
            room -= len(t)
        self._num_labels += 1
        return Label(self._num_labels - 1, tuple(parts), full, key[:16], tuple(images))

    # ------------------------------------------------------------------ output
    def _pool(self) -> PoolView:
        if self._pool_view is None:
            runs, start = [], 0
            for owner, group in itertools.groupby(self._owner):
                n = len(list(group))
                runs.append((start, n, owner))
                start += n
            self._pool_view = PoolView(len(self._owner), self.page_size, tuple(runs))
        return self._pool_view

    def _caption(self) -> str:
        events = self._pending
        notable = [
            e.describe()
            for e in events
            if isinstance(e, SplitEvent | EvictEvent | ResetEvent)
            or (isinstance(e, InsertEvent) and e.node_id is not None)
        ]
        if self._step is not None:  # what the engine did, then what changed in the tree
            tree = "; ".join(notable)
            return f"{self._step.describe()} | {tree}" if tree else self._step.describe()
        if not events:
            return "no cache events"
        if len(events) == 1:
            return events[0].describe()
        if notable:
            return "; ".join(notable)
        return next((e.describe() for e in events if isinstance(e, MatchEvent)), "no change")

    def snapshot(self) -> Frame:
        """Freeze the current state into a frame (appended to :attr:`frames`); evicted nodes
        appear in it as ghosts and are dropped afterwards; every state goes back to idle."""
        layout, states, cache = self.layout, self._states, self._views
        changed = self._touched | self._was_marked | layout.moved | states.keys()
        views = []
        for table in (self._nodes, self._ghosts):
            for i, n in table.items():
                v = cache.get(i)
                if v is None or i in changed:
                    v = cache[i] = NodeView(
                        i,
                        layout.parent[i],
                        layout.col[i],
                        layout.depth[i],
                        len(n.key),
                        n.lock_ref,
                        n.last_access,
                        states.get(i, "idle"),
                        n.label,
                        n.extra_key,
                    )
                views.append(v)
        frame = Frame(
            len(self.frames),
            self._time,
            self.title,
            self._caption(),
            tuple(e.describe() for e in self._pending),
            tuple(views),
            self._pool(),
            self._step,
        )
        self.frames.append(frame)
        self._pending = []
        self._step = None
        self._was_marked = set(states)
        self._states = {}
        self._touched = set()
        layout.moved.clear()
        if self._ghosts:
            for i in self._ghosts:
                del cache[i]
            self._ghosts = {}
            layout.release_ghosts()
            if len(self._nodes) == 1:  # after a reset: columns start from 0 again
                layout.reset()
        return frame


_HANDLERS: dict[type, Callable[[FrameBuilder, Event], None]] = {
    MatchEvent: FrameBuilder._on_match,
    InsertEvent: FrameBuilder._on_insert,
    SplitEvent: FrameBuilder._on_split,
    LockEvent: FrameBuilder._on_lock,
    UnlockEvent: FrameBuilder._on_lock,
    EvictEvent: FrameBuilder._on_evict,
    ResetEvent: FrameBuilder._on_reset,
    AllocEvent: FrameBuilder._on_alloc,
    FreeEvent: FrameBuilder._on_free,
    StepEvent: FrameBuilder._on_step,
}


def frames_from_events(
    events: Iterable[Event] | str | Path, *, initial: bool = True, **builder_kwargs
) -> list[Frame]:
    """Frames for a recorded event log: a list of events, or the path of a JSONL file
    written by :class:`minirad.events.EventRecorder`.

    Args:
        initial: start with a frame of the empty tree (before the first event).
        builder_kwargs: as in :class:`FrameBuilder` (one frame per event by default).
    """
    if isinstance(events, str | Path):
        events = load_events(events)
    builder = FrameBuilder(**builder_kwargs)
    if initial:
        builder.snapshot()
    builder.extend(events)
    if builder.has_pending:
        builder.snapshot()
    return builder.frames
