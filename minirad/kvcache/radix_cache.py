"""The radix prefix cache of SGLang's RadixAttention.

A radix tree (compressed trie) over token ids. Each edge holds a run of tokens (``key``) and
the KV-pool slots that hold their keys and values (``value``, one slot per token). A request
walks the tree with :meth:`RadixCache.match_prefix` to find how much of its prompt is already
computed, locks that path while it runs, and inserts its full sequence when done; unlocked
leaves are evicted, least recently used first, when memory runs short.

Follows Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs"
(NeurIPS 2024, §3 and Algorithm 1) and ``python/sglang/srt/mem_cache/radix_cache.py``:
split on a match that ends inside an edge, ``lock_ref`` counted on the whole path to the root,
evictable/protected accounting, page-aligned keys, children keyed by the first token (or first
page) and namespaced by ``extra_key``, and the request lifecycle in
:meth:`RadixCache.cache_finished_req` / :meth:`RadixCache.cache_unfinished_req`.

Differences from SGLang, on purpose: keys and values are plain Python lists (no torch tensors
in the tree); time is a logical clock from :class:`minirad.events.EventBus`; a split keeps the
node *id* on the prefix part (the part whose edge from the parent is unchanged), so drawings
stay stable, while the suffix keeps the object (a request holding it stays correct);
``hit_count`` counts the matches that walked a node (SGLang counts insert paths), so LFU ranks
prefixes by how often they were *reused*; ``insert_count`` keeps SGLang's count, for SLRU.
"""

from __future__ import annotations

import heapq
import numbers
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from minirad.errors import InvalidArgumentError, InvalidKeyError, InvariantError, LockError
from minirad.events import (
    EventBus,
    EvictEvent,
    InsertEvent,
    LockEvent,
    MatchEvent,
    ResetEvent,
    SplitEvent,
    UnlockEvent,
    plural,
)
from minirad.kvcache.eviction import EvictionPolicy, get_policy
from minirad.kvcache.kv_pool import PAGE_ALLOCATED, PAGE_CACHED, TokenToKVPoolAllocator
from minirad.kvcache.radix_events import RadixEventsMixin
from minirad.kvcache.tokens import checked_token_ids

__all__ = ["MatchResult", "RadixCache", "Req", "TreeNode"]

# Without an allocator, slot ids index a mask in memory; beyond this, give the cache one.
MAX_SIMULATED_SLOT = 1 << 24


def _check_extra_key(extra_key: object) -> None:
    if extra_key is not None and not isinstance(extra_key, str):
        raise InvalidKeyError(f"extra_key must be a str or None, got {extra_key!r}")


def _check_priority(priority: object, name: str) -> None:
    if type(priority) is not int and (
        type(priority) is bool or not isinstance(priority, numbers.Integral)
    ):
        raise InvalidArgumentError(f"{name} must be an int, got {priority!r}")


_NO_SLOTS = np.zeros(0, dtype=np.int64)


def _as_slots(slots: Sequence[int], name: str) -> tuple[list[int], np.ndarray]:
    """``slots`` as a list and as an int64 array of the same ids. The array views the one that
    validation builds: numpy's own conversion of a list is much slower. Ids of 2**63 or more
    become negative, which every range check refuses.

    Raises:
        InvalidKeyError: a slot is not an int >= 0.
    """
    ids, checked = checked_token_ids(slots, name)
    if ids and type(ids[0]) is not int and checked is not None:
        # A list of numpy ints or bools: plain ints, which the allocator hands out again.
        ids = checked.tolist()
    if checked is None:  # some ids are >= 2**64: 2**64 - 1 keeps the array as long as the list
        checked = array("Q", [min(s, 2**64 - 1) for s in ids])
    return ids, np.frombuffer(checked, np.int64)


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


