"""kvloom's MXFP4 quantization method (``quant_method: mxfp4``, gpt-oss's experts), and the
MXFP4 format compressed-tensors' method reads (``mxfp4-pack-quantized``).

* ``formats``: the two checkpoint formats of MXFP4 weights, read into
  ``kvloom-quant-int4``'s unpacked form (whose kernels and CPU path run them);
* ``method``: ``Mxfp4Method`` (the plugin) and ``Mxfp4MoEMethod`` (stacked experts).
"""

from kvloom_quant_mxfp4.formats import GptOssFormat, Mxfp4Format
from kvloom_quant_mxfp4.method import Mxfp4Method, Mxfp4MoEMethod

KVLOOM_PLUGIN_API = "1.1"

__all__ = ["GptOssFormat", "Mxfp4Format", "Mxfp4Method", "Mxfp4MoEMethod"]
