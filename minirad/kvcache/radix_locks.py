"""Locks on the radix tree: ``lock_ref``, and the evictable and protected sizes.

A running request holds its cached prefix: :meth:`~RadixLocksMixin.inc_lock_ref` on the last
node of its match counts one more ``lock_ref`` on every node of the path to the root (SGLang's
Algorithm 1), and :meth:`~RadixLocksMixin.dec_lock_ref` undoes it when the request moves on or
finishes. A node with ``lock_ref > 0`` is *protected*: its tokens count in ``protected_size()``
and it is no eviction candidate; at 0 they count in ``evictable_size()``, and an unlocked leaf
is a candidate again (``radix_evict.py``). A parent's ``lock_ref`` is at least the sum of its
children's; the root's is a constant 1.

Component seam (SGLang 0.5.23's ``UnifiedRadixCache``): :meth:`~RadixLocksMixin._path_to_root`
is the path a lock walks. There each component locks its own path with its own ``lock_ref``
and sizes: Full walks to the root, SWA's window lock walks up only until the nodes it has
passed cover one sliding window of tokens, and ``dec_lock_ref`` must release the same nodes
(SGLang remembers where the SWA lock stopped).
"""

from __future__ import annotations

from minirad.errors import LockError
from minirad.events import LockEvent, UnlockEvent
from minirad.kvcache.radix_node import TreeNode

__all__ = ["RadixLocksMixin"]


class RadixLocksMixin:
    """``lock_ref`` on a path to the root, and the sizes it moves tokens between. A part of
    RadixCache: it uses the tree's attributes (``radix_tree.py``)."""

    def _init_tree(self) -> None:
        super()._init_tree()
        self.evictable_size_ = 0  # tokens of unlocked nodes
        self.protected_size_ = 0  # tokens of locked nodes

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """The nodes a lock on ``node`` counts on: ``node`` up to the root, the root excluded
        (Component seam: a component's lock may stop earlier, e.g. SWA's window lock)."""
        if not isinstance(node, TreeNode):
            raise LockError(f"expected a TreeNode, got {type(node).__name__}")
        path = []
        n = node
        while n is not self.root_node:
            if n.parent is None:
                raise LockError(f"node {node.id} is not in this tree (evicted, or another cache's)")
            path.append(n)
            n = n.parent
        return path

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and every ancestor (the root excluded): one more running request uses
        this prefix. Nodes going from 0 to 1 move from evictable to protected.

        Returns:
            the change of ``evictable_size()`` (<= 0), as in SGLang's Algorithm 1.

        Raises:
            LockError: ``node`` was evicted.
        """
        path = self._path_to_root(node)
        delta = 0
        for n in path:
            if n.lock_ref == 0:
                self.evictable_size_ -= len(n.key)
                self.protected_size_ += len(n.key)
                delta -= len(n.key)
                self.evictable_leaves.discard(n)
            n.lock_ref += 1
        self._record(LockEvent, self.bus.tick(), path)
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one :meth:`inc_lock_ref` on ``node``. Nodes going from 1 to 0 become evictable.

        Returns:
            the change of ``evictable_size()`` (>= 0).

        Raises:
            LockError: ``node`` was evicted, or some node on its path is not locked (the tree
                is unchanged).
        """
        path = self._path_to_root(node)
        for n in path:
            if n.lock_ref <= 0:
                raise LockError(f"node {n.id} is not locked (lock_ref={n.lock_ref})")
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable_size_ += len(n.key)
                self.protected_size_ -= len(n.key)
                delta += len(n.key)
                if not n.children:
                    self._add_evictable(n)
        self._record(UnlockEvent, self.bus.tick(), path)
        return delta

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        """Cached tokens that no request locks."""
        return self.evictable_size_

    def protected_size(self) -> int:
        """Cached tokens locked by running requests."""
        return self.protected_size_
