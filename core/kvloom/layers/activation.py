"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.layers.custom_ops import get_custom_op


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The torch code of the ``silu_and_mul`` op: ``silu(x[..., :d]) * x[..., d:]``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension (the output
    of a merged ``gate_up_proj``): ``[..., 2 * d] -> [..., d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (op := get_custom_op("silu_and_mul")) is not None:
            return op(x)  # type: ignore[return-value]
        return silu_and_mul_torch(x)


class GeluAndMul(nn.Module):
    """``gelu(gate) * up`` for ``x = [gate | up]``: exact GELU, or its tanh approximation
    (``approximate="tanh"``: HF's ``gelu_pytorch_tanh``, Gemma's)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


#: HF activation names and the gated activation each makes.
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


def get_gated_activation(hidden_act: str) -> nn.Module:
    """The gated activation for an HF ``hidden_act`` name (``GATED_ACTIVATIONS``)."""
    if hidden_act == "silu":
        return SiluAndMul()
    if hidden_act in ("gelu", "gelu_pytorch_tanh"):
        return GeluAndMul("tanh" if hidden_act == "gelu_pytorch_tanh" else "none")
    raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported (supported: {', '.join(GATED_ACTIVATIONS)})")
