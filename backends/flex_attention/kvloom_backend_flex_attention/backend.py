"""Support declarations and KV-cache layout of the FLEX_ATTENTION backend.

Paged attention through ``torch.nn.attention.flex_attention`` (no library beyond torch):
the cache of a layer is one KV sequence of ``num_blocks * block_size`` slots, the step's
queries are packed per request, and a block mask built from the block table lists each
query block's pages (see ``planning.py`` and ``block_mask.py``).

Declared support and why:

- dtypes float16, bfloat16, float32; KV cache "auto" (same dtype as the model).
- Block sizes: multiples of 16. The mask's KV blocks are the cache's pages, flex needs
  its Triton KV tile (``BLOCK_N``) to divide them, and Triton's matmuls need tiles of at
  least 16.
- Head sizes up to 256.
- Devices: CUDA only. On the CPU, flex_attention must also run compiled (uncompiled it
  materialises a ``[rows, num_blocks * block_size]`` score matrix per call), and
  inductor's C++ flex template was measured unfit for serving on the 2-core CPU machine
  (torch 2.13, gcc 12): correct where it compiled (relative error ~1e-7 against float64),
  but 12-55 s of compilation per kernel variant and shape regime on first use, and with
  ``dynamic=True`` the generated C++ for the decode-group kernel failed to compile
  (``CppCompileError``: undeclared ``cur_kvSplitSize0``) - a crash waiting for an unseen
  shape. The impl itself is device-agnostic; the CPU tests run it with flex's uncompiled
  reference on small caches.
- CUDA graphs: NEVER. The padded query length and the block-mask shapes change every step.

Requirement on the cache: slots not yet written must hold finite values (allocate the cache
with zeros, as vLLM does). Flex loads whole pages and multiplies masked
probabilities (exact zeros) with the values, so a NaN bit pattern left in the unfilled tail
of a request's last page would turn its outputs into NaN (checked on the CPU reference path).
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
    MultipleOf,
)

KVLOOM_PLUGIN_API = "1.0"



class FlexAttentionBackend(AttentionBackend):
    NAME: ClassVar[str] = "FLEX_ATTENTION"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_block_sizes: ClassVar[tuple[BlockSizeSpec, ...]] = (MultipleOf(16),)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    max_head_size: ClassVar[int] = 256
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    #: Triton's minimum.
    min_compute_capability: ClassVar[DeviceCapability | None] = DeviceCapability(7, 0)
    supported_attn_types: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # The window in the block mask, the soft cap a score_mod, sinks a rescaling by the log-sum-exp.
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        from kvloom_backend_flex_attention.impl import FlexAttentionImpl

        return FlexAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        from kvloom_backend_flex_attention.builder import FlexAttentionMetadataBuilder

        return FlexAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # The default split_kv_cache layout: flex reads cache[0]/cache[1] as one sequence.
        return (2, num_blocks, block_size, num_kv_heads, head_size)
