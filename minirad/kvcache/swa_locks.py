"""Locks and sizes of the hybrid tree: a path lock for Full, a window lock for SWA.

SGLang 0.5.23 (``FullComponent`` / ``SWAComponent.acquire_component_lock``): a running request
locks its node's full KV and every ancestor's (a request reads its whole prefix through full
attention), but its SWA KV only from its node up until one window is covered
(:func:`~minirad.kvcache.swa_window.window_lock_count`), tombstones included. The node that
fills the window is stamped with a ``uuid`` that :meth:`SWALocksMixin.dec_lock_ref` stops at, so
the release mirrors the acquire even after splits (a split moves the stamp to the upper part).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from minirad.errors import LockError
from minirad.kvcache.swa_node import ComponentType, SWANode
from minirad.kvcache.swa_window import window_lock_count

if TYPE_CHECKING:
    from minirad.kvcache.swa_tree import SWATree

    _Base = SWATree
else:
    _Base = object

__all__ = ["SWALocksMixin"]


class SWALocksMixin(_Base):
    def _upward(self, node: SWANode) -> Iterator[SWANode]:
        while node is not self.root_node:
            yield node
            node = node.parent

    def inc_lock_ref(self, node: SWANode) -> int | None:
        """Lock ``node`` for a running request; return the SWA window-boundary uuid (None when
        the window reached the root), to give back to :meth:`dec_lock_ref`."""
        for n in self._upward(node):
            n.full.lock_ref += 1
        taken = window_lock_count(
            (len(n.key) for n in self._upward(node)), self.sliding_window_size
        )
        uuid, covered = None, 0
        for k, n in enumerate(self._upward(node)):
            if k == taken:
                break
            n.swa.lock_ref += 1
            covered += len(n.key)
            if covered >= self.sliding_window_size:
                if n.swa_uuid is None:
                    n.swa_uuid, self._next_uuid = self._next_uuid, self._next_uuid + 1
                uuid = n.swa_uuid
        return uuid

    def dec_lock_ref(self, node: SWANode, swa_uuid: int | None) -> None:
        """Release what :meth:`inc_lock_ref` took: Full to the root, SWA up to the stamp."""
        for n in self._upward(node):
            if n.full.lock_ref <= 0:
                raise LockError(f"full lock_ref of node {n.id} would go negative")
            n.full.lock_ref -= 1
        for n in self._upward(node):
            if n.swa.lock_ref <= 0:
                raise LockError(f"swa lock_ref of node {n.id} would go negative")
            n.swa.lock_ref -= 1
            if swa_uuid is not None and n.swa_uuid == swa_uuid:
                break

    # ------------------------------------------------------------------ sizes
    def _sizes(self, ct: ComponentType) -> tuple[int, int]:
        evictable = protected = 0
        for n in self.nodes():
            d = n.data(ct)
            if d.value is not None:
                if d.lock_ref:
                    protected += len(d.value)
                else:
                    evictable += len(d.value)
        return evictable, protected

    def evictable_size(self, ct: ComponentType = ComponentType.FULL) -> int:
        """Tokens of ``ct`` KV no lock holds."""
        return self._sizes(ct)[0]

    def protected_size(self, ct: ComponentType = ComponentType.FULL) -> int:
        """Tokens of ``ct`` KV some running request's lock holds."""
        return self._sizes(ct)[1]

    def tombstones(self) -> list[tuple[int, int]]:
        """The token spans ``(start, end)`` of the tombstoned nodes, sorted."""
        out = []
        for n in self.nodes():
            if n.swa.value is None:
                end = sum(len(a.key) for a in self._upward(n))
                out.append((end - len(n.key), end))
        return sorted(out)
