"""The radix cache's events: one hook that turns what the tree just did into an event.

:class:`RadixEventsMixin` keeps the publishing out of the algorithm (SGLang keeps its KV events
in a mixin too): the tree calls ``self._record(EventClass, time, *objects)`` with the nodes it
touched, and the event is built from them only when the bus has a subscriber.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from minirad.events import (
    BackupEvent,
    DemoteEvent,
    Event,
    EventBus,
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

if TYPE_CHECKING:
    from minirad.kvcache.radix_cache import TreeNode

__all__ = ["RadixEventsMixin"]


def _ids(nodes: Iterable[TreeNode]) -> tuple[int, ...]:
    return tuple(n.id for n in nodes)


def _match(t: int, walked: list[TreeNode], matched: int, query_len: int, extra_key) -> Event:
    return MatchEvent(t, _ids(walked), matched, query_len, extra_key)


def _insert(t: int, walked, prefix_len: int, parent: TreeNode, leaf, extra_key) -> Event:
    if leaf is None:  # the whole key was cached already
        return InsertEvent(t, _ids(walked), prefix_len, None, None, (), (), extra_key)
    key, value = tuple(leaf.key), tuple(leaf.value)
    return InsertEvent(t, _ids(walked), prefix_len, leaf.id, parent.id, key, value, extra_key)


def _split(t: int, prefix: TreeNode, suffix: TreeNode, split_len: int) -> Event:
    return SplitEvent(t, prefix.id, suffix.id, split_len)


def _evict(t: int, leaf: TreeNode) -> Event:
    return EvictEvent(t, leaf.id, len(leaf.value), tuple(leaf.value))


def _lock(t: int, path: list[TreeNode]) -> Event | None:
    return LockEvent(t, _ids(path), tuple(n.lock_ref for n in path)) if path else None


def _unlock(t: int, path: list[TreeNode]) -> Event | None:
    return UnlockEvent(t, _ids(path), tuple(n.lock_ref for n in path)) if path else None


def _reset(t: int) -> Event:
    return ResetEvent(t, "radix_cache")


# The tiers' events (HiRadixCache): built before the node's slots change.
def _backup(t: int, path: list[TreeNode], host: list[int], medium: str) -> Event:
    return BackupEvent(t, _ids(path), tuple(host), medium)


def _demote(t: int, leaf: TreeNode) -> Event:
    return DemoteEvent(t, leaf.id, len(leaf.value), tuple(leaf.value))


def _load_back(t: int, path: list[TreeNode], device: list[int], recomputed: bool) -> Event:
    return LoadBackEvent(t, _ids(path), tuple(device), recomputed)


def _evict_host(t: int, leaf: TreeNode) -> Event:
    return HostEvictEvent(t, leaf.id, len(leaf.host_value), tuple(leaf.host_value))


def _prefetch(t: int, leaf: TreeNode) -> Event:
    key, host = tuple(leaf.key), tuple(leaf.host_value)
    return PrefetchEvent(t, leaf.id, leaf.parent.id, key, host, leaf.extra_key)


_BUILDERS: dict[type[Event], Callable[..., Event | None]] = {
    MatchEvent: _match,
    InsertEvent: _insert,
    SplitEvent: _split,
    EvictEvent: _evict,
    LockEvent: _lock,
    UnlockEvent: _unlock,
    ResetEvent: _reset,
    BackupEvent: _backup,
    DemoteEvent: _demote,
    LoadBackEvent: _load_back,
    HostEvictEvent: _evict_host,
    PrefetchEvent: _prefetch,
}


class RadixEventsMixin:
    """Publishes the radix cache's operations on its :class:`~minirad.events.EventBus`.

    One hook, :meth:`_record`, for every kind: a match (the path walked), an insert (the new
    leaf), a split, an evicted leaf, a lock or unlock (the path and its new ``lock_ref``s), a
    reset. Without subscribers it costs one call and one test.
    """

    bus: EventBus

    def _record(self, kind: type[Event], t: int, *what: Any) -> None:
        """Publish a ``kind`` event at time ``t``, built from the tree objects ``what``."""
        if self.bus.active:
            event = _BUILDERS[kind](t, *what)
            if event is not None:
                self.bus.emit(event)
