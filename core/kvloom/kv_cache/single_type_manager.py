"""Per-attention-type block management (vLLM's SingleTypeKVCacheManager).

One instance manages the blocks of one KV-cache group (``kvloom.kv_cache.spec``): the
layers that share an attention type and therefore need the same blocks for a request.
What differs between attention types is which blocks a request must keep and what
counts as a prefix-cache hit:

- ``FullAttentionManager``: every block is kept; a hit is the longest run of cached
  leading blocks (searched from the left, stopping at the first miss).
- ``SlidingWindowManager`` / ``ChunkedLocalAttentionManager``: blocks that no query from
  the next token on reads (``KVCacheSpec.num_skipped_tokens``) are given back to the pool
  (``remove_skipped_blocks``); they keep their hash, so they stay in the prefix cache until
  the LRU queue hands them out. Their place in the block table holds the pool's null block
  (block 0, never written, never read by a query). A hit of ``k`` blocks only needs the
  blocks the next token reads cached, so hits are searched from the right (the seeds'
  algorithm: the first run of cached blocks long enough, scanning back from the end).

Hit searches are classmethods over a list of group ids: a hybrid model may have several
groups of one type, and a hit must hold in every one of them (the coordinator,
``kvloom.kv_cache.coordinator``, intersects the types).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvloom.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvloom.kv_cache.hashing import BlockHash
from kvloom.kv_cache.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvloom.request import Request


class SingleTypeKVCacheManager:
    """Full attention's rules; subclasses for attention types that skip blocks."""

    #: Whether requests give back blocks as they advance (``remove_skipped_blocks`` does something).
    skips_blocks = False

    def __init__(self, block_pool: BlockPool, kv_cache_spec: KVCacheSpec, group_id: int = 0) -> None:
        self.block_pool = block_pool
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.group_id = group_id
        #: Each request's block table, in token order (append-only while it runs; entries
        #: of skipped blocks are replaced by the null block).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        #: How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free-queue blocks that holding ``num_tokens`` slots would consume, counting
        cache-hit blocks that sit in the free queue (taking them removes them from it)."""
        blocks = self.req_to_blocks.get(request_id)
        num_have = (len(blocks) if blocks else 0) + len(new_computed_blocks)
        num_new = max(0, -(-num_tokens // self.block_size) - num_have)
        return num_new + sum(1 for block in new_computed_blocks if block.ref_cnt == 0)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Add prefix-cache hits to a request that has no blocks yet."""
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            self.req_to_blocks.setdefault(request_id, []).extend(new_computed_blocks)
            self.num_cached_blocks[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock] | None:
        """Grow the request's block table to hold ``num_tokens`` slots: the new blocks,
        or None (and no change) if the free queue has too few."""
        blocks = self.req_to_blocks.get(request_id)
        num_new = -(-num_tokens // self.block_size) - (len(blocks) if blocks is not None else 0)
        if num_new <= 0:  # the common decode step
            return []
        if num_new > self.block_pool.free_block_queue.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(num_new)
        if blocks is None:
            self.req_to_blocks[request_id] = list(new_blocks)
        else:
            blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, block_hashes: list[BlockHash], num_tokens: int) -> None:
        """Register the request's blocks that ``num_tokens`` known tokens fill."""
        request_id = request.request_id
        num_cached = self.num_cached_blocks.get(request_id, 0)
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                self.req_to_blocks[request_id], block_hashes, num_cached, num_full, self.group_id
            )
            self.num_cached_blocks[request_id] = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks no query from ``num_computed_tokens`` on reads (none here)."""

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (it is the least reusable).

        Blocks past ``request.num_computed_tokens`` that were cached when scheduled (a
        request preempted in the same step it was scheduled) never received their KV:
        they are removed from the prefix cache before they go back to the pool.
        """
        request_id = request.request_id
        blocks = self.req_to_blocks.pop(request_id, None)
        num_cached = self.num_cached_blocks.pop(request_id, 0)
        if not blocks:
            return
        num_computed_blocks = request.num_computed_tokens // self.block_size
        for block in blocks[num_computed_blocks:num_cached]:
            if block.ref_cnt == 1:
                self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def free_tail(self, request_id: str, num_tokens: int) -> int:
        """Return to the pool the request's blocks past those that hold its first
        ``num_tokens`` slots (speculative decoding: the slots of rejected drafts), last
        block first; the number of blocks it keeps. Blocks past the known tokens were never
        cached; one that was (a caller's mistake) leaves the prefix cache first."""
        blocks = self.req_to_blocks.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return len(blocks) if blocks is not None else 0
        tail = blocks[keep:]
        del blocks[keep:]
        num_cached = self.num_cached_blocks.get(request_id, 0)
        if num_cached > keep:
            for block in tail[: num_cached - keep]:
                if block.ref_cnt == 1:
                    self.block_pool.uncache_block(block)
            self.num_cached_blocks[request_id] = keep
        self.block_pool.free_blocks(reversed(tail))
        return keep

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_num_blocks: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Per group of ``group_ids``, the blocks of the longest prefix (at most
        ``max_num_blocks`` blocks) that every one of them has cached: full attention's
        search, from the left."""
        get_cached_block = block_pool.get_cached_block
        if len(group_ids) == 1:  # the common case: one group, no intersection
            group_id = group_ids[0]
            hits: list[KVCacheBlock] = []
            for block_hash in block_hashes[:max_num_blocks]:
                block = get_cached_block(block_hash, group_id)
                if block is None:
                    break
                hits.append(block)
            return (hits,)
        per_group: tuple[list[KVCacheBlock], ...] = tuple([] for _ in group_ids)
        for block_hash in block_hashes[:max_num_blocks]:
            found = [get_cached_block(block_hash, g) for g in group_ids]
            if any(block is None for block in found):
                break
            for hits, block in zip(per_group, found):
                hits.append(block)  # type: ignore[arg-type]
        return per_group


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention keeps every block; a hit is the longest run of cached leading blocks."""


