"""4-bit weight-only layers: ``W4LinearMethod`` (linear layers) and ``W4MoEMethod``
(experts), over any format with ``params`` / ``read`` / ``write`` (``formats.Int4Format``,
and the MXFP4 formats of ``kvloom-quant-mxfp4``).

At construction the layer gets the checkpoint's tensors as parameters (the format's
names: ``qweight``, ``qzeros``, ``scales``, ``g_idx``; ``weight_packed``, ...; experts
prefix them ``w13_`` / ``w2_``). Once loaded they are read into ``packing.Unpacked`` and
repacked once:

* on CUDA into the kernels' layout (``layout.W4Tensors``: parameters ``w4_qweight``,
  ``w4_scales``, ``w4_zeros``, ``w4_perm``, ``w4_gidx``), which the Triton W4A16 GEMMs
  read (``kernels``);
* elsewhere (the CPU) dequantized into a float ``weight`` in the model dtype (experts:
  ``w13_weight``, ``w2_weight``), which runs as an unquantized layer: the CPU path keeps
  the model dtype's memory, not 4 bits.

The shards of a merged layer share one act-order (``g_idx``): GPTQ orders a layer's
input features by its input's statistics, the same for q, k and v; shards that disagree
are an error naming the layer.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kvloom.interfaces import (
    FusedMoEQuantMethod,
    LinearQuantMethod,
    ParamLayout,
    add_quantized_parameter,
    fused_moe_torch,
    remove_quantized_parameter,
)
from kvloom_quant_int4.formats import Geometry, ParamSpec
from kvloom_quant_int4.layout import FIELDS, W4Tensors, dequantize, expert, stack_experts, to_kernel_layout
from kvloom_quant_int4.packing import Unpacked

logger = logging.getLogger(__name__)


class W4Format(Protocol):
    """What the layers need of a 4-bit checkpoint format."""

    def params(self, geo: Geometry) -> dict[str, ParamSpec]: ...
    def read(self, tensors: dict[str, torch.Tensor], geo: Geometry) -> Unpacked: ...
    def write(self, weight: torch.Tensor) -> dict[str, torch.Tensor]: ...


def kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels serve weights on ``device`` (CUDA), else the CPU path."""
    return device.type == "cuda"


def write_on_host(fmt: W4Format, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The format writer's tensors of ``weight``, computed on the host (a test may run
    with another default device; the loader copies them where the layer is)."""
    with torch.device("cpu"):
        return fmt.write(weight.detach().cpu())


def _register_kernel_layout(layer: Any, prefix: str, w: W4Tensors) -> None:
    for name, tensor in w.tensors().items():
        add_quantized_parameter(layer, f"{prefix}w4_{name}", tensor, ParamLayout())


def _kernel_layout(layer: Any, prefix: str, template: W4Tensors) -> W4Tensors:
    """The layer's ``W4Tensors`` (its parameters, and the sizes kept from loading)."""
    fields = {name: getattr(layer, f"{prefix}w4_{name}", None) for name in FIELDS}
    return W4Tensors(**fields, group_size=template.group_size, n=template.n, e2m1=template.e2m1)


