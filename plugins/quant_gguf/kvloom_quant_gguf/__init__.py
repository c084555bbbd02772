"""kvloom's GGUF quantization method: a ``.gguf`` model's quantized tensors run as stored
on the CPU (``--quantization gguf``, the default for GGUF files when installed).

* ``formats``: GGML block types as codes with a scale and min per group (``decode``);
* ``writer``: float weights written as GGML blocks (the format writer, for tests);
* ``layout``: codes and group parameters repacked into the kernels' tiles;
* ``kernels``: the C kernels (int8 activations x 4/8-bit codes, AVX2), built once, and
  their torch reference;
* ``layers``: ``GgufLinearMethod`` and ``GgufEmbeddingMethod`` (loading the raw tensors,
  repacking with a cache, forward, dequantized reference);
* ``method``: ``GgufMethod``, the plugin.
"""

from kvloom_quant_gguf.layers import GgufEmbeddingMethod, GgufLinearMethod
from kvloom_quant_gguf.method import GgufMethod

KVLOOM_PLUGIN_API = "1.1"

__all__ = ["GgufEmbeddingMethod", "GgufLinearMethod", "GgufMethod"]
