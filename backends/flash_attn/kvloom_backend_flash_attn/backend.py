"""Support declarations and KV-cache layout of the FLASH_ATTN backend.

This module must stay importable without ``flash_attn``: selection and ``kvloom backends``
read the declarations below, and ``required_modules`` turns a missing library into the
reason "flash_attn is not installed (pip install flash-attn)". The builder is pure torch;
the impl, which calls the kernels, is imported only when asked for.

KV-cache layout (vLLM's for FlashAttention): one tensor per layer shaped ``(2, num_blocks,
block_size, num_kv_heads, head_size)``; ``kv_cache[0]`` are the keys and ``kv_cache[1]``
the values, each exactly the ``(num_blocks, page_block_size, num_kv_heads, head_size)``
paged cache that flash-attn's ``block_table`` argument indexes (the default
``split_kv_cache`` matches).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvloom.interfaces import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    BlockSizeSpec,
    DeviceCapability,
    MultipleOf,
)

KVLOOM_PLUGIN_API = "1.0"

#: flash-attn 2 kernels exist for head sizes up to 256; the paged-KV paths take head
#: sizes that are multiples of 8 only (the library pads other sizes by copying K/V, which
#: it cannot do for a paged cache).
MAX_HEAD_SIZE = 256
HEAD_SIZE_MULTIPLE = 8


class FlashAttentionBackend(AttentionBackend):
    """Paged attention through flash-attn 2 (``flash_attn_varlen_func`` with a block table
    for any batch; ``flash_attn_with_kvcache`` for pure decode steps, switchable).

    Block sizes: ``(MultipleOf(256),)`` and nothing else, the released library's limit:
    its paged-KV calls (``block_table``) take only pages that are a multiple of 256
    tokens (flash-attn's docstring: "page_block_size must be a multiple of 256"; the
    measurement is in README.md). vLLM declares multiples of 16 because it ships its own
    fork of the kernels. With no ``--block-size`` the engine therefore runs this backend
    at 256 (``preferred_block_size``); with ``--block-size 16`` this backend is invalid and
    selection moves on.

    CUDA graphs: ``UNIFORM_BATCH`` as vLLM declares for FA2 (its decode-only
    packed-GQA path differs from the mixed-batch path, so a graph captured for a uniform
    batch must not be replayed for a mixed one). See ``builder.py`` for what keeps a
    replay valid.
    """

    NAME: ClassVar[str] = "FLASH_ATTN"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_block_sizes: ClassVar[tuple[BlockSizeSpec, ...]] = (MultipleOf(256),)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    max_head_size: ClassVar[int] = MAX_HEAD_SIZE
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    min_compute_capability: ClassVar[DeviceCapability | None] = DeviceCapability(8, 0)
    supported_attn_types: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    required_modules: ClassVar[dict[str, str]] = {"flash_attn": "flash-attn"}
    # window_size=(W - 1, 0) and softcap= of both kernels; attention sinks are not in flash-attn 2.
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        from kvloom_backend_flash_attn.impl import FlashAttentionImpl

        return FlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        from kvloom_backend_flash_attn.builder import FlashAttentionMetadataBuilder

        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 0 < head_size <= cls.max_head_size and head_size % HEAD_SIZE_MULTIPLE == 0

    @classmethod
    def describe_head_sizes(cls) -> str:
        return f"multiples of {HEAD_SIZE_MULTIPLE} up to {cls.max_head_size}"

    @classmethod
    def support_summary(cls) -> dict[str, Any]:
        summary = super().support_summary()
        summary["head_sizes"] = cls.describe_head_sizes()
        return summary
