"""TRITON_ATTN: paged attention written in Triton, for any recent NVIDIA GPU.

This module is what the ``kvloom.attention_backends`` entry point names. It imports no
Triton itself, so a machine without Triton still gets the backend's declarations and a
"triton is not installed" reason instead of an import error.
"""

from __future__ import annotations

import torch

from kvloom.interfaces import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    DeviceCapability,
    MultipleOf,
)

KVLOOM_PLUGIN_API = "1.1"


class TritonAttentionBackend(AttentionBackend):
    """Mixed-batch paged attention plus a split-KV decode kernel, in Triton.

    CUDA graphs: ``UNIFORM_BATCH`` (batches whose requests share one query length, padded
    to a capture size); see ``builder.py`` for why replays stay valid.
    """

    NAME = "TRITON_ATTN"
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes = ("auto",)
    supported_block_sizes = (MultipleOf(16),)
    supported_head_sizes = None
    max_head_size = 256
    supported_device_types = ("cuda",)
    # Triton's tensor-core dots start at Volta; bf16 needs Ampere (extra_validation).
    min_compute_capability = DeviceCapability(7, 0)
    cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    required_modules = {"triton": "triton"}

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        from kvloom_backend_triton.impl import TritonAttentionImpl

        return TritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        from kvloom_backend_triton.builder import TritonAttentionMetadataBuilder

        return TritonAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # [K|V, block, offset in block, kv head, dim]: a cached token's head is one
        # contiguous run of head_size elements (16-byte loads); split_kv_cache's default
        # (kv_cache[0], kv_cache[1]) matches.
        return (2, num_blocks, block_size, num_kv_heads, head_size)
