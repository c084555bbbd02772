"""Per-attention-type block management (vLLM's SingleTypeKVCacheManager).

One instance manages the blocks of one KV-cache group: the layers that share an
attention type and therefore need the same blocks for a request. What differs between
attention types is which blocks a request must keep and what counts as a prefix-cache
hit; that is what subclasses define. kvloom's models only have full attention today
(``FullAttentionManager``); a sliding-window manager would subclass
``SingleTypeKVCacheManager``, free blocks that slide out of the window, and search cache
hits from the right (see the hybrid KV cache manager design).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvloom.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvloom.kv_cache.hashing import BlockHash
from kvloom.request import Request


class SingleTypeKVCacheManager(ABC):
    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        #: Each request's block table, in token order (append-only while it runs).
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
            self.block_pool.cache_full_blocks(self.req_to_blocks[request_id], block_hashes, num_cached, num_full)
            self.num_cached_blocks[request_id] = num_full

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

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks that give the longest usable prefix (at most
        ``max_num_blocks`` blocks)."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention keeps every block; a hit is the longest run of cached leading blocks."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        get_cached_block = self.block_pool.get_cached_block
        for block_hash in block_hashes[:max_num_blocks]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


#: Manager class per kind of KV-cache group ("sliding_window" would be the next one).
SINGLE_TYPE_MANAGERS: dict[str, type[SingleTypeKVCacheManager]] = {
    "full_attention": FullAttentionManager,
}
