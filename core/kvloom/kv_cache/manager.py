"""KVCacheManager: the scheduler's interface to the paged KV cache and prefix cache.

Scheduling a request takes two calls:

1. ``get_computed_blocks(request)`` (new or resumed requests only): the longest prefix
   of the request's full blocks already in the prefix cache, valid for every KV-cache
   group. A hit never covers the last token: at least one token must be computed to get
   logits.
2. ``allocate_slots(request, num_new_tokens, new_computed_blocks, num_new_computed_tokens)``:
   returns None when the pool cannot provide the blocks (nothing changes but blocks no
   query reads any more, which are given back first); otherwise takes a reference on the
   cache-hit blocks (pulling free ones off the free queue so they cannot be evicted),
   pops new blocks from the head of the free queue (evicting their cached content) and
   registers every block that the known tokens fill in the prefix cache right away, so
   that requests scheduled later in the same step can reuse them.

``free(request)`` returns a finished or preempted request's blocks to the tail of the
free queue, last block first. Freed blocks keep their hash until they are reused.

Blocks are per KV-cache group (``kvloom.kv_cache.spec``): ``KVCacheBlocks`` and
``get_block_ids`` hold one list per group, in group order; a model with one group (every
model with a single attention type) has one-element tuples and the paths of the plain
paged cache. The per-group work is the coordinator's (``kvloom.kv_cache.coordinator``).

``free_tail(request, num_tokens)`` returns only the blocks past a request's first
``num_tokens`` slots (speculative decoding: the slots of rejected drafts).

Only blocks filled by known tokens are cached (``Request.all_token_ids``): draft tokens
are scheduled as new tokens but never hashed, so a rejected draft never reaches the
prefix cache.
"""

from __future__ import annotations

from kvloom.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvloom.kv_cache.coordinator import KVCacheBlocks, get_kv_cache_coordinator
from kvloom.kv_cache.hashing import get_hash_function, update_block_hashes
from kvloom.kv_cache.single_type_manager import SingleTypeKVCacheManager
from kvloom.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvloom.metrics.scheduler_stats import PrefixCacheStats
from kvloom.request import Request


