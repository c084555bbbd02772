"""Paged KV-cache management: block pool, free queue, block hashing, prefix caching."""

from kvloom.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvloom.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager"]
