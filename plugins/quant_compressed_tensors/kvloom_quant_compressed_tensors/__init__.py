"""kvloom's compressed-tensors quantization method: checkpoints with ``quant_method:
compressed-tensors`` (what llm-compressor writes), the ``float-quantized`` format (fp8 W8A8
and W8A16) in this release; its layers are ``kvloom-quant-fp8``'s."""

from kvloom_quant_compressed_tensors.method import CompressedTensorsMethod

KVLOOM_PLUGIN_API = "1.1"

__all__ = ["CompressedTensorsMethod"]
