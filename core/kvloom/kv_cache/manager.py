"""KVCacheManager: the scheduler's interface to the paged KV cache and prefix cache.

Scheduling a request takes two calls:

1. ``get_computed_blocks(request)`` (new or resumed requests only): the longest prefix
   of the request's full blocks already in the prefix cache. A hit never covers the
   last token: at least one token must be computed to get logits.
2. ``allocate_slots(request, num_new_tokens, new_computed_blocks, num_new_computed_tokens)``:
   returns None when the pool cannot provide the blocks (nothing changes); otherwise
   takes a reference on the cache-hit blocks (pulling free ones off the free queue so
   they cannot be evicted), pops new blocks from the head of the free queue (evicting
   their cached content) and registers every block that the known tokens fill in the
   prefix cache right away, so that requests scheduled later in the same step can reuse
   them.

``free(request)`` returns a finished or preempted request's blocks to the tail of the
free queue, last block first. Freed blocks keep their hash until they are reused.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvloom.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvloom.kv_cache.hashing import get_hash_function, update_block_hashes
from kvloom.kv_cache.single_type_manager import SINGLE_TYPE_MANAGERS
from kvloom.metrics.scheduler_stats import PrefixCacheStats
from kvloom.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        log_stats: bool = False,
        reserve_null_block: bool = False,
        group_kind: str = "full_attention",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if group_kind not in SINGLE_TYPE_MANAGERS:
            raise ValueError(f"group_kind must be one of {sorted(SINGLE_TYPE_MANAGERS)}; got {group_kind!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_function(hash_algo) if enable_caching else None
        self.block_pool = BlockPool(num_blocks, reserve_null_block)
        self.manager = SINGLE_TYPE_MANAGERS[group_kind](self.block_pool, block_size)
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        return self.manager.req_to_blocks

    @property
    def usage(self) -> float:
        """Fraction of the KV cache owned by requests, 0..1."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks of the request's longest cached prefix, and how many tokens they hold.

        Pooling and prompt-logprobs requests get no hits: they need a result for every
        prompt position, and a hit skips computing them.
        """
        if self.hash_fn is None or request.skip_prefix_cache_reading:
            return [], 0
        block_hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        blocks = self.manager.find_longest_cache_hit(block_hashes, max_num_blocks)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one newly scheduled request's lookup (tokens queried and found)."""
        stats = self.prefix_cache_stats
        if stats is not None:
            stats.requests += 1
            stats.queries += num_tokens
            stats.hits += num_hit_tokens

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The counters since the last call (then reset), or None without log_stats."""
        stats = self.prefix_cache_stats
        if stats is None:
            return None
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks``/``num_new_computed_tokens`` are what
        ``get_computed_blocks`` returned for a request being admitted. Returns the newly
        allocated blocks (possibly none), or None if there are not enough free blocks.
        ``delay_cache_blocks``: the new blocks' KV arrives later (a KV connector's
        asynchronous load): they enter the prefix cache through ``cache_blocks`` once it has.
        """
        manager = self.manager
        request_id = request.request_id
        num_slots = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if new_computed_blocks:
            num_needed = manager.get_num_blocks_to_allocate(request_id, num_slots, new_computed_blocks)
            if num_needed > self.block_pool.free_block_queue.num_free_blocks:
                return None
            manager.save_new_computed_blocks(request_id, new_computed_blocks)
        blocks = manager.req_to_blocks.get(request_id)
        if blocks is not None and num_slots <= len(blocks) * self.block_size:
            new_blocks = []  # the common decode step: the last block has room
        else:
            new_blocks = manager.allocate_new_blocks(request_id, num_slots)
            if new_blocks is None:
                return None
        if self.hash_fn is not None and not delay_cache_blocks:
            # Cache the blocks filled by known tokens; draft tokens may be rejected.
            num_tokens = len(request.all_token_ids)
            num_full = (num_slots if num_slots < num_tokens else num_tokens) // self.block_size
            if num_full > manager.num_cached_blocks.get(request_id, 0):
                if num_full > len(request.block_hashes):
                    update_block_hashes(request, self.block_size, self.hash_fn)
                manager.cache_blocks(request, request.block_hashes, num_full * self.block_size)  # type: ignore[arg-type]
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that its first ``num_tokens`` tokens fill (their
        KV is in the cache now) in the prefix cache."""
        if self.hash_fn is not None:
            update_block_hashes(request, self.block_size, self.hash_fn)
            self.manager.cache_blocks(request, request.block_hashes, num_tokens)  # type: ignore[arg-type]

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.manager.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (only possible while no request holds blocks)."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True
