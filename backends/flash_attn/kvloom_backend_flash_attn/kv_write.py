"""Writing a step's keys and values into the paged cache through the slot mapping.

The cache is ``(2, num_blocks, block_size, num_kv_heads, head_size)``: seen as
``(2, num_blocks * block_size, num_kv_heads, head_size)``, slot ``s`` is row ``s`` of both
halves. Slot ``-1`` means "do not write" (CUDA-graph padding, warm-up steps).

The write must be safe to capture in a CUDA graph, so it can neither drop the ``-1``
entries by boolean indexing (the number of kept entries would have to reach the host) nor
branch on the data. Instead every ``-1`` entry is pointed at the first valid entry's slot
*with that entry's values*: ``index_copy_`` with duplicate indices is only ambiguous when
the duplicates carry different values. When no entry is valid they all rewrite slot 0
with its own current content. One ``index_copy_`` writes keys and values together.
"""

from __future__ import annotations

import torch


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``kv_cache[:, s // block_size, s % block_size] = (key[t], value[t])`` for every token
    ``t`` whose slot ``s = slot_mapping[t]`` is not ``-1``; nothing else changes.

    ``key``/``value`` ``[>= n, num_kv_heads, head_size]`` (views are fine; rows past ``n =
    len(slot_mapping)`` are ignored), ``slot_mapping`` int ``[n]`` on the cache's device.
    No host synchronisation.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be shaped (2, num_blocks, block_size, num_kv_heads, head_size), got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (allocated with get_kv_cache_shape)")
    n = slot_mapping.shape[0]
    if n == 0:
        return
    if key.shape[0] < n or value.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} entries but key/value have {key.shape[0]}/{value.shape[0]} rows")
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)  # [2, slots, Hkv, D]

    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    any_valid = valid.any()
    # The first valid entry (0 if none), as a 1-element index tensor: indexing with it is
    # a device gather (a 0-dim tensor index could be turned into a host integer).
    first = valid.to(torch.int32).argmax().view(1)
    src = torch.stack([key[:n], value[:n]]).to(kv_cache.dtype)  # [2, n, Hkv, D]

    first_slot = slots.index_select(0, first)  # [1]
    anchor_slot = torch.where(any_valid, first_slot, torch.zeros_like(first_slot))
    anchor_src = torch.where(any_valid, src.index_select(1, first), flat[:, :1])  # [2, 1, Hkv, D]
    safe_slots = torch.where(valid, slots, anchor_slot)
    safe_src = torch.where(valid.view(1, n, 1, 1), src, anchor_src)
    flat.index_copy_(1, safe_slots, safe_src)
