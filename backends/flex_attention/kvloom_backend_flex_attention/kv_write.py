"""Writing a step's keys and values into the paged cache through the slot mapping.

Slot ``s`` is position ``s % block_size`` of block ``s // block_size``; slot ``-1`` means
"do not write" (padding). The write does not drop the ``-1`` entries by boolean indexing,
which would need the number of valid entries on the host (a device synchronisation per
layer). Instead every ``-1`` entry is redirected to repeat the write of the
first valid entry: duplicate indices in ``index_copy_`` are only nondeterministic when
they carry different values, and these carry identical ones. When no entry is valid they
all rewrite row 0 with its own current content.
"""

from __future__ import annotations

import torch


def copy_rows_skipping_invalid(
    dest: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, valid: torch.Tensor
) -> None:
    """``dest[rows[i]] = src[i]`` for every ``i`` with ``valid[i]``; other rows untouched.

    ``dest`` is ``[R, ...]``, ``rows`` int64 ``[n]``, ``src`` ``[n, ...]``, ``valid`` bool ``[n]``.
    Entries of ``rows`` where ``valid`` is False may hold anything (they are replaced).
    """
    n = rows.shape[0]
    if n == 0:
        return
    any_valid = valid.any()
    first = valid.to(torch.int32).argmax()  # first valid entry (0 if none)
    anchor_row = torch.where(any_valid, rows[first], torch.zeros_like(rows[first]))
    anchor_src = torch.where(any_valid, src[first], dest[0])
    safe_rows = torch.where(valid, rows, anchor_row)
    expand = (n,) + (1,) * (src.dim() - 1)
    safe_src = torch.where(valid.view(expand), src, anchor_src.unsqueeze(0))
    dest.index_copy_(0, safe_rows, safe_src.to(dest.dtype))


def write_kv_split(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[n, kv_heads, dim]`` into a cache shaped
    ``(2, num_blocks, block_size, kv_heads, dim)``: as rows of ``[kv_heads, dim]``, slot
    ``s`` holds its key in row ``s`` and its value in row ``num_blocks * block_size + s``.
    """
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (allocated with get_kv_cache_shape)")
    n = slot_mapping.shape[0]
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    rows = torch.cat([slots, slots + num_slots])
    src = torch.cat([key[:n], value[:n]])
    flat = kv_cache.view(-1, kv_cache.shape[3], kv_cache.shape[4])
    copy_rows_skipping_invalid(flat, rows, src, torch.cat([valid, valid]))