@dataclass(eq=False)
class Req:
    """The request state the lifecycle helpers need (a subset of SGLang's ``Req``).

    The engine's :class:`minirad.engine.Request` extends it (one object per request, as
    nano-vllm's ``Sequence``). Compared by identity.

    Attributes:
        rid: request id.
        origin_input_ids: prompt token ids (image placeholders already replaced by pad ids).
        output_ids: generated token ids so far.
        extra_key: cache namespace of the request.
        kv_indices: KV slots of every token that has KV, in order (SGLang's
            ``req_to_token`` row). The last sampled token has no KV yet and has no slot here.
        prefix_indices: the slots that came from the tree at the last match or insert.
        last_node: the locked node that ends the request's cached prefix.
        cache_protected_len: how many leading ``kv_indices`` belong to the tree.
        priority: the request's priority (SGLang's ``Req.priority``, 0 when unset): its
            inserts raise the ``priority`` of the nodes they walk or create to at least this.
        cache_inserted_len: how many leading tokens this request has inserted into the tree
            (SGLang's ``cache_inserted_len``): its later inserts do not count them again in
            ``insert_count``.
        host_hit_length, storage_hit_length: of the matched tokens, those a hierarchical
            cache loaded back from its host tier, and from its disk tier (SGLang's names).
    """

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    kv_indices: list[int] = field(default_factory=list)
    prefix_indices: list[int] = field(default_factory=list)
    last_node: TreeNode | None = None
    cache_protected_len: int = 0
    priority: int = 0
    cache_inserted_len: int = 0
    host_hit_length: int = 0
    storage_hit_length: int = 0
    # What checked_fill_ids last checked, to check only what changed since.
    _checked: tuple | None = field(default=None, init=False, repr=False)

    @property
    def fill_ids(self) -> list[int]:
        """Prompt plus output tokens, as a new list of ints (arrays and tensors accepted: `+`
        on numpy arrays would add element-wise rather than concatenate).

        Raises:
            InvalidKeyError: a token id is not an int >= 0.
        """
        return list(self.checked_fill_ids()[0])

    def checked_fill_ids(self) -> tuple[list[int], array | None]:
        """:attr:`fill_ids` (do not modify it) and the same ids as an ``array("Q")`` (None if
        one needs 64 bits or more).

        Validated once per request (the engine asks for ``fill_ids`` ~10 times a request):
        lists are compared with copies of what was checked, and the ``output_ids`` that an
        engine appends to are checked only past that. Any other change (an edit in place, a
        pop, a new list) checks them again; arrays and tensors are checked every time.

        Raises:
            InvalidKeyError: a token id is not an int >= 0.
        """
        origin, out = self.origin_input_ids, self.output_ids
        lists = type(origin) is list and type(out) is list
        c = self._checked if lists else None  # (origin copy, output copy, ids, their array)
        # list == runs in C and short-cuts on identical ints: a fraction of a new check.
        if c is None or origin != c[0] or out[: len(c[1])] != c[1]:
            ids, buf = checked_token_ids(origin, "origin_input_ids", plain=True)
            c = (origin[:] if lists else None, [], ids, buf)
        seen = len(c[1])
        if seen < len(out):
            new, new_buf = checked_token_ids(out[seen:], "output_ids", plain=True)
            buf = c[3] + new_buf if c[3] is not None and new_buf is not None else None
            c = (c[0], out[:] if lists else None, c[2] + new, buf)
        self._checked = c if lists else None
        return c[2], c[3]


