"""The ``fp8`` method: checkpoints whose ``quantization_config`` has ``quant_method: fp8``
(vLLM's and transformers' fp8 format), and online ``--quantization fp8``.

The config (``config.json``)::

    {"quant_method": "fp8", "activation_scheme": "dynamic" | "static",
     "weight_block_size": [128, 128],              # block-wise (DeepSeek-V3, Qwen3-FP8)
     "fmt": "e4m3", "ignored_layers" / "modules_to_not_convert": [...]}

Without ``weight_block_size`` each projection stores an fp8 ``weight`` with one
``weight_scale`` (per tensor), and, with ``activation_scheme: static``, one ``input_scale``;
activations are quantized per token when dynamic. With it, ``weight_scale_inv`` holds one
scale per block and activations are quantized per token and ``weight_block_size[1]``
features. Online quantization (no ``quantization_config``) quantizes the float weights of
linear layers and experts per output channel, activations per token.
"""

from __future__ import annotations

from typing import Any

from kvloom.interfaces import LayerInfo, LayerKind, LayerQuantMethod, QuantizationMethod
from kvloom_quant_fp8.layers import Fp8LinearMethod, Fp8MoEMethod, Fp8Scheme

#: The ``fmt`` values that name e4m3 (the only fp8 format these checkpoints use).
E4M3_NAMES = (None, "e4m3", "float8_e4m3fn")


def layer_method_for(layer: LayerInfo, scheme: Fp8Scheme) -> LayerQuantMethod | None:
    """The fp8 method of a linear layer or an expert layer under ``scheme``."""
    if layer.kind is LayerKind.LINEAR:
        return Fp8LinearMethod(scheme)
    if layer.kind is LayerKind.FUSED_MOE:
        return Fp8MoEMethod(scheme)
    return None


class Fp8Method(QuantizationMethod):
    """fp8 W8A8 (float8_e4m3fn weights and activations, float32 scales)."""

    NAME = "fp8"
    checkpoint_formats = {"fp8": ()}
    online = True
    layer_kinds = (LayerKind.LINEAR, LayerKind.FUSED_MOE)
    weight_dtype = "float8_e4m3fn (per-tensor, per-channel or 128x128 block scales)"
    activation_dtype = "float8_e4m3fn (dynamic per token or 1x128 group, or static per tensor)"
    supported_device_types = ("cpu", "cuda")

    def __init__(self, quantization_config: dict[str, Any] | None) -> None:
        super().__init__(quantization_config)
        config = self.quantization_config
        self.ignored: list[str] = []
        for field in ("ignored_layers", "modules_to_not_convert"):
            names = config.get(field) or []
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"{field}: {names!r} (allowed: a list of module names)")
            self.ignored += names
        if quantization_config is None:
            self.scheme = Fp8Scheme("channel", "token", online=True)
            return
        fmt = config.get("fmt")
        if fmt not in E4M3_NAMES:
            raise ValueError(f"fmt: {fmt!r} is not supported (allowed: e4m3)")
        activation = config.get("activation_scheme", "dynamic")
        if activation not in ("dynamic", "static"):
            raise ValueError(f"activation_scheme: {activation!r} (allowed: dynamic, static)")
        block = config.get("weight_block_size")
        if block is None:
            self.scheme = Fp8Scheme("tensor", "token" if activation == "dynamic" else "tensor")
            return
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):  # fmt: skip
            raise ValueError(f"weight_block_size: {block!r} (allowed: two positive ints, e.g. [128, 128])")
        if activation == "static":
            raise ValueError("activation_scheme: 'static' with weight_block_size (allowed: dynamic; block-wise "
                             "checkpoints quantize activations per token group)")  # fmt: skip
        self.scheme = Fp8Scheme("block", "group", (block[0], block[1]), scale_name="weight_scale_inv")

    def layer_method(self, layer: LayerInfo) -> LayerQuantMethod | None:
        if layer.ignored_by(self.ignored):
            return None
        return layer_method_for(layer, self.scheme)

    def describe(self) -> str:
        ignored = f"; unquantized: {', '.join(self.ignored)}" if self.ignored else ""
        return f"fp8: {self.scheme.describe()}{ignored}"

