"""Slot mapping: where each scheduled token's K/V goes in the paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence


def compute_slot_mapping(block_ids: Sequence[int], start_pos: int, num_tokens: int, block_size: int) -> list[int]:
    """Physical slots of positions ``start_pos .. start_pos + num_tokens - 1`` of a request.

    Position ``p`` lives in the request's block ``p // block_size`` at offset
    ``p % block_size``, so its slot is ``block_ids[p // block_size] * block_size +
    p % block_size``. Example (block size 4): blocks ``[3, 4]``, positions 0..6 ->
    ``[12, 13, 14, 15, 16, 17, 18]``.
    """
    if start_pos < 0 or num_tokens < 0:
        raise ValueError(f"start_pos ({start_pos}) and num_tokens ({num_tokens}) must be >= 0")
    end = start_pos + num_tokens
    if end > len(block_ids) * block_size:
        raise ValueError(
            f"positions up to {end - 1} need {-(-end // block_size)} blocks of size {block_size}, "
            f"but the block table has {len(block_ids)}"
        )
    return [block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start_pos, end)]
