"""Linear layers. Every projection of a kvloom model is one of these classes.

* ``Linear``: one HF weight, one GEMM.
* ``MergedLinear``: several HF weights with the same input stacked along the output
  dimension into one GEMM (MLP ``gate_proj`` + ``up_proj`` -> ``gate_up_proj``).
* ``QKVLinear``: a ``MergedLinear`` whose slices are named ``q``, ``k``, ``v`` with the
  query and key/value head counts.

Merged layers keep one weight ``[sum(output_sizes), input_size]``; ``weight_loader``
copies a checkpoint tensor into its slice. It accepts lazy checkpoint handles
(``kvloom.loader.lazy_tensor``; ``accepts_lazy_weights``) and reads only the rows or columns
this rank keeps. A LoRA wrapper finds the projections by
``isinstance(module, LinearBase)`` (and the module's ``prefix``) and reads the slice
layout from ``output_sizes`` / ``shard_names``.

Parameters are created with ``torch.empty`` in the default dtype and device (the model
loader sets both), so building a model does no initialisation work.

Quantization: a layer built while the model loader quantizes the model
(``kvloom.quantization.context``) asks the method for its ``LinearQuantMethod``
(``quant_method``; ``None``, the default, is the plain float weight). The method then
creates the weights (``weight`` in its own dtype, ``weight_scale``, ...), and the layer
hands it the loading of those parameters and its forward; ``load_by_layout`` places each
shard and cuts this rank's part by the parameter's ``ParamLayout``. ``quantizable=False``
keeps a layer unquantized whatever the checkpoint says (MoE routers).

Tensor parallelism (``parallel``): ``"replicated"`` (the default) keeps the whole weight on
every rank; ``"column"`` keeps this rank's rows of every shard (``output_sizes`` are the
local sizes, ``full_output_sizes`` the checkpoint's) and needs no collective; ``"row"``
keeps this rank's input columns and sums the partial products over the ranks (one
all-reduce, the bias added once after it). The rank and world size are read from
``kvloom.distributed.parallel_state`` when the layer is built; at world size 1 every mode
is the plain GEMM.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.distributed import parallel_state
from kvloom.loader.lazy_tensor import CheckpointTensor, materialize
from kvloom.quantization.context import layer_quant_method
from kvloom.quantization.layer_methods import LinearQuantMethod, Span, load_per_shard, load_region
from kvloom.quantization.method import LayerKind
from kvloom.utils import cdiv

ParallelMode = Literal["replicated", "column", "row"]


def _split(size: int, world_size: int, what: str) -> int:
    if size % world_size != 0:
        raise ValueError(f"{what}: {size} is not divisible by the tensor-parallel size {world_size}")
    return size // world_size


class LinearBase(nn.Module):
    """``y = x @ weight.T (+ bias)``; weight ``[output_size, input_size]`` (HF layout)."""

    accepts_lazy_weights = True
    """``weight_loader`` takes ``LazyTensor`` handles and reads only this rank's part (a
    subclass that overrides ``weight_loader`` gets whole tensors unless it sets it too)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        shard_names: list[str],
        prefix: str = "",
        parallel: ParallelMode = "replicated",
        shard_starts: list[int] | None = None,
        local_output_sizes: list[int] | None = None,
        quantizable: bool = True,
    ) -> None:
        """``output_sizes`` and ``input_size`` are the checkpoint's (whole) sizes. A column-
        parallel layer keeps ``output_sizes[i] / tp`` rows of shard ``i`` starting at row
        ``rank * that`` unless ``local_output_sizes`` / ``shard_starts`` say otherwise (the
        replicated KV heads of ``QKVLinear``). ``quantizable=False``: never quantized."""
        super().__init__()
        if len(output_sizes) != len(shard_names):
            raise ValueError(f"{prefix}: {len(output_sizes)} output sizes but {len(shard_names)} shard names")
        self.parallel = parallel
        self.tp_rank = parallel_state.tp_rank() if parallel != "replicated" else 0
        self.tp_size = parallel_state.tp_world_size() if parallel != "replicated" else 1
        self.full_output_sizes = list(output_sizes)
        self.full_input_size = input_size
        if parallel == "column":
            local = local_output_sizes or [_split(n, self.tp_size, f"{prefix} output size") for n in output_sizes]
            self.shard_starts = shard_starts or [self.tp_rank * n for n in local]
            output_sizes = local
        else:
            self.shard_starts = [0] * len(output_sizes)
        if parallel == "row":
            input_size = _split(input_size, self.tp_size, f"{prefix} input size")
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.shard_names = list(shard_names)
        self.prefix = prefix
        self.params_dtype = torch.get_default_dtype()
        self.quant_method: LinearQuantMethod | None = None
        if quantizable:
            self.quant_method = layer_quant_method(  # type: ignore[assignment]
                LayerKind.LINEAR, prefix, input_size=self.full_input_size, output_sizes=self.full_output_sizes,
                shard_names=self.shard_names, tp_size=self.tp_size,
            )  # fmt: skip
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(self.output_size, input_size), requires_grad=False)
        else:
            self.quant_method.create_weights(self)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def _this_rank(self, loaded: CheckpointTensor, index: int, is_bias: bool) -> CheckpointTensor:
        """The part of a whole checkpoint tensor of shard ``index`` this rank keeps (a
        narrowed handle of a lazy one: nothing is read here)."""
        if self.tp_size == 1:
            return loaded
        if self.parallel == "column":
            full = self.full_output_sizes[index]
            if loaded.shape[0] != full:
                raise ValueError(f"{self.prefix}: checkpoint tensor has {loaded.shape[0]} output rows, expected {full}")
            return loaded.narrow(0, self.shard_starts[index], self.output_sizes[index])
        if self.parallel == "row" and not is_bias:
            if loaded.dim() != 2 or loaded.shape[1] != self.full_input_size:
                raise ValueError(f"{self.prefix}: checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                                 f"{self.full_input_size} input columns")  # fmt: skip
            return loaded.narrow(1, self.tp_rank * self.input_size, self.input_size)
        return loaded

    def shard_slice(self, shard: str) -> slice:
        """The output rows that hold ``shard``."""
        try:
            index = self.shard_names.index(shard)
        except ValueError:
            raise KeyError(f"{self.prefix}: unknown shard {shard!r} (shards: {', '.join(self.shard_names)})") from None
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def output_blocks(self, block: int) -> int:
        """Entries along the output of a parameter with ``block`` weight rows per entry:
        each shard starts on an entry of its own (``ParamLayout``)."""
        return sum(cdiv(n, block) for n in self.output_sizes)

    def _shard_index(self, shard: str | None) -> int:
        if shard is None:
            if len(self.shard_names) != 1:
                raise ValueError(f"{self.prefix}: a merged layer needs a shard name (one of {self.shard_names})")
            return 0
        self.shard_slice(shard)  # a KeyError naming the shards for an unknown one
        return self.shard_names.index(shard)

    def load_by_layout(self, name: str, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None) -> None:
        """Copy a checkpoint tensor into the quantized parameter ``name`` by its
        ``ParamLayout``: the shard's rows (each shard from its own block), this rank's
        rows (column-parallel) or input columns (row-parallel), one value per shard."""
        layout = self.quant_layouts[name]
        index = self._shard_index(shard)
        what = f"{self.prefix}.{name}" + ("" if shard is None else f" (shard {shard})")
        if layout.per_shard:
            load_per_shard(param.data, index, loaded, what)
            return
        out = inp = None
        if layout.output_dim is not None:
            block = layout.output_block
            dst = sum(cdiv(n, block) for n in self.output_sizes[:index])
            expected = cdiv(self.full_output_sizes[index], block)
            if loaded.dim() <= layout.output_dim or loaded.shape[layout.output_dim] != expected:
                raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected} "
                                 f"entries along dim {layout.output_dim}")  # fmt: skip
            start = self.shard_starts[index] if self.parallel == "column" else 0
            out = Span(start, self.output_sizes[index], dst)
        if layout.input_dim is not None and self.parallel == "row" and self.tp_size > 1:
            inp = Span(self.tp_rank * self.input_size, self.input_size, 0)
        load_region(param.data, loaded, layout, out, inp, what)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        """Copy a checkpoint tensor (weight or bias) into ``param`` or into its shard:
        this rank's rows (column-parallel) or input columns (row-parallel) of it, read
        from the file only then when ``loaded`` is a lazy handle. A quantized layer's
        own parameters go to its method (``LinearQuantMethod.load_weight``)."""
        if self.quant_method is not None and param is not self.bias:
            name = next(n for n, p in self._parameters.items() if p is param)
            self.quant_method.load_weight(self, name, param, loaded, shard)
            return
        if shard is None:
            if len(self.shard_names) != 1:
                raise ValueError(f"{self.prefix}: a merged layer needs a shard name (one of {self.shard_names})")
            target = param.data
            index = 0
        else:
            target = param.data[self.shard_slice(shard)]
            index = self.shard_names.index(shard)
        loaded = self._this_rank(loaded, index, is_bias=param is self.bias)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"{self.prefix}: checkpoint tensor{'' if shard is None else f' for shard {shard}'} has shape "
                f"{tuple(loaded.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(materialize(loaded))

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as a plain ``[output_size, input_size]`` tensor in the model dtype:
        ``weight`` itself, or the quantization method's dequantized reference (computed
        on each call: for code that reads a projection's weight, such as MLA's absorbed
        ``kv_b_proj``)."""
        if self.quant_method is None:
            return self.weight
        return self.quant_method.dequantize(self).to(self.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row_split = self.parallel == "row" and self.tp_size > 1
        if self.quant_method is not None:
            out = self.quant_method.apply(self, x, None if row_split else self.bias)
        elif not row_split:
            return F.linear(x, self.weight, self.bias)
        else:
            out = F.linear(x, self.weight)
        if not row_split:
            return out
        # Each rank holds a slice of the input features: sum the partial products, then
        # add the bias once.
        out = parallel_state.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        sizes = self.output_size if len(self.output_sizes) == 1 else dict(zip(self.shard_names, self.output_sizes))
        tp = "" if self.tp_size == 1 else f", {self.parallel}-parallel rank {self.tp_rank}/{self.tp_size}"
        quant = "" if self.quant_method is None else f", quant={type(self.quant_method).__name__}"
        return f"in={self.input_size}, out={sizes}, bias={self.bias is not None}{tp}{quant}"


class Linear(LinearBase):
    """A single projection (``o_proj``, ``down_proj``)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, prefix: str = "",
        parallel: ParallelMode = "replicated", quantizable: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(input_size, [output_size], bias, ["0"], prefix, parallel, quantizable=quantizable)

    accepts_lazy_weights = True
    """``weight_loader`` (``LinearBase``'s, with no shard) takes ``LazyTensor`` handles."""

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        super().weight_loader(param, loaded, None)


