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


def get_gated_activation(hidden_act: str) -> nn.Module:
    """The gated activation for an HF ``hidden_act`` name."""
    if hidden_act == "silu":
        return SiluAndMul()
    raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported (supported: silu)")
