"""The KV cache: what a serving engine keeps of the keys and values it has computed, and finds
again.

- :class:`RadixCache` (``radix_cache.py``): SGLang's radix prefix cache, token by token, with
  lock references, node splits and leaf eviction; :mod:`~minirad.kvcache.eviction` picks the leaf.
- :class:`~minirad.kvcache.hiradix_cache.HiRadixCache` (``hiradix_cache.py``): the radix cache
  over two tiers, device and host (SGLang's HiCache), with its host pool and copy seam in
  ``host_pool.py``.
- :class:`TokenToKVPoolAllocator` and :class:`KVCache` (``kv_pool.py``): the token slots and the
  one K/V tensor they index.
- :class:`BlockPool` and :class:`KVCacheManager` (``block_pool.py``, ``kv_cache_manager.py``):
  vLLM's paged cache, blocks found by chained hashes. For hybrid models (sliding-window layers
  beside full attention), vLLM 0.32's design: per-layer specs (``kv_cache_spec.py``:
  ``FullAttentionSpec``, ``SlidingWindowSpec``), KV-cache groups of one page size
  (``kv_cache_groups.py``), one manager per attention type (``single_type_kv_cache_manager.py``),
  the fixed-point hit of ``HybridKVCacheCoordinator`` (``kv_cache_coordinator.py``) and the
  checker of its invariants (``kv_cache_invariants.py``).
- :class:`~minirad.kvcache.swa_radix_cache.SWARadixCache` (``swa_*.py``): SGLang 0.5.23's
  hybrid design, its ``UnifiedRadixCache`` with (FULL, SWA) components: per-node values, locks
  and LRU lists per component, tombstones, the window validator and window lock
  (``swa_window.py``, the one home of those rules), cascade eviction, a full and an SWA slot
  pool (``swa_pools.py``), out-of-window frees with ``evicted_seqlen``.
- ``multimodal.py``: cache keys for images (content hashes, pad ids, block extra keys);
  ``tokens.py``: the token-id checks both caches share.

This layer imports nothing from the model, the engine or the servers: the chapters build it and
test it alone.
"""