class RadixCache(RadixEventsMixin):
    """SGLang's radix prefix cache over token ids.

    Args:
        page_size: tokens per KV page; keys are cut to a multiple of it, splits happen only
            at page boundaries, and two keys that differ inside their first page share nothing.
        eviction_policy: ``"lru"`` (default), ``"lfu"``, ``"fifo"``, ``"slru"``, ``"tlru"``,
            ``"priority"`` or an :class:`~minirad.kvcache.eviction.EvictionPolicy` (one with
            parameters: :func:`~minirad.kvcache.eviction.get_policy`).
        token_to_kv_pool_allocator: the allocator that owns the slots; evicted slots and
            duplicate slots of finished requests are freed to it. None for a simulated cache
            (``evict`` then only returns the slots).
        bus: event bus (logical clock + subscribers); a private one if None.

    Sizes (``evictable_size()`` etc.) are in tokens. The public methods check their arguments;
    the private ones trust them.
    """

    # The class of the tree's nodes: a tiered cache (``hiradix_cache.py``) adds host fields.
    node_class: type[TreeNode] = TreeNode

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str | EvictionPolicy = "lru",
        token_to_kv_pool_allocator: TokenToKVPoolAllocator | None = None,
        bus: EventBus | None = None,
    ) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise InvalidArgumentError(f"page_size must be a positive int, got {page_size!r}")
        alloc = token_to_kv_pool_allocator
        if alloc is not None and alloc.page_size != page_size:
            raise InvalidArgumentError(
                f"allocator page_size {alloc.page_size} differs from cache page_size {page_size}"
            )
        self.page_size = page_size
        self.eviction_policy = get_policy(eviction_policy)
        self.token_to_kv_pool_allocator = alloc
        self.bus = bus if bus is not None else EventBus()
        self._init_tree()

    # ------------------------------------------------------------------ state
    def _init_tree(self) -> None:
        self._next_id = 0
        self.root_node = self._new_node([], [], None, self.bus.time)
        self.root_node.lock_ref = 1  # the root is never evictable (SGLang does the same)
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves: set[TreeNode] = set()
        # A heap of (priority, id, seq, node) over the evictable leaves, kept between calls.
        # Entries go stale when a leaf is locked, deleted or touched; evict() skips those, and
        # every change pushes a fresh entry. (SGLang rebuilds a heap of all leaves per call.)
        self._evict_heap: list[tuple[tuple, int, int, TreeNode]] = []
        self._push_count = 0
        self._next_sim_slot = 0  # slots handed out by insert(value=None)
        # _state[page] is PAGE_CACHED while a node holds that page: rejects giving a slot to
        # the tree twice. A numpy array, not a set: it is updated for every inserted and
        # evicted token. With an allocator it is the allocator's page_state (one array tells
        # allocated from cached, and its free() refuses cached pages); without one, every page
        # the tree does not hold counts as allocated (PAGE_ALLOCATED is 0: np.zeros).
        alloc = self.token_to_kv_pool_allocator
        self._state = alloc.page_state if alloc is not None else np.zeros(0, dtype=np.uint8)
        self._generation = alloc.generation if alloc is not None else 0

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

    def _new_node(self, key, value, parent, time, extra_key=None) -> TreeNode:
        node = self.node_class(self._next_id, key, value, parent, time, extra_key)
        self._next_id += 1
        return node

    def _child_key(self, key: Sequence[int], i: int, extra_key: str | None):
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
            leaf.value_buf = slots
            node.children[self._child_key(key, i, extra_key)] = leaf
            self.evictable_size_ += n - i
            self._state[slots if self.page_size == 1 else slots // self.page_size] = PAGE_CACHED
            self.evictable_leaves.discard(node)
            self._add_evictable(leaf)
        self._record(InsertEvent, t, walked, i, node, leaf, extra_key)
        return i

    def _new_slots(self, value, slots, i: int, n: int, allocated: bool) -> tuple[list, np.ndarray]:
        """The slots of a new leaf for tokens ``i:n`` (fresh ones when ``value`` is None), as
        a list and an array of their own; raise if the tree may not take them: out of range,
        repeated, the tree's already, not handed out by the allocator (unless ``allocated``),
        not whole pages."""
        alloc, simulated = self.token_to_kv_pool_allocator, value is None
        if simulated:
            slots = np.arange(self._next_sim_slot, self._next_sim_slot + n - i)
            self._next_sim_slot += n - i
            value = slots.tolist()
        else:  # the leaf's own array: a part would keep the whole one alive
            value, slots = value[i:n], slots if i == 0 and n == len(slots) else slots[i:n].copy()
        limit = alloc.size if alloc is not None else MAX_SIMULATED_SLOT
        ordered = slots.copy()  # one sort gives the range and the repeats (in place: np.sort
        ordered.sort()  # adds a Python wrapper)
        lo, hi = int(ordered[0]), int(ordered[-1])
        if lo < 0 or hi >= limit:
            bad = (hi if lo >= 0 else lo) % 2**64
            raise InvalidKeyError(f"slot {bad} is out of range (< {limit})")
        if hi // self.page_size >= len(self._state):
            self._grow_state(hi // self.page_size + 1)
        # One gather tells cached from free pages; count_nonzero runs in C (ndarray.any() goes
        # through a Python wrapper).
        state = self._state[slots if self.page_size == 1 else slots // self.page_size]
        repeated = np.count_nonzero(ordered[1:] == ordered[:-1])
        if repeated or np.count_nonzero(state):  # some page is not PAGE_ALLOCATED
            if repeated or np.count_nonzero(state == PAGE_CACHED):
                raise InvalidKeyError("insert would give the tree a slot it already owns")
            if alloc is not None and not allocated:
                alloc.check_allocated(slots)  # raises why not
        if self.page_size > 1 and not simulated:
            self._check_whole_pages(slots)
        return value, slots

    def _grow_state(self, size: int) -> None:
        if size > len(self._state):  # only without an allocator: slot ids are unbounded
            grown = np.zeros(max(size, 2 * len(self._state)), dtype=np.uint8)  # allocated
            grown[: len(self._state)] = self._state
            self._state = grown

    def _release(self, slots: list[int], slot_ids: np.ndarray) -> None:
        """Give back the slots the tree no longer holds (``slot_ids``: the same as an int64
        array): to the allocator, which marks their pages free, or else to the pool of pages
        the tree may take again."""
        if self.token_to_kv_pool_allocator is not None:
            # The tree held them, so they are distinct and allocated: free_evicted() skips
            # free()'s checks.
            self.token_to_kv_pool_allocator.free_evicted(slots, slot_ids, self._generation)
        else:
            pages = slot_ids if self.page_size == 1 else slot_ids // self.page_size
            self._state[pages] = PAGE_ALLOCATED

    def _check_whole_pages(self, slots: np.ndarray) -> None:
        """Each page of tokens must sit in one whole KV page, in order: evicting a node frees
        whole pages, which must not belong to anyone else. ``len(slots)``: whole pages."""
        ps = self.page_size
        pages = slots.reshape(-1, ps)
        bad = (pages[:, :1] % ps != 0) | (pages != pages[:, :1] + np.arange(ps))
        if np.count_nonzero(bad):
            row = pages[bad.any(axis=1)][0].tolist()
            raise InvalidKeyError(f"slots {row} are not one whole page of size {ps}")

    # ------------------------------------------------------------------ eviction
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
            freed += leaf.value
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
        self.evictable_leaves.add(node)
        self._push_evictable(node)

    def _push_evictable(self, node: TreeNode) -> None:
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
        parent = node.parent
        simple = self.page_size == 1 and node.extra_key is None  # the child key is the token
        del parent.children[node.key[0] if simple else self._child_key(node.key, 0, node.extra_key)]
        node.parent = None
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
            self._add_evictable(parent)

    # ------------------------------------------------------------------ locks
    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
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

    # ------------------------------------------------------------------ request lifecycle
    def match_prefix_for_req(self, req: Req, max_prefix_len: int | None = None) -> list[int]:
        """Match a new (or resumed) request and lock its prefix.

        At most ``len(req.fill_ids) - 1`` tokens may match: the last token is always computed
        again so the model produces logits for it (SGLang ``_compute_max_prefix_len``, vLLM's
        last-token rule). Sets ``req.prefix_indices``, ``req.kv_indices`` (a copy),
        ``req.last_node`` (locked) and ``req.cache_protected_len``.

        Args:
            max_prefix_len: a tighter cap on the matched tokens (the scheduler's prefix
                strategies: 0 reuses nothing, the first image's offset only the text before it).

        Returns:
            the matched slots.

        Raises:
            LockError: the request already holds a lock.
            InvalidArgumentError: ``max_prefix_len`` is not an int >= 0 (or None).
        """
        if req.last_node is not None:
            raise LockError(f"request {req.rid} already holds a lock; finish it first")
        if max_prefix_len is not None and (
            type(max_prefix_len) is bool
            or not isinstance(max_prefix_len, numbers.Integral)
            or max_prefix_len < 0
        ):  # a negative cap would slice from the end and match nearly everything
            raise InvalidArgumentError(
                f"max_prefix_len must be an int >= 0 or None, got {max_prefix_len!r}"
            )
        _check_extra_key(req.extra_key)
        fill, buf = req.checked_fill_ids()
        cap = max(len(fill) - 1, 0)
        if max_prefix_len is not None:
            cap = min(cap, max_prefix_len)
        indices, node = self._match(self._aligned(fill[:cap]), buf, req.extra_key, hit=True)
        self._hold(req, node, indices, list(indices))
        req.cache_inserted_len = 0  # a new (or resumed: SGLang resets it) request
        return indices

    def _hold(self, req: Req, node: TreeNode | None, indices: list[int], kv: list[int]) -> None:
        """Move the request's lock to ``node`` (None: release it), the end of its tree prefix
        ``indices``; ``kv`` becomes its slots."""
        if node is not None:
            self.inc_lock_ref(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_indices, req.kv_indices = node, indices, kv
        req.cache_protected_len = len(indices)

    def _check_req(self, req: Req) -> tuple[list[int], array | None, list[int], np.ndarray]:
        """The request's tokens that have KV (a list and its array, or None) and their slots
        (a list and an array), validated before the tree changes: the slots past the tree's
        prefix must be the request's, allocated."""
        if req.last_node is None:
            raise LockError(f"request {req.rid} holds no lock; call match_prefix_for_req first")
        _check_priority(req.priority, f"request {req.rid}'s priority")
        done = req.cache_inserted_len
        if type(done) is bool or not isinstance(done, int) or done < 0:
            raise InvalidArgumentError(
                f"request {req.rid}'s cache_inserted_len must be an int >= 0, got {done!r}"
            )
        fill, buf = req.checked_fill_ids()
        kv, slots = _as_slots(req.kv_indices, "kv_indices")
        if len(kv) > len(fill):
            raise InvalidKeyError(
                f"request {req.rid} has {len(kv)} KV slots for {len(fill)} tokens"
            )
        if self.token_to_kv_pool_allocator is not None:  # its own: allocated, not the tree's
            self.token_to_kv_pool_allocator.check_allocated(slots[req.cache_protected_len :])
        req.kv_indices = kv
        return fill[: len(kv)], buf, kv, slots

    def cache_unfinished_req(self, req: Req) -> None:
        """Insert what a running request has computed so far and move its lock down.

        After a chunk of chunked prefill (or to share a long decode), the request's computed
        tokens go into the tree. Slots it computed for tokens that another request inserted in
        the meantime are duplicates: they are freed and the request switches to the tree's
        slots (SGLang's dedupe contract: the tree owns exactly one copy of each prefix).
        The partial last page stays private to the request.
        """
        token_ids, buf, kv, slots = self._check_req(req)
        n = len(token_ids) - len(token_ids) % self.page_size
        prefix_len = self._insert_req(req, token_ids[:n], buf, kv, slots)
        self._free(kv[req.cache_protected_len : prefix_len])
        new_indices, new_node = self._match(token_ids[:n], buf, req.extra_key, hit=False)
        kv[: len(new_indices)] = new_indices
        self._hold(req, new_node, new_indices, kv)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Insert a finished request's tokens, free its duplicate and unaligned slots, and
        release its lock (SGLang's ``cache_finished_req``).

        Only tokens with KV are cached: ``req.kv_indices`` must not include the last sampled
        token (it was never fed back to the model).

        Args:
            is_insert: False frees the request's own slots instead of caching them (a request
                deferred or refused at admission, or a cache that reuses nothing).

        Raises:
            LockError: the request holds no lock.
            InvalidKeyError, UnknownBlockError: its slots are not its own (checked first).
        """
        token_ids, buf, kv, slots = self._check_req(req)
        n = prefix_len = req.cache_protected_len
        if is_insert:
            n = len(token_ids) - len(token_ids) % self.page_size
            prefix_len = self._insert_req(req, token_ids[:n], buf, kv, slots)
        self._free(kv[req.cache_protected_len : prefix_len] + kv[n:])
        self._hold(req, None, [], [])

    def _insert_req(self, req: Req, key: list[int], buf, kv: list[int], slots) -> int:
        """Insert a request's aligned computed tokens ``key`` (slots ``kv``, also as the array
        ``slots``) with its priority, counting it once per node (``cache_inserted_len``)."""
        prio, done = int(req.priority), req.cache_inserted_len
        prefix_len = self._insert(key, buf, kv, slots, req.extra_key, prio, done, allocated=True)
        req.cache_inserted_len = max(done, len(key))
        return prefix_len

    def _free(self, slots: list[int]) -> None:
        if self.token_to_kv_pool_allocator is not None and slots:
            self.token_to_kv_pool_allocator.free(slots)

    # ------------------------------------------------------------------ inspection
    def format_tree(self, decode: Callable[[list[int]], str] | None = None) -> str:
        """The tree as indented text: one line per node with its id, size, lock_ref and key
        (decoded with ``decode`` if given, else the first token ids)."""
        lines = [f"root  #tokens={self.total_size()}"]

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                if decode is not None:
                    label = repr(decode(child.key))
                else:
                    label = str(child.key[:10])[:-1] + (", ...]" if len(child.key) > 10 else "]")
                lines.append(
                    f"{'  ' * depth}[{child.id}] len={len(child.key)} "
                    f"lock_ref={child.lock_ref} {label}"
                )
                walk(child, depth + 1)

        walk(self.root_node, 1)
        return "\n".join(lines)

    def pretty_print(self, decode: Callable[[list[int]], str] | None = None) -> None:
        """Print :meth:`format_tree`."""
        print(self.format_tree(decode))

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
        """One node's own invariants (see :meth:`check_invariants`)."""

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

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, policy={self.eviction_policy.name!r}, "
            f"nodes={sum(1 for _ in self.nodes())}, evictable={self.evictable_size_}, "
            f"protected={self.protected_size_})"
        )
