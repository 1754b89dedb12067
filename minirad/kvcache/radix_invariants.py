"""The radix cache's invariants: :meth:`~RadixInvariantsMixin.check_invariants`.

The tests and the property checks call it after the operations they drive: it walks the tree and
recounts what the other parts keep incrementally (sizes, the evictable leaves and their heap
entries, the slots the tree owns), and checks each node against its parent. A tiered cache
(``hiradix_cache.py``) extends it, and says through :meth:`~RadixInvariantsMixin._device_leaf`
and :meth:`~RadixInvariantsMixin._host_only` which of its nodes hold no device KV.

Component seam (SGLang 0.5.23's ``UnifiedRadixCache``): :meth:`~RadixInvariantsMixin._check_node`
checks one node's values; each component's value, ``lock_ref`` and LRU membership will be
checked there (a tombstone has no SWA value but keeps its full one), and
:meth:`~RadixInvariantsMixin._check_totals` recounts each component's sizes and pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from minirad.errors import InvalidKeyError, InvariantError
from minirad.kvcache.kv_pool import PAGE_CACHED

if TYPE_CHECKING:
    from minirad.kvcache.radix_node import TreeNode

__all__ = ["RadixInvariantsMixin"]


class RadixInvariantsMixin:
    """Recount and recheck the tree. A part of RadixCache: it reads the state of the other
    parts (``radix_tree.py``, ``radix_slots.py``, ``radix_evict.py``, ``radix_locks.py``)."""

    def check_invariants(self) -> None:
        """Verify the tree's bookkeeping; raise :class:`InvariantError` on the first breach.

        Checked: parent/child links and child keys; key/value lengths (whole pages, non-empty);
        no slot owned twice (and none free in the allocator); ``lock_ref`` of a parent at least
        the sum of its children's; depths, branch histories and priorities consistent with the
        parent's; evictable/protected sizes; the evictable-leaf set.
        """
        root = self.root_node
        if root.lock_ref != 1 or root.key or root.value or root.parent is not None:
            raise InvariantError("root must have lock_ref 1, an empty key/value and no parent")
        seen: list[int] = []
        evictable = protected = 0
        leaves = set()
        stack = [root]
        while stack:
            node = stack.pop()
            # The root's lock_ref is a constant 1 (it is never on a lock path), so only
            # real nodes must cover their children's locks.
            locks_below = sum(c.lock_ref for c in node.children.values())
            if node is not root and locks_below > node.lock_ref:
                raise InvariantError(f"node {node.id}: children hold more locks than the node")
            for ck, child in node.children.items():
                self._check_node(node, ck, child)
                seen += child.value
                if child.lock_ref:
                    protected += len(child.value)
                else:
                    evictable += len(child.value)
                    if child.value and self._device_leaf(child):
                        leaves.add(child)
                stack.append(child)
        self._check_totals(seen, evictable, protected, leaves)

    def _device_leaf(self, node: TreeNode) -> bool:
        """True if no child of ``node`` holds KV slots: an eviction candidate once unlocked.
        Here, a node without children; a tiered cache's host-only children hold none."""
        return not node.children

    def _host_only(self, node: TreeNode) -> bool:
        """True if ``node`` holds its KV in host memory only (never here: see HiRadixCache)."""
        return False

    def _check_node(self, parent: TreeNode, ck, child: TreeNode) -> None:
        """One node's own invariants (see :meth:`check_invariants`). Component seam: each
        component's value and ``lock_ref`` are checked here."""

        def fail(msg: str) -> None:
            raise InvariantError(f"node {child.id}: {msg}")

        if child.parent is not parent:
            fail("parent link broken")
        if ck != self._child_key(child.key, 0, child.extra_key):
            fail(f"stored under child key {ck!r}")
        if not child.key or len(child.key) != len(child.value) and not self._host_only(child):
            fail(f"key/value lengths {len(child.key)}/{len(child.value)}")
        if len(child.key) % self.page_size:
            fail(f"key length {len(child.key)} is not whole pages")
        if self.page_size > 1:
            try:
                self._check_whole_pages(np.asarray(child.value, dtype=np.int64))
            except InvalidKeyError as e:
                fail(str(e))
        if child.lock_ref < 0:
            fail("negative lock_ref")
        if child.depth != parent.depth + len(child.key):
            fail(f"depth {child.depth}, parent's {parent.depth} + {len(child.key)} tokens")
        if not child.depth <= child.history_len <= parent.history_len:
            fail(f"history_len {child.history_len} not in [its depth, its parent's]")
        if parent is not self.root_node and child.priority > parent.priority:
            fail(f"priority {child.priority} above its parent's {parent.priority}")
        if child.value_buf.tolist() != child.value or (
            child.key_buf is not None and child.key_buf.tolist() != child.key
        ):
            fail("key_buf/value_buf differ from key/value")

    def _check_totals(self, seen: list[int], evictable: int, protected: int, leaves: set) -> None:
        """The tree-wide invariants, from the slots, sizes and leaves a walk counted."""

        def fail(msg: str) -> None:
            raise InvariantError(msg)

        if len(set(seen)) != len(seen):
            fail("a slot is owned by two nodes")
        owned = np.repeat(self._state == PAGE_CACHED, self.page_size)
        if set(seen) != set(np.flatnonzero(owned).tolist()):
            fail("slot registry out of sync with the tree")
        if (evictable, protected) != (self.evictable_size_, self.protected_size_):
            fail(
                f"sizes: counted evictable={evictable} protected={protected}, recorded "
                f"{self.evictable_size_}/{self.protected_size_}"
            )
        if leaves != self.evictable_leaves:
            fail("evictable-leaf set out of sync with the tree")
        if not leaves <= {e[3] for e in self._evict_heap if e[2] == e[3].heap_seq}:
            fail("an evictable leaf has no entry in the eviction heap")
        alloc = self.token_to_kv_pool_allocator
        if alloc is not None and not all(alloc.is_allocated(s) for s in seen):
            fail("the tree owns a slot that the allocator thinks is free")
