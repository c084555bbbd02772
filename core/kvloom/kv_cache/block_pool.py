"""The block pool: every KV-cache block, the LRU free queue and the prefix-cache map.

All ``KVCacheBlock`` objects are created once, when the pool is built, so the hot path
never allocates Python objects for blocks. A block is either *used* (``ref_cnt > 0``,
owned by that many requests) or *free* (``ref_cnt == 0``, in the free queue). A free
block may still carry a ``block_hash``: its KV data is valid and can be reused by a
request with the same prefix until the block is popped from the head of the free queue
and re-allocated, which evicts it from the prefix cache (LRU eviction).

KV-cache groups (``kvloom.kv_cache.spec``) share the pool: the same tokens cached by two
groups are two blocks, so the prefix-cache map is keyed by the block hash *and* the group
(``hash_key``); one LRU queue serves every group, as in the seeds' design.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvloom.kv_cache.hashing import BlockHash

logger = logging.getLogger(__name__)


def hash_key(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The prefix-cache key of a block of KV-cache group ``group_id``. Group 0's key is the
    block hash itself (a single-group pool is the plain prefix cache); other groups append
    their id (hashes of one algorithm all have one length, so keys never collide)."""
    return block_hash if group_id == 0 else block_hash + group_id.to_bytes(4, "little")


class KVCacheBlock:
    """One block of ``block_size`` token slots in every attention layer's KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set when the block is full and cached; cleared when the block is evicted.
        self.block_hash: BlockHash | None = None
        # Links of the doubly linked free queue (None while the block is used).
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, least recently used at the head.

    The links live in the blocks themselves, so removing a block from the middle (a
    prefix-cache hit on a free block) is O(1) and no wrapper objects are created. Two
    sentinel blocks (id -1) bound the list so that no operation special-cases the ends.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The ``n`` least recently used blocks, unlinked in one pass."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks but only {self.num_free_blocks} are free")
        blocks = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            blocks.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail (for tests and debugging; O(n))."""
        blocks = []
        block = self._head.next_free_block
        while block is not self._tail and block is not None:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    """Owns the blocks, the free queue and the map from block hash to cached blocks.

    With ``reserve_null_block`` block 0 is taken out of circulation as vLLM's "null
    block" (a placeholder for block-table entries that need no memory, such as tokens
    outside a sliding window); it is never allocated, freed or counted as used.
    """

    def __init__(self, num_blocks: int, reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + int(reserve_null_block):
            raise ValueError(f"num_blocks must be >= {1 + int(reserve_null_block)}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.ref_cnt = 1  # permanently "used", outside the free queue
            self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        else:
            self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # The same content may be cached in several blocks (see "duplicated blocks" in
        # the prefix-caching design): block tables are append-only, so a request that
        # computed a block another request also computed keeps its own copy.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block is not None)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks owned by requests (free cached blocks count as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        """A block of group ``group_id`` that holds the content hashed ``block_hash``, or None."""
        blocks = self.cached_block_hash_to_block.get(hash_key(block_hash, group_id) if group_id else block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the LRU end, evicting their cached content."""
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on cache-hit blocks, pulling free ones off the queue
        (the null block, a placeholder of sliding-window hits, is left alone)."""
        null = self.null_block
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks nobody owns go to the queue tail in
        the given order (the first of them is evicted first). The null block is skipped."""
        null = self.null_block
        for block in ordered_blocks:
            if block is null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int, group_id: int = 0
    ) -> None:
        """Register ``blocks[start:end]``, now full, under ``block_hashes[start:end]`` (in
        group ``group_id``); null-block placeholders are skipped."""
        null = self.null_block
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None or block is null:
                # A prefix-cache hit (already cached under this very hash), or no block.
                continue
            block_hash = hash_key(block_hashes[i], group_id) if group_id else block_hashes[i]
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a block's content (it was cached for tokens that were never computed)."""
        if block.block_hash is not None:
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        blocks = self.cached_block_hash_to_block[block_hash]
        del blocks[block.block_id]
        if not blocks:
            del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            logger.warning(
                "Prefix cache not reset: %d blocks are still in use",
                self.num_usable_blocks - self.free_block_queue.num_free_blocks,
            )
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
