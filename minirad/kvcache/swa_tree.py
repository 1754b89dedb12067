"""The hybrid tree: our :class:`~minirad.kvcache.radix_tree.RadixTree` (its nodes, child keys,
walk and split) with the SWA component at its seams, in the way of SGLang 0.5.23's
``UnifiedTreeCore`` with components (FULL, SWA): match cut back by the SWA validator, split
dividing the SWA value too, insert with duplicates freed and tombstone recovery.

Page size 1. Recency, as SGLang keeps it (eviction order depends on it):

- **Full**: a time per node (``full.last_access``). A match stamps its hit node and every
  ancestor (deeper = more recent); an insert stamps each node it walks; a new or split node
  gets a fresh time, the lower half of a split a newer one.
- **SWA**: an ordered list of the nodes with live SWA KV (``_swa_lru``, most recent first). A
  match or insert moves only the live nodes within one window (+1 token) before its end to the
  front (SGLang's ``refresh_lru``: older ancestors stay first in line to lose their SWA KV); a
  node given SWA KV goes to the front; a split puts the upper half just behind the lower.
"""

from __future__ import annotations

from collections.abc import Sequence

from minirad.errors import InvalidArgumentError
from minirad.events import EventBus
from minirad.kvcache.radix_tree import RadixTree
from minirad.kvcache.swa_node import SWAMatchResult, SWANode
from minirad.kvcache.swa_pools import SWASlotPools
from minirad.kvcache.swa_window import check_window, make_swa_validator
from minirad.kvcache.tokens import checked_token_ids

__all__ = ["SWATree"]


