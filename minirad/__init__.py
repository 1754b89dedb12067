"""minirad: KV-cache management for LLM/VLM serving, built to be read.

The radix prefix cache of SGLang's RadixAttention, vLLM's paged block pool with hashed prefix
caching, eviction policies, multimodal cache keys, and the events that the visualizer draws.
"""

from .block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager
from .errors import (
    ImageError,
    InvalidArgumentError,
    InvalidKeyError,
    InvariantError,
    LockError,
    MiniradError,
    OutOfMemoryError,
    UnknownBlockError,
)
from .events import EventBus, EventRecorder, load_events, save_events
from .eviction import POLICIES, get_policy
from .kv_pool import KVCache, TokenToKVPoolAllocator, block_table_from_slots, slot_mapping
from .multimodal import MultiModalItem, hash_image, pad_input_ids, pad_value
from .radix_cache import MatchResult, RadixCache, Req, TreeNode

__version__ = "0.1.0"

__all__ = [
    "BlockPool",
    "EventBus",
    "EventRecorder",
    "FreeKVCacheBlockQueue",
    "ImageError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvariantError",
    "KVCache",
    "KVCacheBlock",
    "KVCacheManager",
    "LockError",
    "MatchResult",
    "MiniradError",
    "MultiModalItem",
    "OutOfMemoryError",
    "POLICIES",
    "RadixCache",
    "Req",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "UnknownBlockError",
    "block_table_from_slots",
    "get_policy",
    "hash_image",
    "load_events",
    "pad_input_ids",
    "pad_value",
    "save_events",
    "slot_mapping",
]
