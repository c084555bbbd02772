"""The per-layer attention implementation of FLASH_ATTN: write K/V, then one flash-attn call.

Calls, those of the released flash-attn 2 API whose paged-KV paths README.md's
measurement checked, plus ``softmax_scale``:

- mixed / prefill steps: ``flash_attn_varlen_func(q[rows], k_cache, v_cache, cu_seqlens_q,
  cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=..., causal=True,
  block_table=...)`` with ``k_cache``/``v_cache`` = ``kv_cache[0]``/``kv_cache[1]``
  (``[num_blocks, block_size, num_kv_heads, head_size]``). flash-attn aligns the causal
  mask bottom-right, so query ``j`` of a request with ``q`` new tokens and ``s`` keys sees
  keys ``<= s - q + j``: kvloom's contract, with the new tokens already in the cache.
- pure decode steps (kernel ``"kvcache"``): ``flash_attn_with_kvcache(q[B, 1, H, D],
  k_cache, v_cache, cache_seqlens=seq_lens, block_table=..., softmax_scale=...,
  causal=True)``; the step's keys/values were written by ``write_kv_default_layout`` first, so no
  ``k``/``v`` are passed.

Both take the layer's sliding window as ``window_size=(W - 1, 0)`` (a query sees itself and
the ``W - 1`` keys before it, as HF's windows) and its logit soft cap as ``softcap``. With a
window the kernels start each query block at the tile holding its window's first key, so
the blocks the hybrid KV cache freed (wholly before the window) are never read.

Both return a new tensor, which is copied into ``output`` (the public API of the released
library takes no output buffer).
"""

from __future__ import annotations

import torch  # noqa: F401  (flash_attn_2_cuda needs torch's libraries loaded first)

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError as exc:  # flash_attn's __init__ hides a missing CUDA extension
    raise ImportError(
        "FLASH_ATTN needs flash-attn 2 with its CUDA extension (pip install flash-attn); "
        f"importing flash_attn_varlen_func / flash_attn_with_kvcache failed: {exc}"
    ) from exc

from kvloom.interfaces import AttentionImpl, write_kv_default_layout
from kvloom_backend_flash_attn.builder import FlashAttentionMetadata


class FlashAttentionImpl(AttentionImpl[FlashAttentionMetadata]):
    """Writes the step's K/V into the paged cache, then runs one flash-attn kernel.

    ``forward`` neither synchronises with the device nor computes host numbers: everything
    batch-dependent comes from the builder, so it is safe inside a captured CUDA graph.
    """

    impl_supports_sliding_window = True
    impl_supports_logits_soft_cap = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md = attn_metadata
        window = (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)
        softcap = self.logits_soft_cap or 0.0
        write_kv_default_layout(kv_cache, key, value, md.slot_mapping)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        rows = md.num_query_rows
        if md.decode_with_kvcache:
            out = flash_attn_with_kvcache(
                query[:rows].unsqueeze(1),
                key_cache,
                value_cache,
                cache_seqlens=md.seq_lens,
                block_table=md.block_table,
                softmax_scale=self.scale,
                causal=True,
                window_size=window,
                softcap=softcap,
            )
            output[:rows].copy_(out.reshape(rows, self.num_heads, self.head_size))
        else:
            out = flash_attn_varlen_func(
                query[:rows],
                key_cache,
                value_cache,
                md.query_start_loc,
                md.cu_seqlens_k,
                md.max_query_len,
                md.max_seq_len,
                softmax_scale=self.scale,
                causal=md.causal,
                window_size=window,
                softcap=softcap,
                block_table=md.block_table,
            )
            output[:rows].copy_(out)
        return output