class MergedLinear(LinearBase):
    """Several projections of the same input in one GEMM; shards are named by index
    ("0", "1", ...) in the order given (``gate_up_proj``: "0" = gate, "1" = up)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, prefix: str = "",
        parallel: ParallelMode = "replicated",
    ) -> None:  # fmt: skip
        super().__init__(input_size, output_sizes, bias, [str(i) for i in range(len(output_sizes))], prefix, parallel)


class QKVLinear(LinearBase):
    """The fused query/key/value projection; shards "q", "k", "v".

    Column-parallel (``parallel=True`` at a tensor-parallel size above 1): each rank keeps
    ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads, or, with fewer KV
    heads than ranks, one KV head replicated on ``tp / num_kv_heads`` ranks (the one its
    query heads attend to). ``num_heads`` / ``num_kv_heads`` are this rank's counts."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        prefix: str = "",
        parallel: bool = False,
    ) -> None:
        tp, rank = (parallel_state.tp_world_size(), parallel_state.tp_rank()) if parallel else (1, 0)
        local_heads = _split(num_heads, tp, f"{prefix} num_attention_heads")
        if num_kv_heads >= tp:
            local_kv = _split(num_kv_heads, tp, f"{prefix} num_key_value_heads")
            kv_head = rank * local_kv
        else:
            if tp % num_kv_heads != 0:
                raise ValueError(f"{prefix} num_key_value_heads: the tensor-parallel size {tp} is not a multiple "
                                 f"of {num_kv_heads}")  # fmt: skip
            local_kv, kv_head = 1, rank // (tp // num_kv_heads)
        q_size, kv_size = local_heads * head_size, local_kv * head_size
        super().__init__(
            hidden_size,
            [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size],
            bias,
            ["q", "k", "v"],
            prefix,
            "column" if parallel else "replicated",
            shard_starts=[rank * q_size, kv_head * head_size, kv_head * head_size],
            local_output_sizes=[q_size, kv_size, kv_size],
        )
        self.head_size = head_size
        self.num_heads = local_heads
        self.num_kv_heads = local_kv
        self.q_size = q_size
        self.kv_size = kv_size

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the query, key and value parts of this layer's output."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v
