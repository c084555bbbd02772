"""Writing keys and values into FlashInfer's single-tensor NHD cache through the slot
mapping.

The write runs once per layer of every step, and under piecewise CUDA graphs it runs
eagerly between two pieces, so its host cost is paid on every layer. On CUDA it is one
Triton kernel launch (``write_kv_triton``: TRITON_ATTN's cache-write kernel, which takes
any block and slot strides, on the K and V halves of this layout). The torch version
(``write_kv_nhd_paired``, graph-safe, see kvloom.attention.kv_write) takes about 20 small
kernels and as many dispatches per layer; it remains for tensors off CUDA (the CPU tests).
"""

from __future__ import annotations

import torch
from kvloom_backend_triton.ops import write_kv_cache

from kvloom.interfaces import copy_rows_skipping_invalid


def write_kv_triton(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As ``write_kv_nhd_paired``, in one Triton kernel: slot ``-1`` writes nothing."""
    n = slot_mapping.shape[0]
    write_kv_cache(key[:n], value[:n], kv_cache[:, 0], kv_cache[:, 1], slot_mapping)


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
