"""Support declarations of the FLASHINFER_MLA backend (MLA decode through FlashInfer).

Importable without ``flashinfer``: the builder and impl (``mla.py``) load the library only
when asked for, and ``required_modules`` turns a missing one into a validation reason.

Decode only (``mla_phases = ("decode",)``): FlashInfer's ``BatchMLAPagedAttentionWrapper``
runs the absorbed-query attention over the paged latent cache. The prefill phase of an MLA
model is selected separately (``--mla-prefill-backend``, e.g. TRITON_MLA); vLLM offers
FlashInfer MLA only on Blackwell (TRT-LLM kernels), this one uses FlashInfer's FA2 MLA
kernels, which run on Hopper.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvloom.interfaces import (
    MLA_DECODE,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    BlockSizeSpec,
    DeviceCapability,
    MLAAttentionBackend,
    MLAAttentionImpl,
)
from kvloom_backend_flashinfer.mla_latent import FLASHINFER_MLA_LATENT


class FlashInferMLABackend(MLAAttentionBackend):
    NAME: ClassVar[str] = "FLASHINFER_MLA"
    mla_phases: ClassVar[tuple[str, ...]] = (MLA_DECODE,)
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_block_sizes: ClassVar[tuple[BlockSizeSpec, ...]] = (16, 32, 64)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = (sum(FLASHINFER_MLA_LATENT),)
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    min_compute_capability: ClassVar[DeviceCapability | None] = DeviceCapability(8, 0)
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    required_modules: ClassVar[dict[str, str]] = {"flashinfer": "flashinfer-python"}

    @staticmethod
    def get_impl_cls() -> type[MLAAttentionImpl]:  # type: ignore[override]
        from kvloom_backend_flashinfer.mla import FlashInferMLAImpl

        return FlashInferMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        from kvloom_backend_flashinfer.mla import FlashInferMLAMetadataBuilder

        return FlashInferMLAMetadataBuilder
