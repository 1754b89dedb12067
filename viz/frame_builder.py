"""Frames of the radix-tree animation (:mod:`viz.frame`), computed from ``minirad`` events only.

A :class:`FrameBuilder` is an event subscriber. It rebuilds the tree from what the events say
(a :class:`~minirad.kv_events.event_tree.EventTree`, laid out by a
:class:`~viz.layout.StableLayout`), keeps track of which KV-pool page belongs to which tree node or
running request, and on :meth:`FrameBuilder.snapshot` freezes the state into a
:class:`~viz.frame.Frame`.

A node's state (see :mod:`viz.frame`) covers every event since the previous frame, the
strongest state winning (evicted > added > accessed > split > idle). With ``every_event=True``
(the default) there is one frame per event; with False, the caller decides with
:meth:`FrameBuilder.snapshot` (one frame per scenario step...). Two events always end a frame:
a cache reset, because the cache numbers its nodes from 0 again afterwards, and an engine step
(:class:`minirad.events.StepEvent`, published at the end of ``LLMEngine.step``), so that with
``every_event=False`` an engine gives one frame per step by itself. Such a frame says which
requests the step computed (:class:`~viz.frame.StepView`), and its caption starts with them::

    step 4: prefill r1 (tokens 0-63), decode r0; finished r2 | evicted node 3: 10 tokens

Structured output (:class:`minirad.events.JumpForwardEvent`): a grammar's forced run is appended
to a request at once and computed in its next prefill chunk. The builder follows which KV slots
that chunk gives the forced positions (the step's batch and its ``AllocEvent`` to the request),
and marks those tokens in every edge that holds the slots (:attr:`~viz.frame.Label.forced`): a
forced run that several requests share is then one marked node, with the forks at the free
choices. The step frame that computes a run marks it; its caption names each jump::

    step 2: prefill req-0 (tokens 101-111) | insert: ...; jump-forward: req-0 + 3 forced tokens

Tiers (:class:`minirad.kvcache.hiradix_cache.HiRadixCache`): the builder follows where each
node's KV is (device, host, disk: :attr:`~viz.frame.NodeView.tiers`), marks the nodes that a
backup, demotion, load-back, host eviction or prefetch moved in this frame
(:attr:`~viz.frame.NodeView.tier_marks`), and keeps a second pool, the host pool, whose owners
come from the events' ``host_value`` (:attr:`~viz.frame.Frame.host_pool`). A builder shows
tiers when given ``host_pool_size``, or from the first tier event on; a plain cache's frames
stay as they were.

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
from pathlib import Path

from minirad.events import (
    TIER_EVENTS,
    AllocEvent,
    BackupEvent,
    DemoteEvent,
    Event,
    EventBus,
    EvictEvent,
    FreeEvent,
    HostEvictEvent,
    InsertEvent,
    JumpForwardEvent,
    LoadBackEvent,
    LockEvent,
    MatchEvent,
    PrefetchEvent,
    ResetEvent,
    SplitEvent,
    StepEvent,
    UnlockEvent,
    load_events,
)
from minirad.kv_events.event_tree import RESET_SOURCE, EventTree
from minirad.kvcache.multimodal import pad_value

from .frame import STATES, Frame, Label, NodeView, PoolView, StepView
from .layout import StableLayout

__all__ = ["FrameBuilder", "frames_from_events", "image_names"]

_RANK = {s: i for i, s in enumerate(STATES)}
TREE_POOL = "token_pool"  # the allocator of the radix tree (minirad.kvcache.kv_pool)
FULL_TEXT_CHARS = 2000  # longer edges are cut in the hover text
# Events worth naming in a frame's caption when several happened (besides a match).
_NOTABLE = (
    SplitEvent,
    EvictEvent,
    ResetEvent,
    JumpForwardEvent,
    *TIER_EVENTS,
)


# ------------------------------------------------------------------ images
def image_names(hashes: Iterable[str], vocab_size: int) -> dict[int, str]:
    """``{pad id: "img <hash prefix>"}`` for images given by their
    :func:`minirad.kvcache.multimodal.hash_image` digests: the names the frames show for image
    spans."""
    return {pad_value(h, vocab_size): f"img {h[:6]}" for h in hashes}


# ------------------------------------------------------------------ the builder
class FrameBuilder:
    """Turns a stream of ``minirad`` events into :class:`Frame` objects.

    Args:
        decode: token ids -> text (e.g. ``tokenizer.decode``); None shows the ids.
        vocab_size: token ids at or above it are image pad ids
            (:func:`minirad.kvcache.multimodal.pad_value`); None: only the ids in ``images`` are.
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
        host_pool_size: host pool capacity in tokens, for a cache with tiers
            (``HiRadixCache.host_pool.size``): every frame then shows tiers and the host pool.
            None: they appear with the first tier event, and the host pool grows to the
            highest host slot seen.
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
        max_chars: int = 20,
        pool_name: str = TREE_POOL,
        host_pool_size: int | None = None,
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
        # The host pool (tiers): its owner per page, from the events' host_value.
        self.tiered = host_pool_size is not None  # frames show tiers and the host pool
        self._fixed_host = host_pool_size is not None
        num_host_pages = -(-host_pool_size // page_size) if host_pool_size else 0
        self._host_owner: list[int | str | None] = [None] * num_host_pages
        self._host_pool_view: PoolView | None = None
        self._marks: dict[int, list[str]] = {}  # tier marks since the last frame, in order
        self._pending: list[Event] = []  # events since the last frame
        self._step: StepView | None = None  # the engine step that ends the pending frame
        self.num_steps = 0  # engine steps seen
        self._time = 0
        self.tree = EventTree()
        self.layout = StableLayout(self.tree)
        self._labels: dict[int, Label] = {}  # node id -> its edge's label (ghosts included)
        self._states: dict[int, str] = {}  # non-idle states since the last frame
        # Views of the last frame, reused for nodes that did not change: a frame of a big
        # tree then costs one dict lookup per untouched node.
        self._views: dict[int, NodeView] = {}
        self._touched: set[int] = set()  # lock_ref or last access changed
        self._was_marked: set[int] = set()  # non-idle in the last frame (idle again now)
        # Jump-forward: forced positions not computed yet, per request (from JumpForwardEvent);
        # the slots each request was given since the last step (AllocEvent), the slot of its
        # last computed token (for a chunk that starts inside a page it already holds), and
        # the slots that hold forced tokens.
        self._jumps: dict[str, list[tuple[int, int]]] = {}
        self._new_slots: dict[str, list[int]] = {}
        self._last_slot: dict[str, int] = {}
        self._forced_slots: set[int] = set()

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
        self.tree.apply(event)
        handler(self, event)
        self._pending.append(event)
        self._time = event.time
        if (
            self.every_event
            or isinstance(event, StepEvent)
            or (isinstance(event, ResetEvent) and event.source == RESET_SOURCE)
        ):
            self.snapshot()

    def _concerns_us(self, event: Event) -> bool:
        """False for another pool's events (e.g. the vLLM block pool sharing the bus)."""
        if isinstance(event, ResetEvent):
            return event.source in (RESET_SOURCE, self.pool_name)
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

    # The tree has applied the event already (self.tree); these add what a frame shows.
    def _on_match(self, e: MatchEvent) -> None:
        for i in e.path:
            self._mark(i, "accessed")

    def _on_insert(self, e: InsertEvent) -> None:
        self._on_match(e)
        if e.node_id is None:
            return
        self._labels[e.node_id] = self._label(e.key, e.value)
        self.layout.add(e.node_id)
        self._mark(e.node_id, "added")
        self._set_owner(e.value, e.node_id)

    def _on_split(self, e: SplitEvent) -> None:
        prefix, suffix = self.tree.nodes[e.node_id], self.tree.nodes[e.new_node_id]
        self._labels[e.node_id] = self._label(prefix.key, prefix.value)
        self._labels[e.new_node_id] = self._label(suffix.key, suffix.value)
        self.layout.split(e.node_id, e.new_node_id)
        # The lower half is "split" (grey, cut) unless its tokens were already added or
        # accessed since the last frame: then it keeps that colour.
        self._mark(e.new_node_id, self._states.get(e.node_id, "split"))
        self._mark(e.new_node_id, "split")
        self._mark(e.node_id, "split")
        self._set_owner(suffix.value, e.new_node_id)
        if suffix.host_value:
            self._set_owner(suffix.host_value, e.new_node_id, host=True)

    def _on_lock(self, e: LockEvent | UnlockEvent) -> None:
        self._touched.update(e.node_ids)

    def _on_evict(self, e: EvictEvent) -> None:
        self._mark(e.node_id, "evicted")
        node = self.tree.evicted[e.node_id]
        self._set_owner(node.value, None)
        if node.host_value:  # not for HiRadixCache (a backed-up node is demoted instead)
            self._set_owner(node.host_value, None, host=True)

    def _on_reset(self, e: ResetEvent) -> None:
        if e.source == RESET_SOURCE:  # the tree evicted every node
            for i, node in self.tree.evicted.items():
                self._mark(i, "evicted")
                self._set_owner(node.value, None)
                if node.host_value:
                    self._set_owner(node.host_value, None, host=True)
            # The cache hands out ids from 0 again: ghosts are dropped with this frame.
        else:  # the pool
            self._owner = [None] * len(self._owner)
            self._pool_view = None

    # Tiers (HiRadixCache).
    def _tier_mark(self, node_id: int, mark: str) -> None:
        if not self.tiered:  # the first tier event: from now on every view shows tiers
            self.tiered = True
            self._views.clear()
        marks = self._marks.setdefault(node_id, [])
        if mark not in marks:
            marks.append(mark)

    def _on_backup(self, e: BackupEvent) -> None:
        to_disk = e.medium == "STORAGE"
        for i in e.node_ids:
            self._tier_mark(i, "stored" if to_disk else "backed_up")
            if not to_disk:
                self._set_owner(self.tree.nodes[i].host_value, i, host=True)

    def _on_demote(self, e: DemoteEvent) -> None:
        self._tier_mark(e.node_id, "demoted")
        self._set_owner(e.value, None)

    def _on_load_back(self, e: LoadBackEvent) -> None:
        for i in e.node_ids:
            self._tier_mark(i, "recomputed" if e.recomputed else "loaded_back")
            self._set_owner(self.tree.nodes[i].value, i)

    def _on_host_evict(self, e: HostEvictEvent) -> None:
        self._mark(e.node_id, "evicted")
        self._tier_mark(e.node_id, "host_evicted")
        self._set_owner(e.host_value, None, host=True)

    def _on_prefetch(self, e: PrefetchEvent) -> None:
        self._labels[e.node_id] = self._label(e.key)
        self.layout.add(e.node_id)
        self._mark(e.node_id, "added")
        self._tier_mark(e.node_id, "prefetched")
        self._set_owner(e.host_value, e.node_id, host=True)

    def _on_step(self, e: StepEvent) -> None:
        # The step's cache and pool events came before it (LLMEngine.step publishes it last),
        # so the frame it ends shows the step's whole effect.
        self.num_steps += 1
        self._step = StepView.from_event(self.num_steps, e)
        self._place_forced(e)

    def _on_jump(self, e: JumpForwardEvent) -> None:
        self._jumps.setdefault(e.rid, []).append((e.start, e.start + e.num_tokens))

    def _place_forced(self, e: StepEvent) -> None:
        """Find the slots of the forced positions this step computed, and relabel the tree
        nodes that already hold them (a prefill chunk enters the tree before the step ends).

        Request ``rid`` computed positions ``start .. start + n - 1``: the first ones in the page
        it already holds (the slots after its last one), the rest in the slots allocated to it
        in this step, in order (:meth:`minirad.engine.scheduler.Scheduler._allocate`).
        """
        forced: set[int] = set()
        for rid, start, n in zip(e.rids, e.starts, e.num_tokens, strict=True):
            fresh = self._new_slots.pop(rid, [])
            in_page = n - len(fresh)
            last = self._last_slot.get(rid)
            if in_page < 0 or (in_page and last is None):
                slots: list[int | None] = [None] * n  # not from this builder's events: unknown
            else:
                slots = [*range(last + 1, last + 1 + in_page), *fresh] if in_page else fresh
            if n and slots[-1] is not None:
                self._last_slot[rid] = slots[-1]
            end, left = start + n, []
            for a, b in self._jumps.get(rid, ()):
                forced.update(slots[p - start] for p in range(max(a, start), min(b, end)))
                if b > end:  # positions before `start` were matched from the cache, not computed
                    left.append((max(a, end), b))
            if left:
                self._jumps[rid] = left
            else:
                self._jumps.pop(rid, None)
        for rid in (*e.finished, *e.preempted):  # a preempted request's KV is gone
            self._last_slot.pop(rid, None)
            self._new_slots.pop(rid, None)
        for rid in e.finished:
            self._jumps.pop(rid, None)
        self._new_slots.clear()  # a request allocated but not scheduled gave its slots back
        forced.discard(None)
        if not forced:
            return
        self._forced_slots |= forced
        pages = {s // self.page_size for s in forced}
        for i in {self._owner[p] for p in pages if p < len(self._owner)}:
            if isinstance(i, int) and i in self.tree.nodes:
                node = self.tree.nodes[i]
                self._labels[i] = self._label(node.key, node.value)
                self._touched.add(i)

    def _on_alloc(self, e: AllocEvent) -> None:
        self._set_owner(e.ids, e.owner if e.owner is not None else "request")
        if self._forced_slots:
            self._forced_slots.difference_update(e.ids)  # fresh slots hold new tokens
        # Only an engine's requests need their slots followed (a cache replay sends no steps
        # and no jumps: nothing is kept for it).
        if e.owner is not None and (self.num_steps or e.owner in self._jumps):
            self._new_slots.setdefault(e.owner, []).extend(e.ids)

    def _on_free(self, e: FreeEvent) -> None:
        self._set_owner(e.ids, None)

    def _set_owner(
        self, slots: Sequence[int], owner: int | str | None, *, host: bool = False
    ) -> None:
        """Give the pages of ``slots`` to ``owner`` in the device pool (or the host pool)."""
        if not slots:
            return
        ps = self.page_size
        table = self._host_owner if host else self._owner
        need = max(slots) // ps + 1
        if need > len(table):
            if self._fixed_host if host else self._fixed_pool:
                which = "host pool" if host else "pool"
                raise ValueError(f"slot {max(slots)} is beyond the {which} of {len(table)}")
            table.extend([None] * (need - len(table)))
        for s in slots:
            table[s // ps] = owner
        if host:
            self._host_pool_view = None
        else:
            self._pool_view = None

    # ------------------------------------------------------------------ labels
    def _is_image(self, t: int) -> bool:
        return t in self.images or (self.vocab_size is not None and t >= self.vocab_size)

    def _image_name(self, t: int) -> str:
        if t in self.images:
            return self.images[t]
        digits = f"{t - self.vocab_size:x}"  # a whole image hash, or a small test id
        return f"img #{digits[:6]}…" if len(digits) > 6 else f"img #{digits}"

    def _text(self, ids: list[int]) -> str:
        if self.decode is None:
            return " ".join(map(str, ids)) + " "
        return self.decode(ids)

    def _label(self, key: tuple[int, ...], value: Sequence[int] = ()) -> Label:
        """Decode an edge: text runs through ``decode``, image runs (pad ids) as chips, and
        the tokens whose KV slot (``value``) holds a forced token as ``"forced"`` runs."""
        forced_slots = self._forced_slots
        if forced_slots and len(value) == len(key):
            marks = [s in forced_slots for s in value]
        else:
            marks = [False] * len(key)
        runs: list[tuple[str, str]] = []
        images, forced = [], []
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
                continue
            # A text run: split where the marks change (one run when nothing is forced).
            start = offset
            for is_forced, group_marks in itertools.groupby(marks[start : start + len(ids)]):
                k = len(list(group_marks))
                chunk = ids[offset - start : offset - start + k]
                if is_forced:
                    forced.append((offset, k))
                runs.append(("forced" if is_forced else "text", self._text(chunk)))
                offset += k
        full = "".join(t if k != "image" else f"[{t}]" for k, t in runs)
        if len(full) > FULL_TEXT_CHARS:
            full = full[: FULL_TEXT_CHARS - 1] + "…"
        parts, room = [], self.max_chars
        for kind, t in runs:
            if room <= 0:
                break
            t = t.replace("\n", "⏎") if kind != "image" else t
            if len(t) > room and kind != "image":  # a chip is whole: its name is the image's
                t = t[: max(room - 1, 0)] + "…"
            parts.append((kind, t))
            room -= len(t)
        self._num_labels += 1
        return Label(
            self._num_labels - 1, tuple(parts), full, key[:16], tuple(images), tuple(forced)
        )

    # ------------------------------------------------------------------ output
    def _pool_of(self, owners: list[int | str | None]) -> PoolView:
        runs, start = [], 0
        for owner, group in itertools.groupby(owners):
            n = len(list(group))
            runs.append((start, n, owner))
            start += n
        return PoolView(len(owners), self.page_size, tuple(runs))

    def _pool(self) -> PoolView:
        if self._pool_view is None:
            self._pool_view = self._pool_of(self._owner)
        return self._pool_view

    def _host_pool(self) -> PoolView | None:
        if not self.tiered:
            return None
        if self._host_pool_view is None:
            self._host_pool_view = self._pool_of(self._host_owner)
        return self._host_pool_view

    def _caption(self) -> str:
        events = self._pending
        notable = [
            e.describe()
            for e in events
            if isinstance(e, _NOTABLE) or (isinstance(e, InsertEvent) and e.node_id is not None)
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
        layout, states, cache, tree = self.layout, self._states, self._views, self.tree
        marks, tiered = self._marks, self.tiered
        changed = self._touched | self._was_marked | layout.moved | states.keys() | marks.keys()
        views = []
        for table in (tree.nodes, tree.evicted):
            for i, n in table.items():
                v = cache.get(i)
                if v is None or i in changed:
                    v = cache[i] = NodeView(
                        i,
                        n.parent,
                        layout.col[i],
                        layout.depth[i],
                        len(n.key),
                        n.lock_ref,
                        n.last_access,
                        states.get(i, "idle"),
                        self._labels.get(i),
                        n.extra_key,
                        n.tiers if tiered else None,
                        tuple(marks.get(i, ())),
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
            self._host_pool(),
        )
        self.frames.append(frame)
        self._pending = []
        self._step = None
        self._was_marked = set(states) | marks.keys()
        self._states = {}
        self._marks = {}
        self._touched = set()
        layout.moved.clear()
        if tree.evicted:
            gone = tree.release()
            for i in gone:
                del cache[i], self._labels[i]
            layout.release(gone)
            if len(tree.nodes) == 1:  # after a reset: columns start from 0 again
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
    JumpForwardEvent: FrameBuilder._on_jump,
    BackupEvent: FrameBuilder._on_backup,
    DemoteEvent: FrameBuilder._on_demote,
    LoadBackEvent: FrameBuilder._on_load_back,
    HostEvictEvent: FrameBuilder._on_host_evict,
    PrefetchEvent: FrameBuilder._on_prefetch,
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
