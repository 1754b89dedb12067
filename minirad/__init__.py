"""minirad: KV-cache management for LLM/VLM serving, built to be read.

The radix prefix cache of SGLang's RadixAttention, vLLM's paged block pool with hashed prefix
caching, eviction policies, multimodal cache keys, and the events that the visualizer draws.

The names below import lazily (PEP 562): ``import minirad`` does not import torch, so the
``minirad`` command answers ``--help`` at once. ``from minirad import RadixCache`` imports
the one module that defines it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the submodule that defines it (add a name here to export it).
_EXPORTS: dict[str, str] = {
    "BlockPool": "block_pool",
    "FreeKVCacheBlockQueue": "block_pool",
    "KVCacheBlock": "block_pool",
    "KVCacheManager": "kv_cache_manager",
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
    "POLICIES": "eviction",
    "get_policy": "eviction",
    "KVCache": "kv_pool",
    "TokenToKVPoolAllocator": "kv_pool",
    "block_table_from_slots": "kv_pool",
    "slot_mapping": "kv_pool",
    "MultiModalItem": "multimodal",
    "hash_image": "multimodal",
    "pad_input_ids": "multimodal",
    "pad_value": "multimodal",
    "MatchResult": "radix_cache",
    "RadixCache": "radix_cache",
    "Req": "radix_cache",
    "TreeNode": "radix_cache",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first use, and cache the name here.

    Raises:
        AttributeError: ``name`` is not one of :data:`__all__` (``from minirad import x``
            then falls back to importing the submodule ``minirad.x``).
    """
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
