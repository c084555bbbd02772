"""The KV-cache coordinator: one ``SingleTypeKVCacheManager`` per KV-cache group, one
block pool, and the prefix-cache rule across groups (vLLM's KVCacheCoordinator).

Which coordinator a model gets (``get_kv_cache_coordinator``), as in the seeds:

- ``KVCacheCoordinatorNoPrefixCache``: prefix caching off (any groups).
- ``UnitaryKVCacheCoordinator``: one group; its manager's hit is the hit.
- ``HybridKVCacheCoordinator``: full attention plus one other attention type (sliding
  window or chunked local), each in one or more groups. A hit must hold in every group:
  full attention's longest hit is found from the left, then the other type's longest hit
  within that length from the right; the result, no longer than full attention's, is a
  hit of the full-attention groups too (they hold every leading block). Other mixes
  (no full attention, or three types) are refused with prefix caching on.

Blocks of several groups come from one pool: allocating for a request is all or nothing
(``get_num_blocks_to_allocate`` sums the groups before any is served).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvloom.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvloom.kv_cache.hashing import BlockHash
from kvloom.kv_cache.single_type_manager import SingleTypeKVCacheManager, get_manager_for_kv_cache_spec
from kvloom.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from kvloom.request import Request

#: A request's blocks, one list per KV-cache group (vLLM's KVCacheBlocks' ``blocks``).
KVCacheBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    """The groups' managers over one pool; ``find_longest_cache_hit`` is the subclass's."""

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_pool = block_pool
        self.block_size = kv_cache_config.groups[0].kv_cache_spec.block_size
        self.managers: list[SingleTypeKVCacheManager] = [
            get_manager_for_kv_cache_spec(block_pool, group.kv_cache_spec, group_id)
            for group_id, group in enumerate(kv_cache_config.groups)
        ]
        #: Whether some group gives back blocks as requests advance.
        self.skips_blocks = any(m.skips_blocks for m in self.managers)

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def empty_blocks(self) -> KVCacheBlocks:
        return tuple([] for _ in self.managers)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: KVCacheBlocks) -> int:
        """Free-queue blocks that holding ``num_tokens`` slots takes, over every group."""
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, computed)
            for m, computed in zip(self.managers, new_computed_blocks)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: KVCacheBlocks) -> None:
        for manager, computed in zip(self.managers, new_computed_blocks):
            manager.save_new_computed_blocks(request_id, computed)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> KVCacheBlocks:
        """Grow every group's block table to ``num_tokens`` slots (the caller checked that
        the pool has the blocks: ``get_num_blocks_to_allocate``)."""
        new = tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.managers)
        assert all(blocks is not None for blocks in new), "allocate_new_blocks without enough free blocks"
        return new  # type: ignore[return-value]

    def cache_blocks(self, request: Request, block_hashes: list[BlockHash], num_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, block_hashes, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.managers)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> tuple[KVCacheBlocks, int]:
        """The per-group blocks of the longest prefix cached for every group (at most
        ``max_num_blocks`` blocks), and its length in tokens."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: never a hit."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> tuple[KVCacheBlocks, int]:
        return self.empty_blocks(), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV-cache group: its manager's search is the hit."""

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        super().__init__(kv_cache_config, block_pool)
        self.manager = self.managers[0]
        self.spec = kv_cache_config.groups[0].kv_cache_spec

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> tuple[KVCacheBlocks, int]:
        hits = self.manager.find_longest_cache_hit(block_hashes, max_num_blocks, (0,), self.block_pool, self.spec)
        return hits, len(hits[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Full attention plus one other attention type (see the module docstring)."""

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        super().__init__(kv_cache_config, block_pool)
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for group_id, group in enumerate(kv_cache_config.groups):
            by_spec.setdefault(group.kv_cache_spec, []).append(group_id)
        full = [spec for spec in by_spec if isinstance(spec, FullAttentionSpec)]
        others = [spec for spec in by_spec if not isinstance(spec, FullAttentionSpec)]
        if len(full) != 1 or len(others) != 1:
            kinds = ", ".join(spec.describe() for spec in by_spec)
            raise ValueError(
                f"prefix caching supports full attention plus one other attention type; this model has {kinds}. "
                "Start the engine with enable_prefix_caching=False (--no-enable-prefix-caching)"
            )
        self.full_spec, self.other_spec = full[0], others[0]
        self.full_group_ids, self.other_group_ids = by_spec[self.full_spec], by_spec[self.other_spec]
        self.full_manager_cls = type(self.managers[self.full_group_ids[0]])
        self.other_manager_cls = type(self.managers[self.other_group_ids[0]])

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> tuple[KVCacheBlocks, int]:
        pool = self.block_pool
        full_hits = self.full_manager_cls.find_longest_cache_hit(
            block_hashes, max_num_blocks, self.full_group_ids, pool, self.full_spec
        )
        other_hits = self.other_manager_cls.find_longest_cache_hit(
            block_hashes, len(full_hits[0]), self.other_group_ids, pool, self.other_spec
        )
        num_blocks = len(other_hits[0])
        per_group: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        for group_id, hits in zip(self.full_group_ids, full_hits):
            per_group[group_id] = hits[:num_blocks]
        for group_id, hits in zip(self.other_group_ids, other_hits):
            per_group[group_id] = hits
        return tuple(per_group), num_blocks * self.block_size


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig, block_pool: BlockPool, enable_caching: bool
) -> KVCacheCoordinator:
    """The coordinator for ``kv_cache_config`` (see the module docstring)."""
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_config, block_pool)
    if kv_cache_config.num_groups == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, block_pool)
    return HybridKVCacheCoordinator(kv_cache_config, block_pool)
