"""Writing a step's keys and values into a paged cache through the slot mapping, in torch.

For backends without a cache-write kernel of their own. The write must be safe to capture
in a CUDA graph: it can neither drop the ``-1`` slots (padding) by boolean indexing, which
needs the number of valid entries on the host, nor index with 0-dim tensors, which become
host integers. Instead every ``-1`` entry is redirected to repeat the write of the first
valid entry: ``index_copy_`` with duplicate indices is only ambiguous when the duplicates
carry different values, and these carry identical ones. When no entry is valid, they all
rewrite row 0 with its own content.
"""

from __future__ import annotations

import torch


def copy_rows_skipping_invalid(
    dest: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, valid: torch.Tensor
) -> None:
    """``dest[rows[i]] = src[i]`` for every ``i`` with ``valid[i]``; other rows untouched.

    ``dest`` is ``[R, ...]``, ``rows`` int64 ``[n]``, ``src`` ``[n, ...]``, ``valid`` bool
    ``[n]``. Entries of ``rows`` where ``valid`` is False may hold anything. No host sync.
    """
    n = rows.shape[0]
    if n == 0:
        return
    any_valid = valid.any()
    first = valid.to(torch.int32).argmax().view(1)  # a 1-element index: a device gather
    first_row = rows.index_select(0, first)
    anchor_row = torch.where(any_valid, first_row, torch.zeros_like(first_row))
    anchor_src = torch.where(any_valid, src.index_select(0, first), dest[:1])
    safe_rows = torch.where(valid, rows, anchor_row)
    expand = (n,) + (1,) * (src.dim() - 1)
    safe_src = torch.where(valid.view(expand), src, anchor_src)
    dest.index_copy_(0, safe_rows, safe_src.to(dest.dtype))


def write_kv_default_layout(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` (``[>= n, num_kv_heads, head_size]``, views are fine) into a
    cache shaped ``(2, num_blocks, block_size, num_kv_heads, head_size)`` (the contract's
    default layout): seen as rows of ``[num_kv_heads, head_size]``, slot ``s`` holds its key
    in row ``s`` and its value in row ``num_blocks * block_size + s``."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be shaped (2, num_blocks, block_size, num_kv_heads, head_size), "
            f"got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (allocated with get_kv_cache_shape)")
    n = slot_mapping.shape[0]
    if key.shape[0] < n or value.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} entries but key/value have {key.shape[0]}/{value.shape[0]} rows")
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    rows = torch.cat([slots, slots + num_slots])
    src = torch.cat([key[:n], value[:n]])
    flat = kv_cache.view(-1, kv_cache.shape[3], kv_cache.shape[4])
    copy_rows_skipping_invalid(flat, rows, src, torch.cat([valid, valid]))
