"""The FLASHINFER attention impl: write K/V into the paged cache, run the planned wrapper.

Everything batch-dependent was planned by the builder; ``forward`` only writes the new
keys and values through the slot mapping (one Triton kernel on CUDA) and calls
``wrapper.run``, so it is safe to capture in a CUDA graph for decode steps.
"""

from __future__ import annotations

from typing import Any

import torch

from kvloom.interfaces import AttentionImpl
from kvloom_backend_flashinfer.kv_write import write_kv_nhd_paired, write_kv_triton
from kvloom_backend_flashinfer.metadata import FlashInferMetadata


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    # Both are plan() arguments: the builder plans them from its KV-cache group's spec.
    impl_supports_sliding_window = True
    impl_supports_logits_soft_cap = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: What the step's plan must have been made for (checked in every forward).
        self.plan_features = (self.scale, self.sliding_window, self.logits_soft_cap)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if attn_metadata.layer_features != self.plan_features:
            raise ValueError(
                f"layer (scale, sliding_window, logits_soft_cap) {self.plan_features} differs from the step's plan "
                f"{attn_metadata.layer_features}; FLASHINFER plans these once for a KV-cache group's layers"
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
