"""kvloom's 4-bit integer weight-only quantization methods: AWQ (``quant_method: awq``)
and GPTQ (``quant_method: gptq``, act-order included), W4A16.

* ``packing``: 4-bit values in words and bytes, ``Unpacked`` (the one form every
  4-bit format is read into) and its dequantization, the round-to-nearest writers;
* ``formats``: AWQ, GPTQ and compressed-tensors ``pack-quantized``, read and written;
* ``layout`` / ``kernels``: the layout the Triton W4A16 GEMMs read (repacked once at
  load) and the kernels, for linear layers and experts (CUDA);
* ``layers``: ``W4LinearMethod`` and ``W4MoEMethod`` (the CPU path dequantizes at load);
* ``method``: the plugins ``AwqMethod`` and ``GptqMethod``.

``kvloom-quant-compressed-tensors`` reads ``pack-quantized`` with these layers, and
``kvloom-quant-mxfp4`` runs MXFP4 experts on the same kernels.
"""

from kvloom_quant_int4.layers import W4LinearMethod, W4MoEMethod
from kvloom_quant_int4.method import AwqMethod, GptqMethod

KVLOOM_PLUGIN_API = "1.1"

__all__ = ["AwqMethod", "GptqMethod", "W4LinearMethod", "W4MoEMethod"]
