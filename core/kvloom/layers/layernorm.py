"""RMSNorm, computed the way HF transformers computes it (so bf16 results match)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kvloom.layers.custom_ops import get_custom_op


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch code of the ``rms_norm`` op: ``weight * (x / sqrt(mean(x^2) + eps))`` over
    the last dimension, normalised in float32 and cast back to ``x``'s dtype before the
    multiplication by ``weight`` (HF's rounding)."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch code of the ``fused_add_rms_norm`` op: ``s = x + residual`` (in the input
    dtype, as HF's decoder layers add), then ``(rms_norm_torch(s, weight, eps), s)``."""
    s = x + residual
    return rms_norm_torch(s, weight, eps), s


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` with the normalisation in float32.

    Like HF's ``LlamaRMSNorm``: the normalised value is cast back to the input dtype
    *before* the multiplication by ``weight``. ``forward(x, residual)`` first adds
    ``residual`` (in the model dtype, as HF's decoder layers do) and returns
    ``(normed, new_residual)``; platforms may supply fused kernels for both forms
    (``kvloom.layers.custom_ops``). Subclasses that change the formula set
    ``fused = False``.
    """

    fused: ClassVar[bool] = True
    """Whether the platform's fused rms_norm kernels compute this layer."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            if self.fused and (op := get_custom_op("rms_norm")) is not None:
                return op(x, self.weight, self.eps)  # type: ignore[return-value]
            return self._norm(x)
        if self.fused and (op := get_custom_op("fused_add_rms_norm")) is not None:
            return op(x, residual, self.weight, self.eps)  # type: ignore[return-value]
        x = x + residual
        return self._norm(x), x  # fused_add_rms_norm_torch, through _norm (subclasses change the formula)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``(x / rms(x)) * (1 + weight)`` in float32, cast back to the input
    dtype after the multiplication (HF's Gemma, Gemma 2 and Gemma 3; the checkpoint's
    weight is the offset from 1). ``forward(x, residual)`` adds first, as ``RMSNorm``."""

    fused = False  # the platform's rms_norm kernels compute Llama's formula

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
