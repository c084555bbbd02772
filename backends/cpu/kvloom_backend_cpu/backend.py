"""CPU_ATTN: paged attention on the CPU, in torch and (float32 layers) C kernels.

KV-cache layout ``(2, num_blocks, block_size, num_kv_heads, head_size)``: K and V of one
token at one head are ``head_size`` contiguous elements, and one block of one cache is one
contiguous chunk, so gathering a request's context is a block-granular ``index_select``.

The builder (``builder.py``) plans each step once for all layers; the impl (``impl.py``)
writes K/V and runs torch's ``scaled_dot_product_attention`` per decode group and per
prefill request, except that float32 layers without soft cap or sinks write K/V and
attend their decodes through the C kernels of ``kernels.py`` (``attention_kernels.c``,
built once per machine; no compiler: the torch path, logged once). Sliding windows, attention sinks (gpt-oss) and logit soft-capping
(Gemma 2) are supported. An fp8 KV cache (``--kv-cache-dtype fp8``) stores the quantized
keys and values and upcasts them (times the layer's scale) as it reads them.
"""

from __future__ import annotations

import torch

from kvloom.interfaces import AttentionBackend, AttentionCGSupport, AttentionType, MultipleOf
from kvloom_backend_cpu.builder import CPUAttentionMetadataBuilder
from kvloom_backend_cpu.impl import CPUAttentionImpl

KVLOOM_PLUGIN_API = "1.0"


class CPUAttentionBackend(AttentionBackend):
    """Paged attention for the CPU in torch and C (any block size, head sizes 1..256)."""

    NAME = "CPU_ATTN"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_block_sizes = (MultipleOf(1),)
    supported_head_sizes = None
    max_head_size = 256
    supported_device_types = ("cpu",)
    supported_attn_types = (AttentionType.DECODER,)
    cudagraph_support = AttentionCGSupport.NEVER
    supports_sliding_window = True
    supports_sinks = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionImpl]:
        return CPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return CPUAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
