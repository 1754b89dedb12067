"""Eviction policies for the radix cache: which unlocked leaf goes first.

A policy maps a node to a sort key; ``RadixCache.evict`` pops the smallest key first. Every key
ends with the node's ``id`` so that ties break the same way on every run (SGLang compares
``time.monotonic()`` stamps and leaves ties to the heap; see
``sglang/srt/mem_cache/evict_policy.py``).

- ``lru``: least recently used first (``last_access_time``), the paper's policy (§3.1).
- ``lfu``: least frequently hit first (``hit_count``), then least recently used.
- ``fifo``: oldest insertion first (``creation_time``), blind to reuse.

:class:`ClosedSessionLRUPolicy` (``lru-closed``) is reuse-aware: LRU, except that the tokens of
conversations known to be over go first. It needs one fact from the caller, when a session
closes (the client's last turn, or SGLang's ``close_session``), so it is not in
:data:`POLICIES`; ``python -m minirad.bench radix`` runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from minirad.errors import InvalidArgumentError
from minirad.kvcache.tokens import as_token_ids

if TYPE_CHECKING:
    from minirad.kvcache.radix_cache import TreeNode

__all__ = [
    "POLICIES",
    "ClosedSessionLRUPolicy",
    "EvictionPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "get_policy",
]


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


class ClosedSessionLRUPolicy:
    """LRU among the leaves of open sessions, after every leaf of a closed session.

    A session's tokens are reused only by its next turn; once the client has closed it (its
    last request finished), they are dead weight, and LRU would keep them as long as any
    other idle conversation. This policy uses only what a server knows online: which slots
    belong to closed sessions, as the caller reports with :meth:`close`.

    The mark is read from a leaf's last slot, which holds the leaf's newest token. The caller
    marks a closing session's own slots (not a shared prefix such as its system prompt) before
    :meth:`RadixCache.cache_finished_req` makes them evictable, and clears slots that the
    allocator hands out again with :meth:`reopen`. (A mark that changes while its leaf is
    already evictable takes effect when eviction next reaches the leaf's old place.)

    Raises:
        InvalidKeyError: from :meth:`close` / :meth:`reopen`, slots that are not ints >= 0.
    """

    name = "lru-closed"

    def __init__(self) -> None:
        self.closed: set[int] = set()  # a set, not a mask: slot ids of any size, C-speed updates

    def close(self, slots: Sequence[int]) -> None:
        """Mark ``slots`` as tokens of a closed session."""
        self.closed.update(as_token_ids(slots, "slots"))

    def reopen(self, slots: Sequence[int]) -> None:
        """Clear the mark of freshly allocated ``slots``."""
        self.closed.difference_update(as_token_ids(slots, "slots"))

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        return (0 if node.value[-1] in self.closed else 1, node.last_access_time, node.id)


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
