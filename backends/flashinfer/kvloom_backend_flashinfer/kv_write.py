"""Writing keys and values into FlashInfer's single-tensor NHD cache through the slot
mapping (graph-safe; see kvloom.attention.kv_write)."""

from __future__ import annotations

import torch

from kvloom.interfaces import copy_rows_skipping_invalid


def write_kv_nhd_paired(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[n, kv_heads, dim]`` into a cache shaped
    ``(num_blocks, 2, block_size, kv_heads, dim)`` (FlashInfer's single-tensor NHD layout).

    Seen as rows of ``[kv_heads, dim]``, block ``b``'s keys are rows
    ``2*b*block_size + offset`` and its values the next ``block_size`` rows.
    """
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (allocated with get_kv_cache_shape)")
    n = slot_mapping.shape[0]
    block_size = kv_cache.shape[2]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    key_rows = (slots // block_size) * (2 * block_size) + slots % block_size
    rows = torch.cat([key_rows, key_rows + block_size])
    src = torch.cat([key[:n], value[:n]])
    flat = kv_cache.view(-1, kv_cache.shape[3], kv_cache.shape[4])
    copy_rows_skipping_invalid(flat, rows, src, torch.cat([valid, valid]))