class SkippingManager(SingleTypeKVCacheManager):
    """Attention that reads only recent positions: blocks before them are given back and
    hits are searched from the right (``SlidingWindowManager``, ``ChunkedLocalAttentionManager``)."""

    skips_blocks = True

    def __init__(self, block_pool: BlockPool, kv_cache_spec: KVCacheSpec, group_id: int = 0) -> None:
        if block_pool.null_block is None:
            raise ValueError(f"{type(self).__name__} needs a block pool with a null block (reserve_null_block=True)")
        super().__init__(block_pool, kv_cache_spec, group_id)
        self.null_block: KVCacheBlock = block_pool.null_block

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped = min(self.kv_cache_spec.num_skipped_tokens(num_computed_tokens) // self.block_size, len(blocks))
        null = self.null_block
        removed = []
        # Back from the last skipped block to the first one given back earlier.
        for i in range(num_skipped - 1, -1, -1):
            block = blocks[i]
            if block is null:
                break
            removed.append(block)
            blocks[i] = null
        if removed:
            # Oldest first to the LRU end: the block furthest back is evicted first.
            self.block_pool.free_blocks(reversed(removed))

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_num_blocks: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Per group, the blocks of the longest hit of at most ``max_num_blocks`` blocks:
        ``k`` blocks are a hit when the blocks the token after them reads (from
        ``num_skipped_tokens(k * block_size)``) are cached in every group. Scans from the
        right: ``end`` is the longest hit still possible, lowered past every miss."""
        null = block_pool.null_block
        assert null is not None
        block_size = kv_cache_spec.block_size
        get_cached_block = block_pool.get_cached_block
        per_group = tuple([null] * max_num_blocks for _ in group_ids)
        end = max_num_blocks
        for i in range(max_num_blocks - 1, -1, -1):
            found = [get_cached_block(block_hashes[i], g) for g in group_ids]
            if any(block is None for block in found):
                end = i  # no hit can span block i
                continue
            for hits, block in zip(per_group, found):
                hits[i] = block  # type: ignore[assignment]
            if i <= kv_cache_spec.num_skipped_tokens(end * block_size) // block_size:
                # Blocks i .. end-1 are cached and cover what the token at end reads.
                return tuple(hits[:end] for hits in per_group)
        return tuple([] for _ in group_ids)


class SlidingWindowManager(SkippingManager):
    """Sliding-window attention: keeps the blocks of the last ``sliding_window - 1`` positions
    (and those being computed)."""


class ChunkedLocalAttentionManager(SkippingManager):
    """Chunked local attention: keeps the blocks of the current chunk."""


#: Manager class per spec type.
SINGLE_TYPE_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
}


def get_manager_for_kv_cache_spec(
    block_pool: BlockPool, kv_cache_spec: KVCacheSpec, group_id: int = 0
) -> SingleTypeKVCacheManager:
    """The manager of one KV-cache group."""
    cls = SINGLE_TYPE_MANAGERS.get(type(kv_cache_spec))
    if cls is None:
        raise ValueError(f"no KV-cache manager for {type(kv_cache_spec).__name__} "
                         f"(supported: {', '.join(t.__name__ for t in SINGLE_TYPE_MANAGERS)})")  # fmt: skip
    return cls(block_pool, kv_cache_spec, group_id)
