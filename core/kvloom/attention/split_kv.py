"""The split floor of split-KV (flash-decoding) decode kernels.

A decode kernel that cuts each request's positions into ``num_splits`` runs sized from the
request's own length (so a CUDA graph planned for ``max_model_len`` stays valid for any
length) must not cut a short request finer than the backend's ``min_split_tokens``: the
host plans of an eager step (for its longest sequence) and of a CUDA graph (for
``max_model_len``) differ in split count, and a request that fits in one run of either
plan then has one partial, which merges with weight 1 -- the same bits as an unsplit
launch. Without the floor, CUDA graphs changed bf16 greedy tokens of short requests.
"""

from __future__ import annotations

from kvloom.utils import cdiv


def min_split_tiles(min_split_tokens: int, block_n: int, force_num_splits: int | None) -> int:
    """The shortest run, in ``block_n``-key tiles, a decode kernel gives a split:
    ``min_split_tokens`` worth, or one tile when ``force_num_splits`` pins the partition
    (tests and benchmarks force splits of short sequences to exercise the reduction)."""
    if force_num_splits is not None:
        return 1
    return cdiv(min_split_tokens, block_n)
