"""The ``gguf`` method: GGUF files' quantized tensors run as stored, on the CPU.

It claims the ``"gguf"`` checkpoint format, so a ``.gguf`` model runs with it by default
when it is installed (``--quantization none`` keeps the dequantized float path): linear
layers, the token embedding and the LM head (tied or not) keep the file's block types,
repacked once (``layers``) for the int8-activation kernels (``kernels``). The GGUF
loader hands it each tensor as stored (``GGUFTensor``); norms stay float.

A GGUF file carries no ``quantization_config``: ``__init__`` gets ``{"quant_method":
"gguf"}``. Tests pass ``{"quant_method": "gguf", "ggml_type": "Q4_K"}`` to choose the type the format writer
(``checkpoint_tensors``) writes, and may pass ``"activation_bits"`` (8 or 16; the default
is ``$KVLOOM_GGUF_ACTIVATION_BITS``, else 16).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from gguf import GGMLQuantizationType

from kvloom.interfaces import (
    LayerInfo,
    LayerKind,
    LayerQuantMethod,
    QuantizationMethod,
    QuantizationSelectorConfig,
    cpu_simd,
)
from kvloom_quant_gguf import kernels
from kvloom_quant_gguf.layers import GgufEmbeddingMethod, GgufLinearMethod
from kvloom_quant_gguf.writer import WRITABLE

#: The type the format writer writes when the config names none.
DEFAULT_WRITER_TYPE = GGMLQuantizationType.Q4_1
#: Activation precision of the kernels: int16 keeps the fp32 model's greedy choices (its
#: error is ~1e-5 of each 32-feature block's largest value); int8 (llama.cpp's Q8
#: activations) is about twice as fast on large batches and errs ~4e-3.
ACTIVATION_BITS = (8, 16)
DEFAULT_ACTIVATION_BITS = 16
ACTIVATION_BITS_ENV = "KVLOOM_GGUF_ACTIVATION_BITS"


class GgufMethod(QuantizationMethod):
    """GGUF block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K) with int16 (or int8) activations."""

    NAME = "gguf"
    checkpoint_formats = {"gguf": ()}
    layer_kinds = (LayerKind.LINEAR, LayerKind.EMBEDDING, LayerKind.LM_HEAD)
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    weight_dtype = "GGUF block types as stored (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K; float types as float32)"
    activation_dtype = "int16 (or int8), dynamic per token and 32 features"
    supported_device_types = ("cpu",)
    supports_tensor_parallel = False
    required_modules = {"gguf": "gguf"}

    def __init__(self, quantization_config: dict[str, Any] | None) -> None:
        super().__init__(quantization_config)
        name = self.quantization_config.get("ggml_type", DEFAULT_WRITER_TYPE.name)
        allowed = ", ".join(t.name for t in WRITABLE)
        if not isinstance(name, str) or name not in GGMLQuantizationType.__members__:
            raise ValueError(f"ggml_type: {name!r} (allowed: {allowed})")
        self.writer_type = GGMLQuantizationType[name]
        if self.writer_type not in WRITABLE:
            raise ValueError(f"ggml_type: {name!r} has no format writer (allowed: {allowed})")
        bits = self.quantization_config.get("activation_bits", os.environ.get(ACTIVATION_BITS_ENV))
        bits = DEFAULT_ACTIVATION_BITS if bits in (None, "") else bits
        if str(bits) not in ("8", "16"):
            raise ValueError(f"activation_bits ({ACTIVATION_BITS_ENV}): {bits!r} (allowed: 8, 16)")
        self.activation_bits = int(bits)

    def extra_validation(self, config: QuantizationSelectorConfig) -> list[str]:
        reason = kernels.problem()
        return [reason] if reason else []

    def layer_method(self, layer: LayerInfo) -> LayerQuantMethod | None:
        if layer.kind is LayerKind.LINEAR:
            return GgufLinearMethod(self.writer_type, self.activation_bits)
        if layer.kind in (LayerKind.EMBEDDING, LayerKind.LM_HEAD):
            return GgufEmbeddingMethod(self.writer_type, self.activation_bits)
        return None

    def describe(self) -> str:
        return (f"gguf: the file's block types as stored, int{self.activation_bits} activations per 32 features, "
                f"{cpu_simd()} CPU "
                "kernels (the default for GGUF files; --quantization none runs them dequantized to float)")  # fmt: skip
