"""TRITON_MLA: multi-head latent attention written in Triton, both phases.

This module is what the ``kvloom.attention_backends`` entry point names. It imports no
Triton, so a machine without Triton still gets the declarations and a "triton is not
installed" reason instead of an import error.
"""

from __future__ import annotations

import torch

from kvloom.interfaces import (
    MLA_DECODE,
    MLA_PREFILL,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    DeviceCapability,
    MLAAttentionBackend,
    MLAAttentionImpl,
    MultipleOf,
)

KVLOOM_PLUGIN_API = "1.1"


class TritonMLABackend(MLAAttentionBackend):
    """Decode: split-KV flash-decoding over the paged latent cache (``decode_kernels``).
    Prefill: causal varlen attention over the decompressed K/V (``prefill_kernels``).
    Cache write: the contract's graph-safe torch write (``MLAAttentionImpl.write_latent``).

    CUDA graphs: ``UNIFORM_SINGLE_TOKEN_DECODE`` (pure decode steps; the split count is
    planned from the padded batch size and ``max_model_len`` and the kernel cuts each
    request's own length, so a replay with new lengths stays valid).
    """

    NAME = "TRITON_MLA"
    mla_phases = (MLA_DECODE, MLA_PREFILL)
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes = ("auto",)
    # The kernels address the cache per position through the block table: any page size.
    supported_block_sizes = (MultipleOf(1),)
    supported_device_types = ("cuda",)
    # bf16 tensor-core dots need Ampere.
    min_compute_capability = DeviceCapability(8, 0)
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    required_modules = {"triton": "triton"}

    @staticmethod
    def get_impl_cls() -> type[MLAAttentionImpl]:  # type: ignore[override]
        from kvloom_backend_triton_mla.impl import TritonMLAImpl

        return TritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        from kvloom_backend_triton_mla.builder import TritonMLAMetadataBuilder

        return TritonMLAMetadataBuilder
