"""The radix tree's node, and what a match returns: the data :mod:`~minirad.kvcache.radix_tree`
walks.

A :class:`TreeNode` is one edge of the tree and the node at its end: the run of token ids on the
edge (``key``), the KV slots that hold their keys and values (``value``, one slot per token, also
as the array ``value_buf``), the locks of the running requests whose prefix passes through it
(``lock_ref``), and what the eviction policies rank it by (times, counts, priority, depth).
``key_buf`` and ``value_buf`` are ``key`` and ``value`` as arrays, which the walk and eviction
read in C; the tree keeps the four in step (``check_invariants`` checks it).

Component seam (SGLang 0.5.23's ``UnifiedRadixCache``): there a node carries data per cache
component, Full and SWA (sliding-window attention), each with its own value, ``lock_ref`` and
place in its own LRU list. Here ``value``, ``value_buf`` and ``lock_ref`` are the one (full)
component's; a component's fields go beside them in ``__slots__``. A node whose SWA value is
None while its full value stays is a *tombstone*: its tokens are cached for full attention
only, and a match may not end on them.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

import numpy as np

from minirad.events import plural

__all__ = ["MatchResult", "TreeNode"]

# The value_buf of a node created without slots (the root).
_NO_SLOTS = np.zeros(0, dtype=np.int64)


class TreeNode:
    """One node of the radix tree; ``key``/``value`` describe the edge from ``parent``.

    Attributes:
        id: stable display id (the root is 0).
        key: token ids on the edge into this node (empty for the root).
        value: KV slot indices, one per token of ``key``.
        children: child nodes keyed by the child key of their edge (first token, or first
            page as a tuple when ``page_size > 1``; ``(extra_key, that)`` when namespaced).
        parent: the parent node (None for the root and for evicted nodes).
        lock_ref: number of running requests whose matched path passes through this node.
        last_access_time: logical time of the last match or insert that walked this node.
        creation_time: logical time at which these tokens were inserted.
        hit_count: number of ``match_prefix`` calls that walked through this node.
        insert_count: number of inserts that walked or created this node, each request counted
            once (SGLang's ``hit_count``): an insert does not count again the tokens its
            request had already inserted (``inserted_len``). Read by ``slru``.
        priority: the highest ``priority`` of the inserts that walked or created this node
            (SGLang's ``priority``; 0 by default). Never lower than a child's. Read by
            ``priority``.
        depth: tokens from the root to the end of this node (SGLang's
            ``_tlru_cached_prefix_len``).
        history_len: the deepest ``depth`` of this node and of any node created below it since
            it was, evicted ones included (SGLang's ``_tlru_history_len``): the ``L`` of
            ``tlru``.
        extra_key: namespace of the subtree (LoRA id, cache salt), or None.
        key_buf: ``key`` as an ``array("Q")`` (None if an id needs 64 bits or more), which
            edge matching compares with a C ``memcmp``.
        value_buf: ``value`` as an int64 numpy array, which eviction hands to the registry
            and the allocator without reading each slot's Python int again.
        heap_seq: the push count of the node's latest entry in the eviction heap.
    """

    __slots__ = (
        "id",
        "key",
        "value",
        "children",
        "parent",
        "lock_ref",
        "last_access_time",
        "creation_time",
        "hit_count",
        "insert_count",
        "priority",
        "depth",
        "history_len",
        "extra_key",
        "key_buf",
        "value_buf",
        "heap_seq",
    )

    def __init__(
        self,
        id: int,
        key: list[int],
        value: list[int],
        parent: TreeNode | None,
        time: int,
        extra_key: str | None = None,
    ) -> None:
        self.id = id
        self.key = key
        self.value = value
        self.children: dict = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access_time = time
        self.creation_time = time
        self.hit_count = 0
        self.insert_count = 0
        self.priority = 0
        self.depth = len(key) + (parent.depth if parent is not None else 0)
        self.history_len = self.depth
        self.extra_key = extra_key
        self.key_buf: array | None = None
        self.value_buf = _NO_SLOTS
        self.heap_seq = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        head = self.key[:8]
        more = ", ..." if len(self.key) > 8 else ""
        return (
            f"TreeNode(id={self.id}, key=[{', '.join(map(str, head))}{more}] "
            f"({plural(len(self.key), 'token')}), lock_ref={self.lock_ref})"
        )


class MatchResult(NamedTuple):
    """What :meth:`RadixCache.match_prefix` found.

    Attributes:
        indices: KV slot indices of the matched prefix, one per token.
        last_node: the deepest matched node (the root when nothing matched). Lock it with
            :meth:`RadixCache.inc_lock_ref` to keep the prefix from being evicted.
    """

    indices: list[int]
    last_node: TreeNode
