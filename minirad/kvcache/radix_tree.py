"""The core of the radix cache: the tree over token ids, and how it is walked, matched,
inserted into and split.

A radix tree (compressed trie): each edge holds a run of tokens (a node's ``key``) and their KV
slots (its ``value``). A node's children are keyed by the first token of their edge (the first
page, as a tuple, when ``page_size > 1``; ``(extra_key, that)`` in a namespace), so one dict
lookup per node finds the way down (:meth:`RadixTree._child_key`). :meth:`~RadixTree._walk`
follows a key down, comparing whole edges; :meth:`~RadixTree.match_prefix` returns the slots of
the longest cached prefix and splits the node its match ends inside
(:meth:`~RadixTree._split_node`); :meth:`~RadixTree.insert` adds the uncached tail as a new
leaf.

:class:`RadixTree` is the part of :class:`~minirad.kvcache.radix_cache.RadixCache` that shapes
the tree; the other parts, one module each, sit beside it (``radix_cache.py`` lists them). The
tree calls them at a few points only, each named here: ``_new_slots`` and ``_state``
(``radix_slots.py``: the checks on a new leaf's slots, then the tree takes their pages);
``_add_evictable``, ``_push_evictable`` and ``evictable_leaves`` (``radix_evict.py``: a new
unlocked leaf, a leaf whose eviction rank may have changed); ``evictable_size_``
(``radix_locks.py``: a new leaf is unlocked KV); ``_record`` (``radix_events.py``).

Component seams (SGLang 0.5.23's ``UnifiedRadixCache``: Full and SWA data per node), marked
"Component seam" in the code:

- **match**: in :meth:`~RadixTree._match`, between the walk and the visit. A per-component
  validator cuts the walk back to where the match is valid (SWA: a hit needs one window of live
  SWA KV before its end; a tombstone is not live) before :meth:`~RadixTree._visit` splits.
- **split**: :meth:`~RadixTree._split_node` divides ``value`` between the two edges; each
  component's value (and its LRU place) is divided the same way.
- **insert**: :meth:`~RadixTree._insert` gives the new leaf its ``value``; each component's
  value goes in there, and a tombstone the walk passed inside the window gets its SWA value
  back.
"""

from __future__ import annotations

import numbers
from array import array
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from minirad.errors import InvalidArgumentError, InvalidKeyError
from minirad.events import EventBus, InsertEvent, MatchEvent, SplitEvent
from minirad.kvcache.kv_pool import PAGE_CACHED
from minirad.kvcache.radix_events import RadixEventsMixin
from minirad.kvcache.radix_node import MatchResult, TreeNode
from minirad.kvcache.radix_slots import _as_slots
from minirad.kvcache.tokens import checked_token_ids

if TYPE_CHECKING:
    from minirad.kvcache.kv_pool import TokenToKVPoolAllocator

__all__ = ["RadixTree"]


def _check_extra_key(extra_key: object) -> None:
    if extra_key is not None and not isinstance(extra_key, str):
        raise InvalidKeyError(f"extra_key must be a str or None, got {extra_key!r}")


def _check_priority(priority: object, name: str) -> None:
    if type(priority) is not int and (
        type(priority) is bool or not isinstance(priority, numbers.Integral)
    ):
        raise InvalidArgumentError(f"{name} must be an int, got {priority!r}")


