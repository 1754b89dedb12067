"""The radix tree rebuilt from the cache's events alone: what a visualizer or a peer can know.

One :class:`EventTree` is shared by every consumer that needs the tree's shape without
reading the cache: :class:`minirad.course.scenario.ScenarioReplay` (what a step did),
:class:`viz.frame_builder.FrameBuilder` and its :class:`viz.layout.StableLayout` (the
frames), :class:`minirad.kv_events.block_events.BlockEventPublisher` (vLLM's block events).

The rules are those of :class:`minirad.kvcache.radix_cache.RadixCache` (after SGLang's
``mem_cache/radix_cache.py``), as its events tell them:

- insert adds a leaf under ``parent_id``, walked at the event's time;
- split cuts an edge: the prefix keeps the id, the suffix (``new_node_id``) takes the
  children and the ``lock_ref``; both are walked at the split's time;
- match and insert set ``last_access`` on every node of their path; lock and unlock set
  ``lock_ref``;
- evict removes a leaf; a cache reset evicts every node.

and those of :class:`minirad.kvcache.hiradix_cache.HiRadixCache`'s tiers:

- backup gives nodes a host copy (``host_value``) or marks them ``on_disk``;
- demote drops a node's device slots (it stays, host-only); load-back gives them back;
- evict_host removes a host-only leaf; prefetch adds one, read from disk.

An evicted node is kept, as it was when it left, in :attr:`EventTree.evicted` and in its
parent's ``children``, until :meth:`EventTree.release`: a drawing can then still show it where
it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minirad.events import (
    BackupEvent,
    DemoteEvent,
    Event,
    EvictEvent,
    HostEvictEvent,
    InsertEvent,
    LoadBackEvent,
    LockEvent,
    MatchEvent,
    PrefetchEvent,
    ResetEvent,
    SplitEvent,
    UnlockEvent,
)

__all__ = ["RESET_SOURCE", "EventNode", "EventTree"]

RESET_SOURCE = "radix_cache"  # ResetEvent.source of a cache reset (a pool's reset is not one)


@dataclass(slots=True)
class EventNode:
    """A node as the events describe it.

    Attributes:
        id: the cache's ``TreeNode.id`` (0 is the root).
        parent: the parent's id (None for the root).
        key, value: the edge's token ids and KV slot indices.
        children: child ids in creation order (evicted ones until :meth:`EventTree.release`).
        lock_ref: running requests whose path passes through the node.
        last_access: logical time of the last match or insert that walked it.
        extra_key: the insert's ``extra_key`` (e.g. a LoRA or image-set key), or None.
        host_value: the host slots of the node's copy in the host pool, or None.
        on_disk: its pages were written to the disk tier.
    """

    id: int
    parent: int | None
    key: tuple[int, ...]
    value: tuple[int, ...] = ()
    children: list[int] = field(default_factory=list)
    lock_ref: int = 0
    last_access: int = 0
    extra_key: str | None = None
    host_value: tuple[int, ...] | None = None
    on_disk: bool = False

    @property
    def tiers(self) -> tuple[str, ...]:
        """Where its KV is: some of ``"device"``, ``"host"``, ``"disk"``, in that order."""
        on = (bool(self.value) or not self.key, self.host_value is not None, self.on_disk)
        return tuple(t for t, o in zip(("device", "host", "disk"), on, strict=True) if o)


class EventTree:
    """The tree's shape and per-node state, updated by :meth:`apply` (a bus subscriber).

    Attributes:
        nodes: id -> node, for the nodes in the tree (root included).
        evicted: id -> node, for the nodes evicted since the last :meth:`release`.
    """

    def __init__(self) -> None:
        self.nodes: dict[int, EventNode] = {0: EventNode(0, None, ())}
        self.evicted: dict[int, EventNode] = {}

    def apply(self, event: Event) -> None:
        """Update the tree for one event; other kinds (pool, step...) change nothing.

        Raises:
            KeyError: the event names a node the tree does not hold (events out of order,
                or a tree attached after the cache's first insert).
        """
        if isinstance(event, MatchEvent | InsertEvent):
            for i in event.path:
                self.nodes[i].last_access = event.time
        if isinstance(event, InsertEvent) and event.node_id is not None:
            self.nodes[event.node_id] = EventNode(
                event.node_id,
                event.parent_id,
                event.key,
                event.value,
                last_access=event.time,
                extra_key=event.extra_key,
            )
            self.nodes[event.parent_id].children.append(event.node_id)
        elif isinstance(event, SplitEvent):
            prefix, m = self.nodes[event.node_id], event.split_len
            suffix = EventNode(
                event.new_node_id,
                prefix.id,
                prefix.key[m:],
                prefix.value[m:],
                prefix.children,
                prefix.lock_ref,
                event.time,
                prefix.extra_key,
                None if prefix.host_value is None else prefix.host_value[m:],
                prefix.on_disk,
            )
            if prefix.host_value is not None:
                prefix.host_value = prefix.host_value[:m]
            for c in suffix.children:  # a child may be a ghost not yet released
                (self.nodes.get(c) or self.evicted[c]).parent = suffix.id
            prefix.key, prefix.value = prefix.key[:m], prefix.value[:m]
            prefix.children = [suffix.id]
            prefix.last_access = event.time
            self.nodes[suffix.id] = suffix
        elif isinstance(event, LockEvent | UnlockEvent):
            for i, ref in zip(event.node_ids, event.lock_refs, strict=True):
                self.nodes[i].lock_ref = ref
        elif isinstance(event, EvictEvent | HostEvictEvent):
            self._evict(event.node_id)
        elif isinstance(event, BackupEvent):
            host = iter(event.host_value)
            for i in event.node_ids:
                node = self.nodes[i]
                if event.medium == "STORAGE":
                    node.on_disk = True
                else:
                    node.host_value = tuple(next(host) for _ in node.key)
        elif isinstance(event, DemoteEvent):
            self.nodes[event.node_id].value = ()
        elif isinstance(event, LoadBackEvent):
            device = iter(event.value)
            for i in event.node_ids:
                node = self.nodes[i]
                node.value = tuple(next(device) for _ in node.key)
                node.last_access = event.time
        elif isinstance(event, PrefetchEvent):
            self.nodes[event.node_id] = EventNode(
                event.node_id,
                event.parent_id,
                event.key,
                last_access=event.time,
                extra_key=event.extra_key,
                host_value=event.host_value,
                on_disk=True,
            )
            self.nodes[event.parent_id].children.append(event.node_id)
        elif isinstance(event, ResetEvent) and event.source == RESET_SOURCE:
            for i in [i for i in self.nodes if i != 0]:
                self._evict(i)

    def _evict(self, node_id: int) -> None:
        node = self.nodes.pop(node_id)
        node.lock_ref = 0
        self.evicted[node_id] = node

    def release(self) -> dict[int, EventNode]:
        """Forget the evicted nodes (they leave their parents' ``children``); returns them."""
        gone, self.evicted = self.evicted, {}
        for node in gone.values():
            parent = self.nodes.get(node.parent)
            if parent is not None:  # else the parent was evicted too
                parent.children.remove(node.id)
        return gone