class _GidxCheck:
    """The act-order of a merged layer's shards (or an expert's gate and up) must agree:
    remember the first shard's, compare the others."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], torch.Tensor] = {}

    def check(self, layer: Any, name: str, shard: str | None, value: torch.Tensor) -> None:
        expert_id = shard.partition(".")[0] if shard and "." in shard else ""
        key = (name, expert_id)
        first = self.seen.setdefault(key, value.clone())
        if not torch.equal(first, value):
            raise ValueError(f"{layer.prefix}: the shards of this merged layer have different act-order g_idx "
                             "(kvloom runs them as one GEMM, with one order of the input features)")  # fmt: skip


class W4LinearMethod(LinearQuantMethod):
    """4-bit weights of one ``Linear`` / ``MergedLinear`` / ``QKVLinear``."""

    def __init__(self, fmt: W4Format) -> None:
        self.fmt = fmt
        self.gidx = _GidxCheck()
        self.template: W4Tensors | None = None  # set when repacked for the kernels

    @staticmethod
    def geometry(layer: Any) -> Geometry:
        row_split = layer.parallel == "row" and layer.tp_size > 1
        start = layer.tp_rank * layer.input_size if row_split else 0
        return Geometry(tuple(layer.output_sizes), layer.input_size, layer.full_input_size, start)

    def create_weights(self, layer: Any) -> None:
        for name, (shape, dtype, layout) in self.fmt.params(self.geometry(layer)).items():
            add_quantized_parameter(layer, name, torch.empty(shape, dtype=dtype), layout)

    def load_weight(self, layer: Any, name: str, param: Any, loaded: Any, shard: str | None) -> None:
        layer.load_by_layout(name, param, loaded, shard)
        if name.endswith("g_idx"):
            self.gidx.check(layer, name, shard, param.data)

    def process_weights_after_loading(self, layer: Any) -> None:
        geo = self.geometry(layer)
        names = list(self.fmt.params(geo))
        try:
            unpacked = self.fmt.read({n: getattr(layer, n).data for n in names}, geo)
        except ValueError as exc:
            raise ValueError(f"{layer.prefix}: {exc}") from None
        device = getattr(layer, names[0]).device
        for name in names:
            remove_quantized_parameter(layer, name)
        if kernels_run_on(device):
            from kvloom_platform_cuda.split_k import split_k_counters

            self.template = to_kernel_layout(unpacked)
            _register_kernel_layout(layer, "", self.template)
            split_k_counters(device)  # allocated now, before any CUDA graph captures a split launch
        else:
            add_quantized_parameter(layer, "weight", unpacked.dequantize().to(layer.params_dtype), ParamLayout(0, 1))

    def dequantize(self, layer: Any) -> torch.Tensor:
        if self.template is None:
            return layer.weight.float()
        return dequantize(_kernel_layout(layer, "", self.template))

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.template is None:
            return F.linear(x, layer.weight, bias)
        from kvloom_quant_int4.kernels import op_args

        w = _kernel_layout(layer, "", self.template)
        out = torch.ops.kvloom_quant_int4.linear(x.reshape(-1, x.shape[-1]), *op_args(w))
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def checkpoint_tensors(self, weight: torch.Tensor, input_absmax: float = 8.0) -> dict[str, torch.Tensor]:
        return write_on_host(self.fmt, weight)


class W4MoEMethod(FusedMoEQuantMethod):
    """4-bit experts of one ``FusedMoE``: the format's tensors per expert and projection
    (``w13_`` gate and up, ``w2_`` down), repacked into one ``W4Tensors`` per projection."""

    def __init__(self, fmt: W4Format) -> None:
        self.fmt = fmt
        self.gidx = _GidxCheck()
        self.templates: dict[str, W4Tensors] = {}  # set when repacked for the kernels

    @staticmethod
    def geometries(layer: Any) -> dict[str, Geometry]:
        inter, hidden = layer.intermediate_size, layer.hidden_size
        return {"w13": Geometry((inter, inter), hidden, hidden),
                "w2": Geometry((hidden,), inter, layer.full_intermediate_size, layer.tp_rank * inter)}  # fmt: skip

    def create_weights(self, layer: Any) -> None:
        for proj, geo in self.geometries(layer).items():
            for name, (shape, dtype, layout) in self.fmt.params(geo).items():
                add_quantized_parameter(layer, f"{proj}_{name}", torch.empty(layer.num_experts, *shape, dtype=dtype),
                                        layout)  # fmt: skip

    def load_weight(self, layer: Any, name: str, param: Any, loaded: Any, shard: str | None) -> None:
        layer.load_by_layout(name, param, loaded, shard)
        if name.endswith("g_idx") and shard is not None:
            self.gidx.check(layer, name, shard, param.data[int(shard.partition(".")[0])])

    def process_weights_after_loading(self, layer: Any) -> None:
        for proj, geo in self.geometries(layer).items():
            names = list(self.fmt.params(geo))
            params = {n: getattr(layer, f"{proj}_{n}").data for n in names}
            try:
                experts = [self.fmt.read({n: t[e] for n, t in params.items()}, geo) for e in range(layer.num_experts)]
            except ValueError as exc:
                raise ValueError(f"{layer.prefix} ({proj}): {exc}") from None
            device = next(iter(params.values())).device
            for name in names:
                remove_quantized_parameter(layer, f"{proj}_{name}")
            if kernels_run_on(device):
                self.templates[proj] = stacked = stack_experts([to_kernel_layout(u) for u in experts])
                _register_kernel_layout(layer, f"{proj}_", stacked)
            else:
                weight = torch.stack([u.dequantize() for u in experts]).to(layer.params_dtype)
                add_quantized_parameter(layer, f"{proj}_weight", weight, ParamLayout(0, 1))

    def _layouts(self, layer: Any) -> tuple[W4Tensors, W4Tensors]:
        return _kernel_layout(layer, "w13_", self.templates["w13"]), _kernel_layout(layer, "w2_", self.templates["w2"])

    def dequantize(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.templates:
            return layer.w13_weight.float(), layer.w2_weight.float()
        w13, w2 = self._layouts(layer)
        experts = range(layer.num_experts)
        return (torch.stack([dequantize(expert(w13, e)) for e in experts]),
                torch.stack([dequantize(expert(w2, e)) for e in experts]))  # fmt: skip

    def apply(
        self, layer: Any, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if not self.templates:
            return fused_moe_torch(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        from kvloom_quant_int4.kernels import op_args

        w13, w2 = self._layouts(layer)
        return torch.ops.kvloom_quant_int4.fused_moe(hidden, topk_weights, topk_ids, *op_args(w13), *op_args(w2))

    def checkpoint_tensors(self, weight: torch.Tensor, input_absmax: float = 8.0) -> dict[str, torch.Tensor]:
        return write_on_host(self.fmt, weight)
