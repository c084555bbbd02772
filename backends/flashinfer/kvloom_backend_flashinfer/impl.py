"""The FLASHINFER attention impl: write K/V into the paged cache, run the planned wrapper.

Everything batch-dependent was planned by the builder; ``forward`` only writes the new
keys and values through the slot mapping (one Triton kernel on CUDA) and calls
``wrapper.run``, so it is safe to capture in a CUDA graph for decode steps.
"""

from __future__ import annotations

import torch

from kvloom.interfaces import AttentionImpl
from kvloom_backend_flashinfer.kv_write import write_kv_nhd_paired, write_kv_triton
from kvloom_backend_flashinfer.metadata import FlashInferMetadata


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if attn_metadata.sm_scale != self.scale:
            raise ValueError(
                f"layer scale {self.scale} differs from the scale the step was planned with "
                f"({attn_metadata.sm_scale}); FLASHINFER plans one scale for all layers"
            )
        slot_mapping = attn_metadata.slot_mapping
        (write_kv_triton if kv_cache.is_cuda else write_kv_nhd_paired)(kv_cache, key, value, slot_mapping)

        rows = attn_metadata.num_query_rows
        q = query[:rows]
        out = output[:rows]
        if out.is_contiguous():
            attn_metadata.wrapper.run(q, kv_cache, out=out)
        else:
            out.copy_(attn_metadata.wrapper.run(q, kv_cache))
        return output
