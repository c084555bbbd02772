"""The batched LoRA gather-matmul: every token adds its own adapter's low-rank update.

For token ``t`` with adapter slot ``s = token_slots[t]`` (slot 0 = no adapter):

    y[t] += (x[t] @ A[s].T) @ B[s].T

``A`` is ``[num_slots, R, in]`` and ``B`` is ``[num_slots, out, R]`` (the adapter's
scaling is already folded into ``B``; see ``LoRALinear`` for how merged layers stack
their slices into ``R``). The torch code groups the tokens by adapter and runs two GEMMs
per group (``lora_delta_grouped``). A platform may replace it with the ``lora_delta``
custom op (``kvloom.layers.custom_ops``): the CUDA platform's Triton kernel gathers per
token (``kvloom_platform_cuda.lora_ops``), reading the slots from a device tensor so it
can run inside a CUDA graph. The float64 definition both are tested against is
``kvloom.testing.lora_delta_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.layers.custom_ops import get_custom_op


@dataclass
class LoRAMapping:
    """Which adapter slot each token of a step uses (the ``"lora"`` forward-context extra)."""

    token_slots: torch.Tensor
    """int32 ``[num_tokens]``: each token's adapter slot (0 = none), on the model's device."""
    groups: list[tuple[int, torch.Tensor]]
    """``(slot, token indices)`` per adapter present in the step (slot 0 excluded)."""

    @property
    def active(self) -> bool:
        """Whether any token of the step uses an adapter."""
        return bool(self.groups)


def lora_delta_grouped(
    x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, groups: list[tuple[int, torch.Tensor]]
) -> torch.Tensor:
    """``y`` plus every group's update, group by group (two GEMMs per adapter)."""
    if len(groups) == 1 and groups[0][1].numel() == x.shape[0]:
        slot = groups[0][0]  # every token uses one adapter: no gather needed
        return y + (x @ lora_a[slot].T) @ lora_b[slot].T
    out = y.clone()
    for slot, index in groups:
        xs = x.index_select(0, index)
        out.index_add_(0, index, (xs @ lora_a[slot].T) @ lora_b[slot].T)
    return out


def lora_delta_torch(
    x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping
) -> torch.Tensor:
    """The torch code of the ``lora_delta`` op: ``y`` plus each token's update, grouped by
    adapter (``lora_delta_grouped``); ``y`` itself is left as it was."""
    return lora_delta_grouped(x, y, lora_a, lora_b, mapping.groups)


def apply_lora(
    x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping
) -> torch.Tensor:
    """``y`` with the step's LoRA updates added (``x``: the layer input, ``y``: its output),
    by the platform's ``lora_delta`` op when one is active."""
    if (op := get_custom_op("lora_delta")) is not None:
        return op(x, y, lora_a, lora_b, mapping)  # type: ignore[return-value]
    return lora_delta_torch(x, y, lora_a, lora_b, mapping)
