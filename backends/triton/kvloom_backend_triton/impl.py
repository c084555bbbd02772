"""The per-layer attention implementation of TRITON_ATTN."""

from __future__ import annotations

import torch

from kvloom.interfaces import AttentionImpl
from kvloom_backend_triton import ops
from kvloom_backend_triton.builder import TritonAttentionMetadata


class TritonAttentionImpl(AttentionImpl[TritonAttentionMetadata]):
    """Writes the step's K/V into the paged cache, then runs one attention kernel.

    ``forward`` only launches kernels: every host number it uses was computed by the
    builder, so it neither synchronises nor varies between CUDA-graph replays. Sliding
    windows, logit soft-capping and attention sinks run in the kernels themselves.
    """

    impl_supports_sliding_window = True
    impl_supports_logits_soft_cap = True
    impl_supports_sinks = True

    def _features(self) -> ops.LayerFeatures:
        # The sinks are the layer's parameter, filled when the weights load: read at each call.
        return ops.LayerFeatures(self.sliding_window, self.logits_soft_cap, self.sinks)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md = attn_metadata
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        features = self._features()
        ops.write_kv_cache(key, value, key_cache, value_cache, md.slot_mapping)
        if md.decode_only or md.split_single:
            ops.decode_attention(
                query, key_cache, value_cache, output,
                md.query_start_loc, md.seq_lens, md.block_table, md.num_reqs, self.scale,
                md.num_splits, md.partial_out, md.partial_lse, md.config, features,
            )
        if not md.decode_only:
            ops.mixed_batch_attention(
                query, key_cache, value_cache, output,
                md.query_start_loc, md.seq_lens, md.block_table, md.num_reqs, md.max_query_len,
                self.scale, md.config, skip_single=md.split_single, features=features,
            )
        return output
