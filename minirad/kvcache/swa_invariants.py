"""The hybrid cache's invariants: :meth:`SWAInvariantsMixin.check_invariants`.

Recounted from scratch after any operation (the property tests call it after every step):

1. **Shape**: children keyed by their first token, parents right, each component's value one
   slot per token (or None: a tombstone, SWA only); every leaf keeps its full KV; the SWA LRU
   list holds exactly the nodes with live SWA KV.
2. **Locks**: each node's Full ``lock_ref`` is the number of running requests whose node is at
   or below it; its SWA ``lock_ref`` the number whose window segment includes it (from the
   request's node up to its ``swa_uuid`` stamp, or the root), and each segment covers the
   window (:func:`~minirad.kvcache.swa_window.window_lock_count`). So no lock outlives its
   request.
3. **Pools**: for each component, free + held by the tree + held by running requests = the
   pool's size, with no slot counted twice; the tree's SWA values are its full slots'
   ``full_to_swa``, a tombstone's full slots map to nothing.
4. **Requests**: a running request's own tokens hold their SWA slot from ``evicted_seqlen`` on,
   none before; a finished request holds nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from minirad.errors import InvariantError
from minirad.kvcache.swa_pools import NO_SWA
from minirad.kvcache.swa_window import window_lock_count

if TYPE_CHECKING:
    from minirad.kvcache.swa_requests import SWARequestsMixin

    _Base = SWARequestsMixin
else:
    _Base = object

__all__ = ["SWAInvariantsMixin"]


def _fail(msg: str) -> None:
    raise InvariantError(msg)


class SWAInvariantsMixin(_Base):
    def check_invariants(self) -> None:
        """Raise :class:`~minirad.errors.InvariantError` at the first broken invariant."""
        nodes = list(self.nodes())
        for n in nodes:
            self._check_shape(n)
        live = [n for n in nodes if n.swa.value is not None]
        if len(self._swa_lru) != len(live) or set(self._swa_lru) != set(live):
            _fail("the SWA LRU list is not exactly the nodes with live SWA KV")
        self._check_locks(nodes)
        self._check_pools(nodes)

    def _check_shape(self, n) -> None:
        if n.parent is None or n.parent.children.get(n.key[0] if n.key else None) is not n:
            _fail(f"node {n.id} is not its parent's child under its first token")
        if n.full.value is None or len(n.full.value) != len(n.key):
            _fail(f"node {n.id}: {len(n.key)} tokens, full value {n.full.value!r}")
        if n.swa.value is not None and len(n.swa.value) != len(n.key):
            _fail(f"node {n.id}: {len(n.key)} tokens, {len(n.swa.value)} SWA slots")
        if n.full.lock_ref < 0 or n.swa.lock_ref < 0:
            _fail(f"node {n.id} has a negative lock_ref")

    def _check_locks(self, nodes) -> None:
        full, swa = Counter(), Counter()
        w = self.sliding_window_size
        for req in self.running.values():
            up = list(self._upward(req.last_node))
            full.update(up)
            # The segment runs up to the request's stamp (a split since the lock may have
            # made it longer than the window needs now), and covers the window.
            stamps = [n.swa_uuid for n in up]
            if req.swa_uuid is None:
                taken = len(up)
            elif req.swa_uuid in stamps:
                taken = stamps.index(req.swa_uuid) + 1
            else:
                _fail(f"request {req.rid}: its window-lock stamp is not on its path")
            if taken < window_lock_count((len(n.key) for n in up), w):
                _fail(f"request {req.rid}: its SWA lock does not cover the window ({w})")
            swa.update(up[:taken])
        for n in nodes:
            if n.full.lock_ref != full[n]:
                _fail(f"node {n.id}: full lock_ref {n.full.lock_ref}, {full[n]} requests")
            if n.swa.lock_ref != swa[n]:
                _fail(f"node {n.id}: swa lock_ref {n.swa.lock_ref}, {swa[n]} window locks")

    def _check_pools(self, nodes) -> None:
        pools = self.pools
        tree_full = [s for n in nodes for s in n.full.value]
        tree_swa = [s for n in nodes if n.swa.value is not None for s in n.swa.value]
        for n in nodes:
            mapped = pools.translate(n.full.value)
            want = [NO_SWA] * len(n.key) if n.swa.value is None else n.swa.value
            if mapped != want:
                _fail(f"node {n.id}: SWA value {n.swa.value} but full_to_swa says {mapped}")
        req_full, req_swa = [], []
        for req in self.running.values():
            if req.finished or req.last_node is None:
                _fail(f"running request {req.rid} is finished or unlocked")
            own = req.kv[req.cache_protected_len :]
            req_full += own
            cut = max(req.evicted_seqlen, req.cache_protected_len)
            if any(s != NO_SWA for s in pools.translate(req.kv[req.cache_protected_len : cut])):
                _fail(f"request {req.rid} holds SWA slots before evicted_seqlen")
            live = pools.translate(req.kv[cut:])
            if NO_SWA in live:
                _fail(f"request {req.rid} lost an SWA slot inside its window")
            req_swa += live
        for req in self.finished:
            if req.kv or req.last_node is not None:
                _fail(f"finished request {req.rid} still holds slots or a lock")
        for name, free, tree, held, size in (
            ("full", pools.free_full, tree_full, req_full, pools.full_size),
            ("swa", pools.free_swa, tree_swa, req_swa, pools.swa_size),
        ):
            every = free + tree + held
            if len(every) != size or set(every) != set(range(size)):
                dup = [s for s, c in Counter(every).items() if c > 1][:5]
                _fail(
                    f"{name} pool: free {len(free)} + tree {len(tree)} + requests {len(held)}"
                    f" != {size} (twice: {dup})"
                )
