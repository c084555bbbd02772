"""Paged KV-cache management: block pool, free queue, block hashing, prefix caching, and
the KV-cache groups of hybrid models (specs per layer, one manager per group, the coordinator)."""

from kvloom.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvloom.kv_cache.manager import KVCacheManager
from kvloom.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

__all__ = [
    "BlockPool",
    "ChunkedLocalAttentionSpec",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "SlidingWindowSpec",
]
