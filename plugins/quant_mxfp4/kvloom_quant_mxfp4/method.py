"""The ``mxfp4`` method: gpt-oss's checkpoints (``quant_method: mxfp4``), MXFP4 experts.

The config::

    {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head", ...]}

Only the routed experts are MXFP4 (every other weight is stored in the model dtype and
runs unquantized). Their tensors are stacked per layer, as gpt-oss stores them:

* ``mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16]`` / ``..._scales [E, 2I, H/32]``, the
  gate and up rows interleaved (row ``2i`` is gate row ``i``, ``2i + 1`` up row ``i``:
  gpt-oss's order, de-interleaved at load into kvloom's gate rows then up rows);
* ``mlp.experts.down_proj_blocks [E, H, I/32, 16]`` / ``..._scales [E, H, I/32]``.

Under tensor parallelism each rank reads its intermediate range of every expert (a rank's
range must start on a 32-feature block for the down projection). The experts run
kvloom's ``fused_moe`` arithmetic (SiLU-and-mul, no biases): a model with gpt-oss's own
expert activation and biases adds them in its ``FusedMoE`` (the hybrid-KV issue's work).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from kvloom_quant_int4.layers import W4MoEMethod

from kvloom.interfaces import LayerInfo, LayerKind, LayerQuantMethod, QuantizationMethod
from kvloom.interfaces.models import materialize
from kvloom_quant_mxfp4.formats import BLOCK, GptOssFormat

#: kvloom's expert projection -> gpt-oss's stacked tensor name.
STACKED_NAMES = {"w13": "gate_up_proj", "w2": "down_proj"}


class Mxfp4MoEMethod(W4MoEMethod):
    """gpt-oss's MXFP4 experts: loaded from the stacked tensors (or, as the conformance kit
    writes them, one expert's projection at a time), run by ``kvloom-quant-int4``'s layers."""

    def __init__(self) -> None:
        super().__init__(GptOssFormat())

    def checkpoint_shards(self, layer: Any, param_name: str) -> list[tuple[str, str | None]] | None:
        projection, _, suffix = param_name.partition("_")
        return [(f"{STACKED_NAMES[projection]}_{suffix}", None)]

    def load_weight(self, layer: Any, name: str, param: Any, loaded: Any, shard: str | None) -> None:
        if shard is not None:  # one expert's projection
            super().load_weight(layer, name, param, loaded, shard)
            return
        projection = name.partition("_")[0]
        inter, full = layer.intermediate_size, layer.full_intermediate_size
        expected = (layer.num_experts, 2 * full) if projection == "w13" else (layer.num_experts, layer.hidden_size)
        what = f"{layer.prefix}.{STACKED_NAMES[projection]}_{name.partition('_')[2]}"
        if tuple(loaded.shape[:2]) != expected or loaded.dim() != param.dim():
            raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected} and "
                             f"{param.dim() - 2} more dims")  # fmt: skip
        if projection == "w13":
            # This rank's (gate, up) row pairs, then gate rows first.
            rows = materialize(loaded.narrow(1, 2 * layer.tp_rank * inter, 2 * inter))
            param.data.copy_(torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1))
            return
        if layer.tp_size > 1 and inter % BLOCK:
            raise ValueError(f"{what}: this rank's {inter} intermediate features do not fill whole {BLOCK}-feature "
                             "blocks; choose a tensor-parallel size that splits on blocks")  # fmt: skip
        blocks = -(-inter // BLOCK)
        param.data.copy_(materialize(loaded.narrow(2, layer.tp_rank * blocks, blocks)))


class Mxfp4Method(QuantizationMethod):
    """gpt-oss's MXFP4 experts (W4A16: e2m1 weights, e8m0 scales per 32; activations in
    the model dtype)."""

    NAME = "mxfp4"
    checkpoint_formats = {"mxfp4": ()}
    layer_kinds = (LayerKind.FUSED_MOE,)
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    weight_dtype = "mxfp4 (e2m1 values, e8m0 scales per 32)"
    activation_dtype = None
    supported_device_types = ("cpu", "cuda")

    def __init__(self, quantization_config: dict[str, Any] | None) -> None:
        super().__init__(quantization_config)
        names = self.quantization_config.get("modules_to_not_convert") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"modules_to_not_convert: {names!r} (allowed: a list of module names or patterns)")
        self.ignored: list[str] = names

    def layer_method(self, layer: LayerInfo) -> LayerQuantMethod | None:
        patterns = [p for p in self.ignored if any(c in p for c in "*?[")]
        globbed = any(fnmatch.fnmatchcase(prefix, p) for prefix in layer.checkpoint_prefixes for p in patterns)
        if globbed or layer.ignored_by([n for n in self.ignored if n not in patterns]):
            return None
        return Mxfp4MoEMethod() if layer.kind is LayerKind.FUSED_MOE else None

    def describe(self) -> str:
        return f"mxfp4: {GptOssFormat().describe()}; activations in the model dtype"


__all__ = ["Mxfp4Method", "Mxfp4MoEMethod"]
