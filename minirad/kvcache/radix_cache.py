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

The cache is put together from one module per concept, read in this order (the core first):

- ``radix_node.py``: :class:`TreeNode` and :class:`MatchResult`, the data;
- ``radix_tree.py``: the tree: child keys, walk, match, split, insert (``RadixTree``);
- ``radix_slots.py``: which KV slots the tree holds, checked before it takes them;
- ``radix_locks.py``: ``inc_lock_ref`` / ``dec_lock_ref``, the evictable and protected sizes;
- ``radix_evict.py``: the evictable leaves, their heap, ``evict`` and ``reset``;
- ``radix_requests.py``: :class:`Req` and the request lifecycle (``*_req``);
- ``radix_invariants.py``: ``check_invariants``;
- ``radix_format.py``: ``format_tree``, ``pretty_print``;
- ``radix_events.py``: the events each operation publishes.

Each part but the core is a mixin over the same object (``self``); a part with state of its
own starts it in ``_init_tree``. Where SGLang 0.5.23's per-component data
(``UnifiedRadixCache``: Full and SWA values per node, tombstones, window locks, cascade
eviction) hooks in, each module's docstring says, and the code marks each place
"Component seam"; ``swa_tree.py`` (``SWATree``, the tree of ``SWARadixCache``) is this tree with
an SWA component at those seams.
"""

from __future__ import annotations

from minirad.errors import InvalidArgumentError
from minirad.events import EventBus
from minirad.kvcache.eviction import EvictionPolicy, get_policy
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.radix_evict import RadixEvictionMixin
from minirad.kvcache.radix_format import RadixFormatMixin
from minirad.kvcache.radix_invariants import RadixInvariantsMixin
from minirad.kvcache.radix_locks import RadixLocksMixin
from minirad.kvcache.radix_node import MatchResult, TreeNode
from minirad.kvcache.radix_requests import RadixRequestsMixin, Req
from minirad.kvcache.radix_slots import MAX_SIMULATED_SLOT as MAX_SIMULATED_SLOT
from minirad.kvcache.radix_slots import RadixSlotsMixin
from minirad.kvcache.radix_tree import RadixTree
from minirad.kvcache.radix_tree import _check_extra_key as _check_extra_key  # hiradix_cache

__all__ = ["MatchResult", "RadixCache", "Req", "TreeNode"]


class RadixCache(
    RadixRequestsMixin,
    RadixLocksMixin,
    RadixEvictionMixin,
    RadixSlotsMixin,
    RadixInvariantsMixin,
    RadixFormatMixin,
    RadixTree,
):
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
