"""The hybrid tree's walk: match (with the SWA validator), split, insert (with tombstone
recovery), in the way of SGLang 0.5.23's ``UnifiedTreeCore`` with components (FULL, SWA).

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
from minirad.kvcache.swa_node import SWAMatchResult, SWANode
from minirad.kvcache.swa_pools import SWASlotPools
from minirad.kvcache.swa_window import check_window, make_swa_validator
from minirad.kvcache.tokens import checked_token_ids

__all__ = ["SWATree"]


def _common(a: Sequence[int], b: Sequence[int], start: int) -> int:
    n = 0
    limit = min(len(a), len(b) - start)
    while n < limit and a[n] == b[start + n]:
        n += 1
    return n


class SWATree:
    """The tree core; :class:`~minirad.kvcache.swa_radix_cache.SWARadixCache` adds locks,
    eviction and requests."""

    def __init__(self, pools: SWASlotPools, sliding_window_size: int) -> None:
        self.pools = pools
        self.sliding_window_size = check_window(sliding_window_size)
        self.root_node = SWANode(0, [], None)
        self.root_node.full.lock_ref = self.root_node.swa.lock_ref = 1  # never evicted
        self._next_id = 1
        self._clock = 0
        self._next_uuid = 1
        self._swa_lru: list[SWANode] = []  # nodes with live SWA KV, most recent first

    # ------------------------------------------------------------------ helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _path(self, node: SWANode) -> list[SWANode]:
        """Root-first nodes from below the root to ``node``."""
        out = []
        while node is not self.root_node:
            out.append(node)
            node = node.parent
        return out[::-1]

    def _stamp(self, node: SWANode) -> None:
        node.full.last_access = self._tick()

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

    def _split(self, child: SWANode, m: int) -> SWANode:
        """``parent -> child`` becomes ``parent -> new -> child`` after ``m`` tokens; both
        components' values are divided, lock counts copied, and the window-boundary stamp
        moves to ``new`` (the node's older edge, where a lock's window was filled)."""
        new = SWANode(self._next_id, child.key[:m], child.parent)
        self._next_id += 1
        for mine, theirs in ((new.full, child.full), (new.swa, child.swa)):
            mine.lock_ref = theirs.lock_ref
            if theirs.value is None:
                mine.value = None
            else:
                mine.value, theirs.value = theirs.value[:m], theirs.value[m:]
        new.swa_uuid, child.swa_uuid = child.swa_uuid, None
        child.parent.children[child.key[0]] = new
        child.key, child.parent = child.key[m:], new
        new.children = {child.key[0]: child}
        self._stamp(new)
        self._stamp(child)  # the lower half: more recent
        if new.swa.value is not None:
            self._swa_lru.insert(self._swa_lru.index(child) + 1, new)
        return new

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: Sequence[int]) -> SWAMatchResult:
        """The longest prefix of ``key`` a request may reuse: full KV all along and one window
        of live SWA KV just before its end (or none dropped since the root). Splits the node
        the walk ends inside, as SGLang does.

        Raises:
            InvalidKeyError: a token id is negative or not an int.
        """
        key, _ = checked_token_ids(key, "key")
        valid = make_swa_validator(self.sliding_window_size)
        node, i = self.root_node, 0
        best, best_len = self.root_node, 0
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            m = _common(child.key, key, i)
            partial = m < len(child.key)
            if partial:
                child = self._split(child, m)
            node, i = child, i + m
            if valid(len(node.key), node.swa.value is not None):
                best, best_len = node, i
            if partial:
                break
        indices = [s for n in self._path(best) for s in n.full.value]
        self._refresh_window(best)
        t = self._tick()
        for n in reversed(self._path(best)):
            n.full.last_access, t = t, t - 1e-5
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
        key, _ = checked_token_ids(key, "key")
        value = list(value)
        if len(key) != len(value) or not key:
            raise InvalidArgumentError(f"{len(key)} tokens with {len(value)} slots")
        if evicted_seqlen >= len(key):
            raise InvalidArgumentError("evicted_seqlen must leave a live window at the end")
        node, i = self.root_node, 0
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            self._stamp(child)
            m = _common(child.key, key, i)
            if m < len(child.key):
                child = self._split(child, m)
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
        tree = list(node.full.value)  # the tree's slots of [s, e)
        lo = max(s, prev)
        live = max(lo, evicted)
        dup_end = e
        if node.swa.value is None and live < e:  # recover the in-window part of a tombstone
            if live > s:
                self._split(node, live - s)  # ``node`` keeps [live, e)
            self.pools.move_swa(value[live:e], node.full.value)
            node.swa.value = self.pools.translate(node.full.value)
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
            leaf = SWANode(self._next_id, key[a:b], node)
            self._next_id += 1
            leaf.full.value = value[a:b]
            self._stamp(leaf)
            leaf.swa.value = None if b <= evicted else self.pools.translate(value[a:b])
            if leaf.swa.value is not None:
                self._lru_front(leaf)  # older fragments first: the tail ends most recent
            node.children[key[a]] = leaf
            node = leaf
        return node