def block_ids_of(blocks: KVCacheBlocks) -> tuple[list[int], ...]:
    """The block ids of per-group blocks (what the model runner receives)."""
    if len(blocks) == 1:  # one group: every decode step of every request comes here
        group = blocks[0]
        return ([block.block_id for block in group],) if group else ([],)
    return tuple([block.block_id for block in group] for group in blocks)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        log_stats: bool = False,
        reserve_null_block: bool = False,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if kv_cache_config is None:  # one group of full attention: the plain paged cache
            kv_cache_config = KVCacheConfig((KVCacheGroupSpec((0,), FullAttentionSpec(block_size)),))
        specs = kv_cache_config.specs
        if any(spec.block_size != block_size for spec in specs):
            raise ValueError(f"every KV-cache group must use block_size {block_size}, got "
                             f"{sorted({spec.block_size for spec in specs})}")  # fmt: skip
        self.block_size = block_size
        self.kv_cache_config = kv_cache_config
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_function(hash_algo) if enable_caching else None
        # Block 0 is the placeholder of skipped blocks when some group skips blocks.
        self.block_pool = BlockPool(num_blocks, reserve_null_block or kv_cache_config.needs_null_block)
        self.coordinator = get_kv_cache_coordinator(kv_cache_config, self.block_pool, enable_caching)
        self.managers = self.coordinator.managers
        #: The only group's manager, for the one-group fast paths (None with several groups).
        self.single = self.managers[0] if len(self.managers) == 1 and not self.coordinator.skips_blocks else None
        self.num_groups = len(self.managers)
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None

    @property
    def manager(self) -> SingleTypeKVCacheManager:
        """The first KV-cache group's manager (the only one of a single-group model)."""
        return self.managers[0]

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """The first group's block table per request (the only one of a single-group model)."""
        return self.managers[0].req_to_blocks

    @property
    def usage(self) -> float:
        """Fraction of the KV cache owned by requests, 0..1."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def empty_blocks(self) -> KVCacheBlocks:
        return self.coordinator.empty_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Cached blocks (per group) of the request's longest cached prefix, and how many
        tokens they hold.

        Pooling and prompt-logprobs requests get no hits: they need a result for every
        prompt position, and a hit skips computing them.
        """
        if self.hash_fn is None or request.skip_prefix_cache_reading:
            return self.empty_blocks(), 0
        block_hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        return self.coordinator.find_longest_cache_hit(block_hashes, max_num_blocks)

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
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones, plus
        ``num_lookahead_tokens`` slots after those (speculative decoding: where a draft
        model writes its drafts' KV after the step).

        ``new_computed_blocks``/``num_new_computed_tokens`` are what
        ``get_computed_blocks`` returned for a request being admitted. Returns the newly
        allocated blocks per group (possibly none), or None if there are not enough free
        blocks. ``delay_cache_blocks``: the new blocks' KV arrives later (a KV connector's
        asynchronous load): they enter the prefix cache through ``cache_blocks`` once it has.
        """
        request_id = request.request_id
        num_slots = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        has_hits = new_computed_blocks is not None and any(new_computed_blocks)
        single = self.single
        if single is not None:
            # One full-attention group: the plain paged cache's path.
            if has_hits:
                assert new_computed_blocks is not None
                num_needed = single.get_num_blocks_to_allocate(request_id, num_slots, new_computed_blocks[0])
                if num_needed > self.block_pool.free_block_queue.num_free_blocks:
                    return None
                single.save_new_computed_blocks(request_id, new_computed_blocks[0])
            blocks = single.req_to_blocks.get(request_id)
            if blocks is not None and num_slots <= len(blocks) * self.block_size:
                new_blocks: KVCacheBlocks = ([],)  # the common decode step: the last block has room
            else:
                group_blocks = single.allocate_new_blocks(request_id, num_slots)
                if group_blocks is None:
                    return None
                new_blocks = (group_blocks,)
        else:
            coordinator = self.coordinator
            if coordinator.skips_blocks:
                # Blocks no query reads any more go back first: they may serve this request.
                coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
            computed = new_computed_blocks if has_hits else self.empty_blocks()
            assert computed is not None
            num_needed = coordinator.get_num_blocks_to_allocate(request_id, num_slots, computed)
            if num_needed > self.block_pool.free_block_queue.num_free_blocks:
                return None
            if has_hits:
                coordinator.save_new_computed_blocks(request_id, computed)
            new_blocks = coordinator.allocate_new_blocks(request_id, num_slots)
        if self.hash_fn is not None and not delay_cache_blocks:
            # Cache the blocks filled by known tokens; draft tokens may be rejected.
            num_tokens = len(request.all_token_ids)
            num_filled = num_slots - num_lookahead_tokens
            num_full = (num_filled if num_filled < num_tokens else num_tokens) // self.block_size
            if num_full > self.managers[0].num_cached_blocks.get(request_id, 0):
                if num_full > len(request.block_hashes):
                    update_block_hashes(request, self.block_size, self.hash_fn)
                self.coordinator.cache_blocks(request, request.block_hashes, num_full * self.block_size)  # type: ignore[arg-type]
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that its first ``num_tokens`` tokens fill (their
        KV is in the cache now) in the prefix cache."""
        if self.hash_fn is not None:
            update_block_hashes(request, self.block_size, self.hash_fn)
            self.coordinator.cache_blocks(request, request.block_hashes, num_tokens)  # type: ignore[arg-type]

    def free(self, request: Request) -> None:
        self.coordinator.free(request)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (null-block placeholders included)."""
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (the model runner's block-table rows)."""
        return block_ids_of(self.coordinator.get_blocks(request_id))

    def free_tail(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks past its first ``num_tokens`` slots in every group
        (those of rejected drafts); returns how many blocks it keeps per group."""
        kept = [manager.free_tail(request.request_id, num_tokens) for manager in self.managers]
        return kept[0]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (only possible while no request holds blocks)."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True
