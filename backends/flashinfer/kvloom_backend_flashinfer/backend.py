"""Support declarations and KV-cache layout of the FLASHINFER backend.

This module must stay importable without ``flashinfer`` installed: selection and
``kvloom backends`` read the declarations below, and ``required_modules`` turns a missing
library into the reason "flashinfer is not installed (pip install flashinfer-python)".
The builder and impl (which use the library) are imported only when asked for.

KV-cache layout: one tensor per layer shaped ``(num_blocks, 2, block_size, num_kv_heads,
head_size)``, which is FlashInfer's single-tensor "NHD" paged layout (``cache[:, 0]`` keys,
``cache[:, 1]`` values). HND (heads before tokens) is only required by FlashInfer's
TRT-LLM kernels on Blackwell, which this backend does not use.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvloom.interfaces import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    BlockSizeSpec,
    DeviceCapability,
)

KVLOOM_PLUGIN_API = "1.0"

#: FlashInfer's kernels need bfloat16 tensor-core support (Ampere and newer) for bf16.


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` and
    ``BatchDecodeWithPagedKVCacheWrapper`` (plan in the metadata builder, run in forward)."""

    NAME: ClassVar[str] = "FLASHINFER"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_block_sizes: ClassVar[tuple[BlockSizeSpec, ...]] = (16, 32, 64)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = (64, 128, 256)
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    min_compute_capability: ClassVar[DeviceCapability | None] = DeviceCapability(7, 5)
    max_compute_capability: ClassVar[DeviceCapability | None] = DeviceCapability(12, 1)
    supported_attn_types: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    required_modules: ClassVar[dict[str, str]] = {"flashinfer": "flashinfer-python"}
    # plan(window_left=, logits_soft_cap=); attention sinks (gpt-oss) are not in its FA2 kernels.
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        from kvloom_backend_flashinfer.impl import FlashInferImpl

        return FlashInferImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        from kvloom_backend_flashinfer.builder import FlashInferMetadataBuilder

        return FlashInferMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (num_blocks, 2, block_size, heads, dim): the K/V axis is the second one.
        return kv_cache[:, 0], kv_cache[:, 1]
