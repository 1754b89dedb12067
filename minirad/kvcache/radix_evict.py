"""Eviction from the radix tree: the evictable leaves, their heap, and :meth:`evict`.

When the KV pool runs short, the scheduler asks the cache to :meth:`~RadixEvictionMixin.evict`
some tokens. Only an unlocked leaf may go (its KV is no request's, and no cached prefix runs
through it), in the order of the cache's :class:`~minirad.kvcache.eviction.EvictionPolicy`
(``lru`` by default); a parent left an unlocked leaf joins the candidates at once (cascading
eviction, as in SGLang). The candidates are ``evictable_leaves``, ranked in a heap that is kept
between calls: the tree (``radix_tree.py``) and the locks (``radix_locks.py``) call
:meth:`~RadixEvictionMixin._add_evictable` for a new candidate and
:meth:`~RadixEvictionMixin._push_evictable` for one whose rank may have changed. ``reset``
drops the whole tree.

Component seams (SGLang 0.5.23's ``UnifiedRadixCache``, cascade eviction Full > SWA), marked
"Component seam" in the code: :meth:`~RadixEvictionMixin.evict` takes a leaf's ``value``
(collected, then released in one call) and :meth:`~RadixEvictionMixin._delete_leaf` takes the
node out of the tree. Evicting a Full leaf frees its SWA value too and deletes the node; an SWA
eviction frees only the SWA value of a node, which stays as a tombstone (with its own LRU list
and candidates, one heap per component).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from minirad.errors import InvalidArgumentError, LockError
from minirad.events import EvictEvent, ResetEvent
from minirad.kvcache.radix_slots import _as_slots

if TYPE_CHECKING:
    from minirad.kvcache.radix_node import TreeNode

__all__ = ["RadixEvictionMixin"]


class RadixEvictionMixin:
    """The unlocked leaves, ranked by ``eviction_policy``; :meth:`evict` and :meth:`reset`. A
    part of RadixCache: it uses the tree's attributes (``radix_tree.py``)."""

    def _init_tree(self) -> None:
        super()._init_tree()
        self.evictable_leaves: set[TreeNode] = set()
        # A heap of (priority, id, seq, node) over the evictable leaves, kept between calls.
        # Entries go stale when a leaf is locked, deleted or touched; evict() skips those, and
        # every change pushes a fresh entry. (SGLang rebuilds a heap of all leaves per call.)
        self._evict_heap: list[tuple[tuple, int, int, TreeNode]] = []
        self._push_count = 0

    def evict(self, num_tokens: int) -> list[int]:
        """Free at least ``num_tokens`` tokens (whole leaves; may free more) if possible.

        Only unlocked leaves go, in the order of the eviction policy; a parent that becomes an
        unlocked leaf joins the candidates at once (cascading eviction, as in SGLang).

        Returns:
            the freed slot indices (also returned to the allocator, if any). Fewer than
            ``num_tokens`` when nothing else is evictable.

        Raises:
            InvalidArgumentError: ``num_tokens`` is negative.
        """
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        t = self.bus.tick()
        freed: list[int] = []
        victims: list[TreeNode] = []
        while len(freed) < num_tokens and (leaf := self._pop_evictable()) is not None:
            freed += leaf.value  # Component seam: which values an eviction frees
            victims.append(leaf)
            self._delete_leaf(leaf)  # its parent may become an evictable leaf
            self._record(EvictEvent, t, leaf)
        if victims:  # one state update for all victims, from their arrays
            bufs = [v.value_buf for v in victims]
            self._release(freed, bufs[0] if len(bufs) == 1 else np.concatenate(bufs))
        return freed

    def _pop_evictable(self) -> TreeNode | None:
        """Take the leaf the policy evicts first off the heap (None if there is none). Stale
        entries (locked, deleted or touched since their push) are dropped; a leaf whose
        priority changed behind the cache's back (a policy's own state) is ranked again."""
        heap = self._evict_heap
        while heap:
            key, _, seq, node = heapq.heappop(heap)
            if seq == node.heap_seq and node in self.evictable_leaves:
                if self.eviction_policy.priority(node) == key:
                    return node
                self._push_evictable(node)
        return None

    def _add_evictable(self, node: TreeNode) -> None:
        """``node`` became an unlocked leaf: a candidate."""
        self.evictable_leaves.add(node)
        self._push_evictable(node)

    def _push_evictable(self, node: TreeNode) -> None:
        """Rank a candidate (again): its rank may have changed."""
        heap = self._evict_heap
        # The id breaks ties of a custom policy; the push count makes every entry distinct (a
        # leaf locked and unlocked again has two), so nodes themselves are never compared.
        self._push_count += 1
        node.heap_seq = self._push_count
        entry = (self.eviction_policy.priority(node), node.id, self._push_count, node)
        heapq.heappush(heap, entry)
        if len(heap) > 4 * len(self.evictable_leaves) + 1024:  # mostly stale: rebuild
            rank = self.eviction_policy.priority
            heap[:] = [(rank(n), n.id, n.heap_seq, n) for n in self.evictable_leaves]
            heapq.heapify(heap)

    def _delete_leaf(self, node: TreeNode) -> None:
        """Take an evicted leaf out of the tree (its slots are the caller's to release).
        Component seam: a tombstone (SWA value freed) stays; only a Full eviction deletes."""
        parent = node.parent
        simple = self.page_size == 1 and node.extra_key is None  # the child key is the token
        del parent.children[node.key[0] if simple else self._child_key(node.key, 0, node.extra_key)]
        node.parent = None
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
            self._add_evictable(parent)

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Drop the whole tree; its slots go back to the allocator, if there is one.

        Raises:
            LockError: some request still holds a lock (``protected_size() > 0``).
        """
        if self.protected_size_:
            raise LockError(f"cannot reset: {self.protected_size_} tokens are locked")
        alloc = self.token_to_kv_pool_allocator
        if alloc is None or alloc.generation == self._generation:  # else: all free already
            freed = self.all_values_flatten()
            self._release(freed, _as_slots(freed, "slots")[1])
        self._init_tree()
        self._record(ResetEvent, self.bus.tick())
