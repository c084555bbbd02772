"""fp8 layers: what a layer's checkpoint stores (``Fp8Scheme``), and the per-layer methods
for linear layers (``Fp8LinearMethod``) and experts (``Fp8MoEMethod``).

Parameters (names = the checkpoint tensors' suffixes):

* ``weight``: float8_e4m3fn ``[out, in]`` (experts: ``w13_weight``, ``w2_weight``);
* the weight scale ``weight_scale`` (``weight_scale_inv`` in DeepSeek-style block
  checkpoints): ``[num_shards]`` per tensor, ``[out, 1]`` per channel, ``[blocks, blocks]``;
* ``input_scale`` ``[num_shards]``, static activation scales only (the largest of a
  merged layer's shards quantizes its input, as the kernels take one).

Kernels (chosen once the weights are loaded): on CUDA with compute capability 8.9 or
newer, linear layers with quantized activations run ``gemm.fp8_linear`` (one opaque torch
op: a Triton activation quantizer, then the split-K Triton GEMM at decode sizes and for
block-wise weights, ``torch._scaled_mm`` for many rows of per-tensor / per-channel
weights); weight-only fp8 (no activation quantization), experts, and every CPU run take
the reference arithmetic in torch: the activation quantized and dequantized
(``ops.fake_quantize_activation``), the weight dequantized (on the CPU once at load, kept
beside the fp8 weight), a GEMM in the model dtype. Online quantization (``--quantization
fp8`` of a float checkpoint) loads the float weight and quantizes it per channel after
loading.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvloom.interfaces import (
    FusedMoEQuantMethod,
    LinearQuantMethod,
    ParamLayout,
    add_quantized_parameter,
    fused_moe_torch,
)
from kvloom_quant_fp8 import ops

logger = logging.getLogger(__name__)

#: torch._scaled_mm with rowwise scales needs Ada (8.9) or newer.
SCALED_MM_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Fp8Scheme:
    """How one layer's fp8 weights and activations are quantized."""

    weights: str
    """``"tensor"``, ``"channel"`` or ``"block"``."""
    activations: str | None
    """``"token"`` (dynamic per token), ``"group"`` (dynamic per 1 x ``block[1]``),
    ``"tensor"`` (static, ``input_scale``), or ``None`` (weight-only, W8A16)."""
    block: tuple[int, int] | None = None
    """``(bo, bi)`` for block-wise weights."""
    scale_name: str = "weight_scale"
    """The checkpoint name of the weight scale (``weight_scale_inv`` for DeepSeek's blocks)."""
    online: bool = False
    """The checkpoint holds float weights: quantize them (per channel) after loading."""

    def __post_init__(self) -> None:
        if self.weights not in ("tensor", "channel", "block"):
            raise ValueError(f"weight strategy {self.weights!r}: allowed tensor, channel, block")
        if self.activations not in ("token", "group", "tensor", None):
            raise ValueError(f"activation strategy {self.activations!r}: allowed token, group, tensor, none")
        if (self.weights == "block") != (self.block is not None):
            raise ValueError("a block size goes with block-wise weights, and only with them")
        if self.activations == "group" and self.block is None:
            raise ValueError("per-token-group activations go with block-wise weights")

    def describe(self) -> str:
        weights = f"{self.block[0]}x{self.block[1]} block" if self.block else f"per-{self.weights}"
        group = f"dynamic per-token-group (1x{self.block[1] if self.block else 0})"
        acts = {"token": "dynamic per-token", "group": group, "tensor": "static per-tensor",
                None: "unquantized (weight-only)"}[self.activations]  # fmt: skip
        return f"{weights} weights{' (quantized at load)' if self.online else ''}, {acts} activations"

    # ---------------------------------------------------------------- arithmetic
    def fake_quantize(self, x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
        group = self.block[1] if self.block else 128
        static = input_scale.float().max() if input_scale is not None else None
        return ops.fake_quantize_activation(x, self.activations, group, static)

    def scale_shape(self, rows_per_shard: list[int], cols: int) -> tuple[tuple[int, ...], ParamLayout]:
        """The weight scale's shape and layout for a weight of these shards."""
        if self.weights == "tensor":
            return (len(rows_per_shard),), ParamLayout(per_shard=True)
        if self.weights == "channel":
            return (sum(rows_per_shard), 1), ParamLayout(output_dim=0)
        bo, bi = self.block  # type: ignore[misc]
        return (sum(ops.cdiv(n, bo) for n in rows_per_shard), ops.cdiv(cols, bi)), ParamLayout(0, 1, bo, bi)

    def checkpoint_tensors(self, weight: torch.Tensor, input_absmax: float) -> dict[str, torch.Tensor]:
        if self.online:
            return {"weight": weight}
        q, scale = ops.quantize_weight(weight, self.weights, self.block)
        tensors = {"weight": q, self.scale_name: scale}
        if self.activations == "tensor":
            tensors["input_scale"] = torch.tensor(input_absmax / ops.FP8_MAX, dtype=torch.float32)
        return tensors


def gpu_kernel(scheme: Fp8Scheme, weight: torch.Tensor) -> bool:
    """Whether a linear layer of ``scheme`` runs ``gemm.fp8_linear`` on its fp8 ``weight``'s
    device (see the module docstring), else the torch reference."""
    if weight.device.type != "cuda" or torch.cuda.get_device_capability(weight.device) < SCALED_MM_CAPABILITY:
        return False
    if scheme.weights == "block":
        return scheme.activations == "group"
    # _scaled_mm (many rows) needs both GEMM dimensions of the weight in multiples of 16.
    return scheme.activations in ("token", "tensor") and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


class Fp8LinearMethod(LinearQuantMethod):
    """fp8 weights of one ``Linear`` / ``MergedLinear`` / ``QKVLinear``."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: Any) -> None:
        s = self.scheme
        rows, cols = layer.output_sizes, layer.input_size
        if s.online:
            add_quantized_parameter(layer, "weight", torch.empty(sum(rows), cols), ParamLayout(0, 1))
            return
        add_quantized_parameter(layer, "weight", torch.empty(sum(rows), cols, dtype=ops.FP8), ParamLayout(0, 1))
        shape, layout = s.scale_shape(rows, cols)
        add_quantized_parameter(layer, s.scale_name, torch.empty(shape, dtype=torch.float32), layout)
        if s.activations == "tensor":
            add_quantized_parameter(layer, "input_scale", torch.empty(len(rows)), ParamLayout(per_shard=True))

    def process_weights_after_loading(self, layer: Any) -> None:
        s = self.scheme
        if s.online:
            q, scale = ops.quantize_weight(layer.weight.data, "channel")
            add_quantized_parameter(layer, "weight", q, ParamLayout(0, 1))
            add_quantized_parameter(layer, s.scale_name, scale, ParamLayout(output_dim=0))
        self.kernel = gpu_kernel(s, layer.weight)
        if not self.kernel:
            # The torch reference dequantizes the weight; on the CPU once, here, in the model
            # dtype (a copy beside the fp8 weight: the CPU runs fp8 checkpoints for correctness,
            # and a dequantization per call made a 135M model decode at ~1 token/s).
            on_cpu = layer.weight.device.type == "cpu"
            layer.__dict__["fp8_dequantized"] = self.dequantize(layer).to(layer.params_dtype) if on_cpu else None
            return
        from kvloom_platform_cuda.split_k import split_k_counters

        from kvloom_quant_fp8.gemm import row_block_scales  # also defines torch.ops.kvloom_quant_fp8.linear

        split_k_counters(layer.weight.device)  # allocated now, before any CUDA graph captures a split launch

        if s.weights == "block":
            scale = getattr(layer, s.scale_name)
            layer.__dict__["fp8_row_scales"] = row_block_scales(scale, layer.output_sizes, s.block[0])  # type: ignore[index]
        else:
            # One float32 scale per output row, the rowwise layout the kernels read.
            layer.__dict__["fp8_row_scales"] = self._row_scales(layer)
        # A static activation scale: the largest of a merged layer's shards, one tensor kept.
        static = layer.input_scale.float().max().reshape(1) if s.activations == "tensor" else None
        layer.__dict__["fp8_static_scale"] = static

    def _row_scales(self, layer: Any) -> torch.Tensor:
        scale = getattr(layer, self.scheme.scale_name).float()
        if self.scheme.online or self.scheme.weights == "channel":
            return scale.reshape(1, -1).contiguous()
        # Per tensor: each shard's scale over its rows.
        sizes = torch.tensor(layer.output_sizes, device=scale.device)
        return scale.repeat_interleave(sizes).reshape(1, -1).contiguous()

    def dequantize(self, layer: Any) -> torch.Tensor:
        s = self.scheme
        strategy = "channel" if s.online else s.weights
        return ops.dequantize_shards(layer.weight, getattr(layer, s.scale_name), strategy, layer.output_sizes, s.block)

    def reference_input(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return self.scheme.fake_quantize(x, getattr(layer, "input_scale", None))

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if getattr(self, "kernel", False):
            group = self.scheme.block[1] if self.scheme.block else 0
            out = torch.ops.kvloom_quant_fp8.linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.fp8_row_scales,
                                                    group, layer.fp8_static_scale)  # fmt: skip
            out = out.reshape(*x.shape[:-1], -1)
            return out if bias is None else out + bias
        xq = self.reference_input(layer, x).to(x.dtype)
        weight = layer.__dict__.get("fp8_dequantized")
        return F.linear(xq, (weight if weight is not None else self.dequantize(layer)).to(x.dtype), bias)

    def checkpoint_tensors(self, weight: torch.Tensor, input_absmax: float = 8.0) -> dict[str, torch.Tensor]:
        return self.scheme.checkpoint_tensors(weight, input_absmax)


class Fp8MoEMethod(FusedMoEQuantMethod):
    """fp8 experts of one ``FusedMoE``: ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]``
    with their scales (per expert and projection); the experts run the torch code of the
    ``fused_moe`` op on dequantized weights, each GEMM's input quantized as the scheme says."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def _shapes(self, layer: Any) -> dict[str, tuple[list[int], int]]:
        inter, hidden = layer.intermediate_size, layer.hidden_size
        return {"w13": ([inter, inter], hidden), "w2": ([hidden], inter)}

    def create_weights(self, layer: Any) -> None:
        s, experts = self.scheme, layer.num_experts
        for proj, (rows, cols) in self._shapes(layer).items():
            dtype = layer.params_dtype if s.online else ops.FP8
            add_quantized_parameter(layer, f"{proj}_weight", torch.empty(experts, sum(rows), cols, dtype=dtype),
                                    ParamLayout(0, 1))  # fmt: skip
            if s.online:
                continue
            shape, layout = s.scale_shape(rows, cols)
            add_quantized_parameter(layer, f"{proj}_{s.scale_name}", torch.empty(experts, *shape), layout)
            if s.activations == "tensor":
                add_quantized_parameter(layer, f"{proj}_input_scale", torch.empty(experts, len(rows)),
                                        ParamLayout(per_shard=True))  # fmt: skip

    def process_weights_after_loading(self, layer: Any) -> None:
        s = self.scheme
        if not s.online:
            return
        for proj in ("w13", "w2"):
            weight = getattr(layer, f"{proj}_weight").data
            pairs = [ops.quantize_weight(w, "channel") for w in weight]
            add_quantized_parameter(layer, f"{proj}_weight", torch.stack([q for q, _ in pairs]), ParamLayout(0, 1))
            add_quantized_parameter(layer, f"{proj}_{s.scale_name}", torch.stack([sc for _, sc in pairs]),
                                    ParamLayout(output_dim=0))  # fmt: skip

    def dequantize(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scheme
        strategy = "channel" if s.online else s.weights
        out = []
        for proj, (rows, _) in self._shapes(layer).items():
            weight, scale = getattr(layer, f"{proj}_weight"), getattr(layer, f"{proj}_{s.scale_name}")
            experts = [ops.dequantize_shards(w, sc, strategy, rows, s.block) for w, sc in zip(weight, scale)]
            out.append(torch.stack(experts))
        return out[0], out[1]

    def reference_input(self, layer: Any, x: torch.Tensor, projection: str) -> torch.Tensor:
        return self.scheme.fake_quantize(x, getattr(layer, f"{projection}_input_scale", None))

    def apply(
        self, layer: Any, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        w13, w2 = self.dequantize(layer)
        dtype = hidden.dtype
        xq = self.reference_input(layer, hidden, "w13").to(dtype)
        return fused_moe_torch(xq, w13.to(dtype), w2.to(dtype), topk_weights, topk_ids,
                               down_input=lambda a: self.reference_input(layer, a, "w2").to(dtype))  # fmt: skip

    def checkpoint_tensors(self, weight: torch.Tensor, input_absmax: float = 8.0) -> dict[str, torch.Tensor]:
        return self.scheme.checkpoint_tensors(weight, input_absmax)
