"""Paged KV-cache management: block pool, free queue, block hashing, prefix caching."""

from kvloom.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvloom.kv_cache.manager import KVCacheManager
from kvloom.kv_cache.slot_mapping import compute_slot_mapping

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager", "compute_slot_mapping"]
