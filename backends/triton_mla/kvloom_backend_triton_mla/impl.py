"""The per-layer MLA kernels of TRITON_MLA (the contract's ``MLAAttentionImpl``).

``forward_decode`` and ``forward_prefill`` only launch kernels with what the builder
planned: no host syncs, nothing that varies between CUDA-graph replays. The cache write is
the contract's torch default (graph-safe ``index_copy_``), which serves this layout.
"""

from __future__ import annotations

import torch

from kvloom.interfaces import MLAAttentionImpl
from kvloom_backend_triton_mla import ops
from kvloom_backend_triton_mla.builder import TritonMLADecodeMetadata, TritonMLAPrefillMetadata


class TritonMLAImpl(MLAAttentionImpl):

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: TritonMLADecodeMetadata, out: torch.Tensor
    ) -> torch.Tensor:
        md = attn_metadata
        if not isinstance(md, TritonMLADecodeMetadata):
            raise TypeError(f"TRITON_MLA forward_decode got {type(md).__name__}, not decode metadata")
        L = self.kv_lora_rank
        b = md.num_reqs
        ops.mla_decode(q[:b, :, :L], q[:b, :, L:], kv_cache, md.block_table, md.seq_lens, out[:b], self.scale,
                       md.num_kv_splits, md.config, md.partial_out, md.partial_lse)
        return out

    def forward_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: TritonMLAPrefillMetadata,
        out: torch.Tensor,
    ) -> torch.Tensor:
        md = attn_metadata
        if not isinstance(md, TritonMLAPrefillMetadata):
            raise TypeError(f"TRITON_MLA forward_prefill got {type(md).__name__}, not prefill metadata")
        ops.varlen_causal_attention(q, k, v, out, md.cu_seqlens_q, md.cu_seqlens_k, md.max_query_len, self.scale,
                                    md.config)
        return out
