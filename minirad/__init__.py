"""minirad: KV-cache management for LLM/VLM serving, built to be read.

The radix prefix cache of SGLang's RadixAttention, vLLM's paged block pool with hashed prefix
caching, eviction policies, multimodal cache keys, and the events that the visualizer draws.

The names below import lazily (PEP 562): ``import minirad`` does not import torch, so the
``minirad`` command answers ``--help`` at once. ``from minirad import RadixCache`` imports
the one module that defines it (:mod:`minirad.lazy`).
"""

from __future__ import annotations

from minirad.lazy import lazy_exports

__version__ = "0.1.0"

# Public name -> the submodule that defines it (add a name here to export it).
_EXPORTS: dict[str, str] = {
    "BlockPool": "kvcache.block_pool",
    "FreeKVCacheBlockQueue": "kvcache.block_pool",
    "KVCacheBlock": "kvcache.block_pool",
    "KVCacheManager": "kvcache.kv_cache_manager",
    "GrammarError": "errors",
    "ImageError": "errors",
    "InvalidArgumentError": "errors",
    "InvalidKeyError": "errors",
    "InvariantError": "errors",
    "LockError": "errors",
    "MiniradError": "errors",
    "OutOfMemoryError": "errors",
    "UnknownBlockError": "errors",
    "EventBus": "events",
    "EventRecorder": "events",
    "load_events": "events",
    "save_events": "events",
    "EVICTION_POLICIES": "kvcache.eviction",
    "get_policy": "kvcache.eviction",
    "KVCache": "kvcache.kv_pool",
    "TokenToKVPoolAllocator": "kvcache.kv_pool",
    "block_table_from_slots": "kvcache.kv_pool",
    "slot_mapping": "kvcache.kv_pool",
    "MultiModalItem": "kvcache.multimodal",
    "hash_image": "kvcache.multimodal",
    "pad_input_ids": "kvcache.multimodal",
    "pad_value": "kvcache.multimodal",
    "MatchResult": "kvcache.radix_cache",
    "RadixCache": "kvcache.radix_cache",
    "Req": "kvcache.radix_cache",
    "TreeNode": "kvcache.radix_cache",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
