"""Eviction policies for the radix cache: which unlocked leaf goes first.

A policy maps a node to a sort key; ``RadixCache.evict`` pops the smallest key first. Every key
ends with the node's ``id`` so that ties break the same way on every run (SGLang compares
``time.monotonic()`` stamps and leaves ties to the heap; see
``sglang/srt/mem_cache/evict_policy.py``).

- ``lru``: least recently used first (``last_access_time``), the paper's policy (§3.1).
- ``lfu``: least frequently hit first (``hit_count``), then least recently used.
- ``fifo``: oldest insertion first (``creation_time``), blind to reuse.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from .radix_cache import TreeNode

__all__ = ["EvictionPolicy", "FIFOPolicy", "LFUPolicy", "LRUPolicy", "POLICIES", "get_policy"]


class EvictionPolicy(Protocol):
    name: str

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        """Sort key of an evictable leaf: the smallest is evicted first (ties: lowest id)."""
        ...


# attrgetter builds each key tuple in C: eviction ranks every evictable leaf on each call.
class LRUPolicy:
    name = "lru"
    priority = staticmethod(attrgetter("last_access_time", "id"))


class LFUPolicy:
    name = "lfu"
    priority = staticmethod(attrgetter("hit_count", "last_access_time", "id"))


class FIFOPolicy:
    name = "fifo"
    priority = staticmethod(attrgetter("creation_time", "id"))


POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, FIFOPolicy)
}


def get_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from its name (``"lru"``, ``"lfu"``, ``"fifo"``) or as given.

    Raises :class:`InvalidArgumentError` for an unknown name.
    """
    if not isinstance(policy, str):
        if not callable(getattr(policy, "priority", None)):
            raise InvalidArgumentError(f"{policy!r} is not an eviction policy (no priority())")
        return policy
    try:
        return POLICIES[policy]()
    except KeyError:
        raise InvalidArgumentError(
            f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}"
        ) from None