class SWATree(RadixTree):
    """The tree core; :class:`~minirad.kvcache.swa_radix_cache.SWARadixCache` adds locks,
    eviction and requests. Page size 1, no namespaces, no allocator (``pools`` owns the
    slots); the Full component is the radix tree's own ``value`` and ``lock_ref``."""

    node_class = SWANode
    page_size = 1
    token_to_kv_pool_allocator = None
    # RadixTree's split re-ranks the radix eviction heap's leaves; this cache ranks its own
    # (swa_evict.py), so that set stays empty.
    evictable_leaves: frozenset = frozenset()

    def __init__(self, pools: SWASlotPools, sliding_window_size: int) -> None:
        self.pools = pools
        self.sliding_window_size = check_window(sliding_window_size)
        self.bus = EventBus()  # its clock orders the Full component's LRU
        self._init_tree()
        self.root_node.swa.lock_ref = 1  # never evicted
        self._next_uuid = 1
        self._swa_lru: list[SWANode] = []  # nodes with live SWA KV, most recent first

    # ------------------------------------------------------------------ helpers
    def _path(self, node: SWANode) -> list[SWANode]:
        """Root-first nodes from below the root to ``node``."""
        out = []
        while node is not self.root_node:
            out.append(node)
            node = node.parent
        return out[::-1]

    def _stamp(self, node: SWANode) -> None:
        node.last_access_time = self.bus.tick()

    def _lru_remove(self, node: SWANode) -> None:
        if node in self._swa_lru:
            self._swa_lru.remove(node)

    def _lru_front(self, node: SWANode) -> None:
        self._lru_remove(node)
        self._swa_lru.insert(0, node)

    def _refresh_window(self, node: SWANode) -> None:
        """Move the live nodes within ``sliding_window_size + 1`` tokens before the end of
        ``node`` to the front of the SWA list, ``node`` first."""
        at, covered = 0, 0
        while node is not self.root_node and covered < self.sliding_window_size + 1:
            if node.swa.value is not None:
                self._lru_remove(node)
                self._swa_lru.insert(at, node)
                at += 1
            covered += len(node.key)
            node = node.parent

    def _split_node(self, child: SWANode, m: int, t: int | None = None) -> SWANode:
        """RadixTree's split (the Full value divided, ``lock_ref`` copied), then the SWA
        component's: its value divided, its lock count copied, and the window-boundary stamp
        moved to ``new`` (the node's older edge, where a lock's window was filled)."""
        new = super()._split_node(child, m, self.bus.time if t is None else t)
        new.swa.lock_ref = child.swa.lock_ref
        if child.swa.value is None:
            new.swa.value = None
        else:
            new.swa.value, child.swa.value = child.swa.value[:m], child.swa.value[m:]
        new.swa_uuid, child.swa_uuid = child.swa_uuid, None
        self._stamp(new)
        self._stamp(child)  # the lower half: more recent
        if new.swa.value is not None:
            self._swa_lru.insert(self._swa_lru.index(child) + 1, new)
        return new

    def _walk_split(self, key: list[int], buf) -> tuple[list[SWANode], int]:
        """RadixTree's walk, with the node it ends inside split there (as SGLang does)."""
        walked, i, cut = self._walk(key, buf, None)
        if cut:
            walked[-1] = self._split_node(walked[-1], cut)
        return walked, i

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: Sequence[int]) -> SWAMatchResult:
        """The longest prefix of ``key`` a request may reuse: full KV all along and one window
        of live SWA KV just before its end (or none dropped since the root). Splits the node
        the walk ends inside, as SGLang does.

        Raises:
            InvalidKeyError: a token id is negative or not an int.
        """
        key, buf = checked_token_ids(key, "key")
        walked, i = self._walk_split(key, buf)
        # The Component seam of RadixTree._match: the SWA validator cuts the walk back.
        valid = make_swa_validator(self.sliding_window_size)
        best, best_len, at = self.root_node, 0, 0
        for node in walked:
            at += len(node.key)
            if valid(len(node.key), node.swa.value is not None):
                best, best_len = node, at
        indices = [s for n in self._path(best) for s in n.value]
        self._refresh_window(best)
        t = self.bus.tick()
        for n in reversed(self._path(best)):
            n.last_access_time, t = t, t - 1e-5
        branching = i if i > best_len else None
        return SWAMatchResult(indices, best, i, branching)

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        key: Sequence[int],
        value: Sequence[int],
        prev_prefix_len: int = 0,
        evicted_seqlen: int = 0,
    ) -> int:
        """Insert a request's tokens and full slots; return how many were already cached.

        As SGLang's insert: the request's duplicate slots past ``prev_prefix_len`` (what it had
        matched) are freed here; a tombstone it overlaps at or past ``evicted_seqlen`` (inside
        the window it still holds) is **recovered**: the node keeps its full slots and adopts
        the request's SWA slots. The new leaf's tokens before ``evicted_seqlen`` become a
        tombstone (their SWA slots were freed while the request ran); the live tail is capped at
        one window per node (``_maybe_split_leaf_for_swa_lock``), so a lock pins one window.

        Raises:
            InvalidKeyError: bad token ids.
            InvalidArgumentError: no tokens, not one slot per token, or ``evicted_seqlen`` past
                the last token (the new leaf would have no live window).
        """
        key, buf = checked_token_ids(key, "key")
        value = list(value)
        if len(key) != len(value) or not key:
            raise InvalidArgumentError(f"{len(key)} tokens with {len(value)} slots")
        if evicted_seqlen >= len(key):
            raise InvalidArgumentError("evicted_seqlen must leave a live window at the end")
        walked, _, cut = self._walk(key, buf, None)
        node, i = self.root_node, 0
        for k, child in enumerate(walked):
            self._stamp(child)
            if cut and k == len(walked) - 1:
                child = self._split_node(child, cut)
            m = len(child.key)
            self._overlap(child, i, value, prev_prefix_len, evicted_seqlen)
            node, i = child, i + m
        if i < len(key):
            node = self._add_leaf(node, key, value, i, evicted_seqlen)
        if node is not self.root_node:
            self._refresh_window(node)
        return i

    def _overlap(self, node: SWANode, s: int, value: list[int], prev: int, evicted: int) -> None:
        """The request's tokens ``[s, s + len(node.key))`` are cached already at ``node``."""
        e = s + len(node.key)
        if prev >= e:
            return  # the request's own matched prefix: the tree's slots already
        tree = list(node.value)  # the tree's slots of [s, e)
        lo = max(s, prev)
        live = max(lo, evicted)
        dup_end = e
        if node.swa.value is None and live < e:  # recover the in-window part of a tombstone
            if live > s:
                self._split_node(node, live - s)  # ``node`` keeps [live, e)
            self.pools.move_swa(value[live:e], node.value)
            node.swa.value = self.pools.translate(node.value)
            self._lru_front(node)
            dup_end = live
            self.pools.free(value[live:e])  # their full slots: the tree keeps its own
        dups = value[lo:dup_end]
        self.pools.free([f for f, t in zip(dups, tree[lo - s :], strict=False) if f != t])

    def _add_leaf(
        self, parent: SWANode, key: list[int], value: list[int], i: int, evicted: int
    ) -> SWANode:
        """New node(s) for ``key[i:]``: a tombstone for tokens before ``evicted``, then live
        nodes of at most one window each, the last one ending the key (returned)."""
        w, n = self.sliding_window_size, len(key)
        cuts = [i]
        if evicted > i:
            cuts.append(evicted)
        if n - cuts[-1] > w:
            cuts.append(n - w)
        cuts.append(n)
        node = parent
        for a, b in zip(cuts, cuts[1:], strict=False):
            leaf = self._new_node(key[a:b], value[a:b], node, self.bus.time)
            self._stamp(leaf)
            leaf.swa.value = None if b <= evicted else self.pools.translate(value[a:b])
            if leaf.swa.value is not None:
                self._lru_front(leaf)  # older fragments first: the tail ends most recent
            node.children[key[a]] = leaf
            node = leaf
        return node
