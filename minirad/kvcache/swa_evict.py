"""Cascade eviction of the hybrid tree, Full > SWA (SGLang 0.5.23's ``UnifiedTreeCore``).

- **Full** evicts unlocked leaves, least recently used first; a leaf goes whole: the node is
  deleted and its SWA KV (if live) is freed with it (the cascade to the lower component).
- **SWA** has its own LRU list (``_swa_lru``), over the nodes with live SWA KV; its victim is
  the least recent with no SWA lock,
  and if it is an evictable leaf, it is deleted as above; an inner node (or a leaf a Full lock still
  holds) only loses its SWA KV: it becomes a **tombstone**, still in the tree for full attention.

A deleted leaf's parent may now be a childless tombstone; SGLang keeps it (its full KV is still
on the device) as a Full leaf that a later Full eviction deletes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minirad.errors import InvalidArgumentError
from minirad.kvcache.swa_node import SWANode

if TYPE_CHECKING:
    from minirad.kvcache.swa_locks import SWALocksMixin

    _Base = SWALocksMixin
else:
    _Base = object

__all__ = ["SWAEvictionMixin"]


class SWAEvictionMixin(_Base):
    def _evictable_leaf(self, n: SWANode) -> bool:
        return n.is_leaf and n.full.lock_ref == 0 and n.swa.lock_ref == 0

    def _delete_leaf(self, n: SWANode) -> tuple[int, int]:
        """Delete an evictable leaf; free both components; return the tokens freed of each."""
        swa = 0
        if n.swa.value is not None:
            swa = len(n.swa.value)
            self._lru_remove(n)
        self.pools.free(n.full.value)
        del n.parent.children[n.key[0]]
        n.parent = None
        return len(n.full.value), swa

    def _tombstone(self, n: SWANode) -> int:
        """Free ``n``'s SWA KV only; return the tokens freed."""
        freed = self.pools.free_swa_of(n.full.value)
        n.swa.value = None
        self._lru_remove(n)
        return freed

    def evict(self, num_tokens: int = 0, swa_num_tokens: int = 0) -> tuple[int, int]:
        """Free at least ``num_tokens`` full and ``swa_num_tokens`` SWA tokens if the tree can
        (SGLang's ``EvictParams``); return ``(full, swa)`` tokens freed, cascades included."""
        if min(num_tokens, swa_num_tokens) < 0:
            raise InvalidArgumentError("evict needs token counts >= 0")
        full = swa = 0
        while full < num_tokens:
            leaves = [n for n in self.nodes() if self._evictable_leaf(n)]
            if not leaves:
                break
            f, s = self._delete_leaf(min(leaves, key=lambda n: (n.full.last_access, n.id)))
            full, swa = full + f, swa + s
        while swa < swa_num_tokens:
            victim = next((n for n in reversed(self._swa_lru) if n.swa.lock_ref == 0), None)
            if victim is None:
                break
            if self._evictable_leaf(victim):
                f, s = self._delete_leaf(victim)
                full, swa = full + f, swa + s
            else:
                swa += self._tombstone(victim)
        return full, swa