class RadixTree(RadixEventsMixin):
    """The tree of :class:`~minirad.kvcache.radix_cache.RadixCache`: match, walk, insert, split.

    RadixCache's constructor sets the attributes below and calls :meth:`_init_tree`. The
    public methods check their arguments; the private ones trust them.

    Attributes:
        page_size: tokens per KV page: keys are cut to whole pages, splits fall on page
            boundaries.
        token_to_kv_pool_allocator: the allocator that owns the slots, or None (simulated).
        bus: the event bus: its logical clock times every access.
        root_node: the root (id 0, empty key, ``lock_ref`` 1: never evicted).
    """

    # The class of the tree's nodes: a tiered cache (``hiradix_cache.py``) adds host fields.
    node_class: type[TreeNode] = TreeNode
    page_size: int
    token_to_kv_pool_allocator: TokenToKVPoolAllocator | None
    bus: EventBus

    def _init_tree(self) -> None:
        """Start an empty tree. Each part of the cache extends this to start its own state
        (after ``super()._init_tree()``)."""
        self._next_id = 0
        self.root_node = self._new_node([], [], None, self.bus.time)
        self.root_node.lock_ref = 1  # the root is never evictable (SGLang does the same)

    def _new_node(self, key, value, parent, time, extra_key=None) -> TreeNode:
        node = self.node_class(self._next_id, key, value, parent, time, extra_key)
        self._next_id += 1
        return node

    def _child_key(self, key: Sequence[int], i: int, extra_key: str | None):
        """The key of the child whose edge starts at ``key[i]``: that token, or its page."""
        ck = key[i] if self.page_size == 1 else tuple(key[i : i + self.page_size])
        return ck if extra_key is None else (extra_key, ck)

    def _aligned(self, key: list[int]) -> list[int]:
        cut = len(key) % self.page_size
        return key[: len(key) - cut] if cut else key  # no copy of an aligned key

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Find the longest cached prefix of ``key`` (cut to whole pages).

        Mutates the tree like SGLang: a match that ends inside an edge splits that node, so
        the returned ``last_node`` ends exactly at the matched prefix; every node on the path
        gets the current time and one more ``hit_count``. ``extra_key`` is a namespace: keys
        with different extra keys never share nodes.

        Returns:
            ``MatchResult(indices, last_node)``: ``len(indices)`` matched tokens' slots.

        Raises:
            InvalidKeyError: a token id is negative or not an int, or a bad ``extra_key``.
        """
        key, buf = checked_token_ids(key, "key")
        _check_extra_key(extra_key)
        return self._match(self._aligned(key), buf, extra_key, hit=True)

    def _match(self, key: list[int], buf: array | None, extra_key, hit: bool) -> MatchResult:
        """:meth:`match_prefix` of an aligned, checked key (``buf``: the same ids as an
        ``array("Q")``, or None). ``hit=False``: a request's own re-match after an insert (no
        hit counted, no event)."""
        t = self.bus.tick()
        walked, _, cut = self._walk(key, buf, extra_key)
        # Component seam: a per-component validator cuts ``walked``/``cut`` back here.
        node = self._visit(walked, cut, t, hit)
        indices: list[int] = []
        for n in walked:  # list += copies in C
            indices += n.value
        if hit:
            self._record(MatchEvent, t, walked, len(indices), len(key), extra_key)
        return MatchResult(indices, node)

    def _walk(self, key: list[int], buf: array | None, extra_key) -> tuple[list, int, int]:
        """Follow ``key`` down from the root; changes nothing (the walk of match and insert).

        Returns the nodes walked (root excluded), how many tokens of ``key`` they match, and
        ``cut``: how far into its edge the match reaches the last node when it ends inside
        that edge (else 0).
        """
        walked: list[TreeNode] = []
        node, i, n = self.root_node, 0, len(key)
        simple = self.page_size == 1 and extra_key is None  # the child key is the token itself
        while i < n:
            child = node.children.get(key[i] if simple else self._child_key(key, i, extra_key))
            if child is None:
                break
            walked.append(child)
            # Arrays compare with memcmp, lists item by item: use arrays where both exist.
            fast = buf is not None and child.key_buf is not None
            seq, edge = (buf, child.key_buf) if fast else (key, child.key)
            end = i + len(edge)
            if end <= n and seq[i:end] == edge:  # the whole edge matches: next node
                node, i = child, end
                continue
            # It ends inside the edge: bisect for the first difference (log n slice compares).
            lo, hi = 0, min(len(edge), n - i) + 1  # edge[:lo] matches, edge[:hi] does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if seq[i + lo : i + mid] == edge[lo:mid] else (lo, mid)
            m = lo - lo % self.page_size  # >= one page: the child key matched
            return walked, i + m, m
        return walked, i, 0

    def _visit(
        self,
        walked: list[TreeNode],
        cut: int,
        t: int,
        hit: bool,
        insert: tuple[int, int] | None = None,
    ) -> TreeNode:
        """Touch a walk's nodes at time ``t``, split its last node at ``cut`` (in place in
        ``walked``), count a hit on each if ``hit``; for an insert (``insert``: its
        ``(inserted_len, priority)``) count it on each node that ends past ``inserted_len`` and
        raise their priority. Return the node that ends the walk (the root when ``walked`` is
        empty)."""
        self.root_node.last_access_time = t
        for n in walked:
            n.last_access_time = t
        if cut:
            walked[-1] = self._split_node(walked[-1], cut, t)
        for n in walked if hit else ():
            n.hit_count += 1
        if insert is not None:
            inserted_len, priority = insert
            for n in walked:
                if n.depth > inserted_len:  # this request has not counted it yet
                    n.insert_count += 1
                if n.priority < priority:
                    n.priority = priority
        node = walked[-1] if walked else self.root_node
        if node in self.evictable_leaves:  # its priority changed (access time, hits)
            self._push_evictable(node)
        return node

    def _split_node(self, child: TreeNode, m: int, t: int) -> TreeNode:
        """Cut ``parent -> child`` into ``parent -> new -> child`` after ``m`` tokens; return
        ``new``. No KV moves: the slots are divided between the two edges. ``new`` keeps the
        id, times, hits, priority, branch history and ``lock_ref`` (so the size sums hold);
        ``child`` gets a new id and keeps its depth."""
        make = type(child)  # a tiered cache's nodes split into their own class
        new = make(child.id, child.key[:m], child.value[:m], child.parent, t, child.extra_key)
        new.lock_ref, new.hit_count = child.lock_ref, child.hit_count
        new.insert_count, new.priority = child.insert_count, child.priority
        new.history_len = child.history_len
        new.creation_time, new.last_access_time = child.creation_time, child.last_access_time
        if child.key_buf is not None:
            new.key_buf, child.key_buf = child.key_buf[:m], child.key_buf[m:]
        new.value_buf, child.value_buf = child.value_buf[:m], child.value_buf[m:]
        # Component seam: each component's value is divided here too, its lock_ref copied.
        child.id = self._next_id
        self._next_id += 1
        child.parent.children[self._child_key(child.key, 0, child.extra_key)] = new
        child.key, child.value, child.parent = child.key[m:], child.value[m:], new
        new.children = {self._child_key(child.key, 0, child.extra_key): child}
        if child in self.evictable_leaves:  # its id and key, read by priorities, changed
            self._push_evictable(child)
        self._record(SplitEvent, t, new, child, m)
        return new

    def cached_prefix_len(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of ``key`` the tree holds (whole pages), read without changing the tree: no
        split, no access time, no hit count, as a router's index of this cache would see it.

        Raises:
            InvalidKeyError: a token id is negative or not an int.
        """
        key, buf = checked_token_ids(key, "key")
        _check_extra_key(extra_key)
        return self._walk(self._aligned(key), buf, extra_key)[1]

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        key: Sequence[int],
        value: Sequence[int] | None = None,
        extra_key: str | None = None,
        *,
        priority: int = 0,
        inserted_len: int = 0,
    ) -> int:
        """Add ``key`` (cut to whole pages) with its KV slots ``value``; return ``prefix_len``,
        how many leading tokens of the (aligned) key were already cached.

        The tree keeps the slots it already has for the cached prefix; the caller still owns
        (and must free) its own slots ``value[:prefix_len]`` when they differ from the tree's.
        Only the new tail becomes a leaf, with slots ``value[prefix_len:]``. ``value=None``
        (only without an allocator) gives the new tokens fresh simulated slots 0, 1, 2...
        (SGLang uses the token ids, which would let a repeated token own one slot twice).

        ``priority`` and ``inserted_len`` are SGLang's ``InsertParams``: the inserting request's
        priority (every node walked or created gets at least it) and how many leading tokens
        that request inserted before (nodes that end within them do not count this insert
        in their ``insert_count``).

        Raises (every check runs before anything changes):
            InvalidKeyError: bad token ids or slots, ``len(value) != len(key)``, new slots
                that the tree already owns or that are not whole pages.
            UnknownBlockError: new slots that the allocator has not handed out.
            InvalidArgumentError: ``priority`` is not an int, or ``inserted_len`` not an int
                >= 0.
        """
        key, buf = checked_token_ids(key, "key")
        _check_extra_key(extra_key)
        _check_priority(priority, "priority")
        if type(inserted_len) is bool or not isinstance(inserted_len, int) or inserted_len < 0:
            raise InvalidArgumentError(f"inserted_len must be an int >= 0, got {inserted_len!r}")
        slots = None
        if value is not None:
            value, slots = _as_slots(value, "value")
            if len(value) != len(key):
                raise InvalidKeyError(f"value has {len(value)} slots for {len(key)} tokens")
        elif self.token_to_kv_pool_allocator is not None:
            raise InvalidArgumentError(
                "insert needs the slots (value) when the cache has an allocator"
            )
        return self._insert(
            self._aligned(key), buf, value, slots, extra_key, int(priority), inserted_len
        )

    def _insert(
        self,
        key,
        buf,
        value,
        slots,
        extra_key,
        priority: int = 0,
        inserted_len: int = 0,
        allocated: bool = False,
    ) -> int:
        """:meth:`insert` of an aligned, checked key (SGLang's ``_insert_helper``): ``value``
        (at least as long as ``key``; None: simulated) as a list and as the int64 array
        ``slots``; ``allocated``: the allocator has already vouched for them."""
        walked, i, cut = self._walk(key, buf, extra_key)
        n = len(key)
        if i < n:  # the new slots, checked before the split below changes the tree
            value, slots = self._new_slots(value, slots, i, n, allocated)
        t = self.bus.tick()
        node = self._visit(walked, cut, t, hit=False, insert=(inserted_len, priority))
        leaf = None
        if i < n:
            leaf = self._new_node(key[i:], value, node, t, extra_key)
            leaf.insert_count = 1 if n > inserted_len else 0
            leaf.priority = priority
            up = node  # the branch is n tokens deep now: raise its history (tlru's L)
            while up is not None and up.history_len < n:
                up.history_len = n
                up = up.parent
            # The whole array when it is all new: arrays are never changed in place.
            leaf.key_buf = buf if buf is None or (i == 0 and n == len(buf)) else buf[i:n]
            leaf.value_buf = slots  # Component seam: each component's value goes in here.
            node.children[self._child_key(key, i, extra_key)] = leaf
            self.evictable_size_ += n - i  # unlocked KV (radix_locks.py)
            # The tree holds these pages now (radix_slots.py); the leaf is an eviction
            # candidate, its parent no longer one (radix_evict.py).
            self._state[slots if self.page_size == 1 else slots // self.page_size] = PAGE_CACHED
            self.evictable_leaves.discard(node)
            self._add_evictable(leaf)
        self._record(InsertEvent, t, walked, i, node, leaf, extra_key)
        return i

    # ------------------------------------------------------------------ walking the whole tree
    def total_size(self) -> int:
        """All cached tokens, counted by walking the tree."""
        return sum(len(n.value) for n in self.nodes())

    def all_values_flatten(self) -> list[int]:
        """Every slot the tree owns, in depth-first order."""
        return [s for n in self.nodes() for s in n.value]

    def nodes(self) -> Iterator[TreeNode]:
        """All nodes except the root, depth-first, children in insertion order."""
        stack = list(reversed(self.root_node.children.values()))
        while stack:
            n = stack.pop()
            yield n
            stack.extend(reversed(n.children.values()))
