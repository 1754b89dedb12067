"""What the visualizer draws: one :class:`Frame` per moment of the radix tree and the KV pool.

A frame is plain data, computed from ``minirad`` events by
:class:`viz.frame_builder.FrameBuilder`: every node (:class:`NodeView`) with its layout cell,
token count, ``lock_ref``, last access time and its *state* in this frame, the pool
(:class:`PoolView`), the engine step that ended the frame (:class:`StepView`), and a caption.
The edges' texts are :class:`Label` objects shared by the frames that show them.

States, as in Figure 3 of the SGLang paper (and :mod:`minirad.course.scenario`):

- ``added`` (green): a new leaf;
- ``accessed`` (blue): walked by a match or an insert;
- ``split``: the lower half of an edge that was cut (the new node id), unless its tokens were
  already added or accessed within the frame (it keeps that state then); the upper half
  keeps the old id and is usually ``accessed`` too, since a split happens on a match's path;
- ``evicted`` (red, dashed): the leaf left the tree. It is drawn in this frame, where it was,
  and is gone from the next one;
- ``idle`` (grey): untouched since the previous frame.

A cache with tiers (:class:`minirad.kvcache.hiradix_cache.HiRadixCache`, SGLang's HiCache)
adds, independent of the state, where each node's KV is (:attr:`NodeView.tiers`: some of
``"device"``, ``"host"``, ``"disk"``) and what moved it between tiers in this frame
(:attr:`NodeView.tier_marks`, in the order it happened, see :data:`TIER_MARKS`):

- ``backed_up``: copied to the host pool (it keeps its device slots);
- ``stored``: its pages written to the disk tier;
- ``demoted``: its device slots freed, the node stays in the tree, host-only;
- ``loaded_back``: a host-only node on the device again, copied from its host copy;
- ``recomputed``: the same, but a request computed its tokens again (an insert over it);
- ``host_evicted``: a host-only leaf left the tree (its state is ``evicted`` too);
- ``prefetched``: a new host-only node read from disk (its state is ``added`` too).

Such a frame also has a host pool panel (:attr:`Frame.host_pool`). A plain RadixCache's
frames have neither (``tiers`` is None), and their wire format is unchanged.

Independent of the state, the tokens a grammar forced (jump-forward decoding) are marked on
their edges (:attr:`Label.forced`): teal text and a teal bar under that part of the box.

The wire format (:func:`frames_to_wire`) is what the widget (``viz/static/radix_view.js``) and
the HTML export receive: nodes as arrays, labels sent once and referred to by index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from minirad.events import StepEvent

__all__ = [
    "STATES",
    "TIERS",
    "TIER_MARKS",
    "Frame",
    "Label",
    "NodeView",
    "PoolView",
    "StepView",
    "frame_labels",
    "frames_to_wire",
]

STATES = ("idle", "split", "accessed", "added", "evicted")  # weakest first
TIERS = ("device", "host", "disk")  # where a node's KV can be, fastest first
TIER_MARKS = (
    "backed_up",
    "stored",
    "demoted",
    "loaded_back",
    "recomputed",
    "host_evicted",
    "prefetched",
)


# ------------------------------------------------------------------ what a frame holds
@dataclass(frozen=True, slots=True)
class Label:
    """What one edge holds, for display. Made once per insert or split and shared by every
    frame in which the edge is unchanged.

    Attributes:
        index: unique within a builder; frames refer to labels by it on the wire.
        parts: the first ``max_chars`` characters as ``(kind, text)`` runs, ``kind`` being
            ``"text"``, ``"image"`` (an image chip such as ``"img 3fa2c1 x64"``) or
            ``"forced"`` (text a grammar forced, appended by jump-forward); line breaks shown
            as ``⏎``.
        full: the whole edge as text (images as ``[img 3fa2c1 x64]``), cut at 2000 chars.
        tokens: the first 16 token ids.
        images: ``(offset, num_tokens, name)`` of every image span (pad ids) on the edge.
        forced: ``(offset, num_tokens)`` of every run of forced tokens on the edge (see
            :class:`minirad.events.JumpForwardEvent`).
    """

    index: int
    parts: tuple[tuple[str, str], ...]
    full: str
    tokens: tuple[int, ...]
    images: tuple[tuple[int, int, str], ...]
    forced: tuple[tuple[int, int], ...] = ()

    @property
    def num_forced(self) -> int:
        """Forced tokens on the edge."""
        return sum(n for _, n in self.forced)

    @property
    def text(self) -> str:
        """The short text, images included as their chip text."""
        return "".join(t for _, t in self.parts)

    def to_dict(self) -> dict:
        return {
            "parts": [list(p) for p in self.parts],
            "full": self.full,
            # Image pad ids carry a whole hash: beyond 2**53 a JSON number loses digits in JS.
            "tokens": [t if t < 2**53 else f"{t:x}" for t in self.tokens],
            "images": [list(i) for i in self.images],
            "forced": [list(f) for f in self.forced],
        }


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node in one frame. ``col``/``depth`` are its layout cell; the root has id 0,
    no parent and no label.

    ``tiers`` (caches with tiers only, else None): where the node's KV is, some of
    :data:`TIERS` in that order (the root is ``("device",)``; a ghost keeps the tiers it had
    when it left). ``tier_marks``: what moved it between tiers since the previous frame, some
    of :data:`TIER_MARKS` in the order it happened.
    """

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
    tiers: tuple[str, ...] | None = None
    tier_marks: tuple[str, ...] = ()

    @property
    def host_only(self) -> bool:
        """Its KV is not on the device (host and/or disk only); False without tiers."""
        return self.tiers is not None and "device" not in self.tiers

    def to_wire(self) -> tuple:
        """``(id, parent, col, depth, num_tokens, lock_ref, last_access, state, label index,
        extra_key)``, then ``tiers, tier_marks`` (as lists) for a cache with tiers: an array in
        JSON, not an object, because a live view sends a whole tree per event (radix_view.js
        ``unpackNode`` reads it back)."""
        label = None if self.label is None else self.label.index
        plain = (
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
        if self.tiers is None and not self.tier_marks:
            return plain
        return (*plain, list(self.tiers or ()), list(self.tier_marks))


@dataclass(frozen=True, slots=True)
class PoolView:
    """A KV pool in one frame: ``num_cells`` cells (one per page; a page is one slot when
    ``page_size`` is 1), described as runs ``(first cell, length, owner)``. ``owner`` is a
    tree node id (int), a running request's id (str), or None (free). The host pool
    (:attr:`Frame.host_pool`) has the same form; its owners are the nodes whose host copy
    holds the page."""

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
        pool: the KV pool (the device's).
        step: the engine step that ended this frame, or None (no engine, or a frame taken
            between steps).
        host_pool: the host pool of a cache with tiers (owners: the nodes whose host copy
            holds each page), or None (a plain cache).
    """

    index: int
    time: int
    title: str | None
    caption: str
    events: tuple[str, ...]
    nodes: tuple[NodeView, ...]
    pool: PoolView
    step: StepView | None = None
    host_pool: PoolView | None = None

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
        shows it through the caption); ``host_pool`` (:meth:`PoolView.to_dict`) only for a
        cache with tiers. ``memo`` caches the wire form of the node views and
        pools that frames share."""
        memo = {} if memo is None else memo

        def wire(obj, convert):
            hit = memo.get(id(obj))
            if hit is None:  # the memo keeps obj alive, so its id() is not reused
                hit = memo[id(obj)] = (obj, convert(obj))
            return hit[1]

        d = {
            "index": self.index,
            "time": self.time,
            "title": self.title,
            "caption": self.caption,
            "events": list(self.events),
            "nodes": [wire(n, NodeView.to_wire) for n in self.nodes],
            "pool": wire(self.pool, PoolView.to_dict),
            "step": None if self.step is None else self.step.to_dict(),
        }
        if self.host_pool is not None:
            d["host_pool"] = wire(self.host_pool, PoolView.to_dict)
        return d


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
