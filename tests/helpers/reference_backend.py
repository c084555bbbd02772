"""An obviously-correct paged attention backend for tests (not a plugin).

Plain torch: write K/V through the slot mapping, then compute attention with the float64
reference of ``kvloom.testing.reference`` (each request's whole sequence gathered from the
block table, causal softmax; sliding windows, sinks and soft caps as the contract defines
them) and round it to the model dtype. Slow and simple on purpose:
model tests use it as the attention reference while the real backends are tested against
the conformance suite.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from kvloom.testing.reference import AttentionFeatures, reference_attention


class ReferenceMetadataBuilder(AttentionMetadataBuilder[CommonAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common


class ReferenceAttentionImpl(AttentionImpl[CommonAttentionMetadata]):
    impl_supports_sliding_window = True
    impl_supports_logits_soft_cap = True
    impl_supports_sinks = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CommonAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md = attn_metadata
        key_cache, value_cache = ReferenceBackend.split_kv_cache(kv_cache)
        block_size = key_cache.shape[1]
        n = md.num_actual_tokens
        slots = md.slot_mapping[:n]
        write = slots >= 0
        blocks, offsets = slots[write] // block_size, slots[write] % block_size
        key_cache[blocks, offsets] = key[:n][write].to(key_cache.dtype)
        value_cache[blocks, offsets] = value[:n][write].to(value_cache.dtype)

        features = AttentionFeatures(self.sliding_window, self.logits_soft_cap, self.sinks)
        output[:n] = reference_attention(query, key_cache, value_cache, md, self.scale, features).to(output)
        return output


class ReferenceBackend(AttentionBackend):
    NAME: ClassVar[str] = "TEST_REFERENCE"
    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_block_sizes = (MultipleOf(1),)
    supported_device_types = ("cpu", "cuda")
    supports_sliding_window = True
    supports_sinks = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return ReferenceAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return ReferenceMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
