"""kvloom's fp8 W8A8 quantization method (``--quantization fp8``; checkpoints with
``quant_method: fp8``).

* ``ops``: fp8 (e4m3) quantization of weights (per tensor, per output channel, per
  block) and activations (dynamic per token or per 1 x 128 token group, static per
  tensor), and their dequantization;
* ``layers``: ``Fp8Scheme`` (what a layer's checkpoint stores) and the per-layer methods
  ``Fp8LinearMethod`` and ``Fp8MoEMethod`` (parameters, loading, forward, reference); the
  compressed-tensors method reuses them for its ``float-quantized`` format;
* ``method``: ``Fp8Method``, the plugin: the ``fp8`` checkpoint config and online
  quantization of float checkpoints.
"""

from kvloom_quant_fp8.layers import Fp8LinearMethod, Fp8MoEMethod, Fp8Scheme
from kvloom_quant_fp8.method import Fp8Method

KVLOOM_PLUGIN_API = "1.1"

__all__ = ["Fp8LinearMethod", "Fp8Method", "Fp8MoEMethod", "Fp8Scheme"]
