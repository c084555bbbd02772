"""Linear layers. Every projection of a kvloom model is one of these classes.

* ``Linear``: one HF weight, one GEMM.
* ``MergedLinear``: several HF weights with the same input stacked along the output
  dimension into one GEMM (MLP ``gate_proj`` + ``up_proj`` -> ``gate_up_proj``).
* ``QKVLinear``: a ``MergedLinear`` whose slices are named ``q``, ``k``, ``v`` with the
  query and key/value head counts.

Merged layers keep one weight ``[sum(output_sizes), input_size]``; ``weight_loader``
copies a checkpoint tensor into its slice. A LoRA wrapper finds the projections by
``isinstance(module, LinearBase)`` (and the module's ``prefix``) and reads the slice
layout from ``output_sizes`` / ``shard_names``.

Parameters are created with ``torch.empty`` in the default dtype and device (the model
loader sets both), so building a model does no initialisation work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearBase(nn.Module):
    """``y = x @ weight.T (+ bias)``; weight ``[output_size, input_size]`` (HF layout)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, shard_names: list[str], prefix: str = ""
    ) -> None:
        super().__init__()
        if len(output_sizes) != len(shard_names):
            raise ValueError(f"{prefix}: {len(output_sizes)} output sizes but {len(shard_names)} shard names")
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.shard_names = list(shard_names)
        self.prefix = prefix
        self.weight = nn.Parameter(torch.empty(self.output_size, input_size), requires_grad=False)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def shard_slice(self, shard: str) -> slice:
        """The output rows that hold ``shard``."""
        try:
            index = self.shard_names.index(shard)
        except ValueError:
            raise KeyError(f"{self.prefix}: unknown shard {shard!r} (shards: {', '.join(self.shard_names)})") from None
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Copy a checkpoint tensor (weight or bias) into ``param`` or into its shard."""
        if shard is None:
            if len(self.shard_names) != 1:
                raise ValueError(f"{self.prefix}: a merged layer needs a shard name (one of {self.shard_names})")
            target = param.data
        else:
            target = param.data[self.shard_slice(shard)]
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"{self.prefix}: checkpoint tensor{'' if shard is None else f' for shard {shard}'} has shape "
                f"{tuple(loaded.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        sizes = self.output_size if len(self.output_sizes) == 1 else dict(zip(self.shard_names, self.output_sizes))
        return f"in={self.input_size}, out={sizes}, bias={self.bias is not None}"


class Linear(LinearBase):
    """A single projection (``o_proj``, ``down_proj``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "") -> None:
        super().__init__(input_size, [output_size], bias, ["0"], prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        super().weight_loader(param, loaded, None)


class MergedLinear(LinearBase):
    """Several projections of the same input in one GEMM; shards are named by index
    ("0", "1", ...) in the order given (``gate_up_proj``: "0" = gate, "1" = up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, prefix: str = "") -> None:
        super().__init__(input_size, output_sizes, bias, [str(i) for i in range(len(output_sizes))], prefix)


class QKVLinear(LinearBase):
    """The fused query/key/value projection; shards "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, ["q", "k", "v"], prefix)
        self.head_size = head_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = q_size
        self.kv_size = kv_size

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the query, key and value parts of this layer's output."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v
