"""``LoRALinear``: a kvloom projection plus a stack of LoRA adapters, one per slot.

The wrapper replaces a ``LinearBase`` module of the model (same attribute name, the
original under ``base_layer``). A merged layer adapts each slice separately
(``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up): slice ``i`` owns rank rows
``[i * max_rank, (i + 1) * max_rank)`` of ``lora_a`` and writes its output rows through
the matching columns of ``lora_b``, so one shrink and one expand serve every slice (``B``
is block-diagonal). Slot 0 stays zero: it means "no adapter".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvloom.forward_context import get_forward_context
from kvloom.layers.linear import LinearBase
from kvloom.lora.ops import LoRAMapping, apply_lora

#: The forward-context extra that carries the step's ``LoRAMapping``.
LORA_EXTRA = "lora"


def current_lora_mapping() -> LoRAMapping | None:
    try:
        return get_forward_context().extras.get(LORA_EXTRA)
    except RuntimeError:  # called outside a step (e.g. a test driving the model directly)
        return None


class LoRALinear(nn.Module):
    def __init__(self, base_layer: LinearBase, slice_names: list[str], num_slots: int, max_rank: int) -> None:
        """``slice_names``: the HF module name adapted by each slice of ``base_layer``
        (``model.layers.0.self_attn.q_proj``, ...), in output order."""
        super().__init__()
        if len(slice_names) != len(base_layer.shard_names):
            raise ValueError(f"{base_layer.prefix}: {len(slice_names)} names for {len(base_layer.shard_names)} slices")
        self.base_layer = base_layer
        self.slice_names = list(slice_names)
        self.slices = [base_layer.shard_slice(s) for s in base_layer.shard_names]
        self.max_rank = max_rank
        # The activations' dtype: the weight's, or the model dtype of a quantized layer.
        device = next(base_layer.parameters()).device
        dtype = base_layer.weight.dtype if base_layer.quant_method is None else base_layer.params_dtype
        total_rank = len(self.slices) * max_rank
        kwargs: dict[str, Any] = {"dtype": dtype, "device": device}
        self.register_buffer("lora_a", torch.zeros(num_slots, total_rank, base_layer.input_size, **kwargs), False)
        self.register_buffer("lora_b", torch.zeros(num_slots, base_layer.output_size, total_rank, **kwargs), False)

    def __getattr__(self, name: str) -> Any:
        # Model code may read attributes of the projection it built (sizes, prefix).
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base_layer"], name)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Write one adapter's matrices for this layer into ``slot`` (zeros where the
        adapter does not adapt a slice; ``weights=None`` clears the slot)."""
        if slot == 0:
            raise ValueError("slot 0 is reserved for requests without an adapter")
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is None:
            return
        r0 = 0
        for name, rows in zip(self.slice_names, self.slices):
            pair = weights.get(name)
            if pair is not None:
                a, b = pair
                rank = a.shape[0]
                if a.shape[1] != self.base_layer.input_size or b.shape[0] != rows.stop - rows.start:
                    raise ValueError(
                        f"LoRA weights for {name} have shapes A {tuple(a.shape)}, B {tuple(b.shape)}; the model's "
                        f"projection is [{rows.stop - rows.start}, {self.base_layer.input_size}]"
                    )
                self.lora_a[slot, r0 : r0 + rank].copy_(a)
                self.lora_b[slot, rows, r0 : r0 + rank].copy_(b)
            r0 += self.max_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        mapping = current_lora_mapping()
        if mapping is None or not mapping.active:
            return y
        return apply_lora(x, y, self.lora_a, self.lora_b, mapping)

    def extra_repr(self) -> str:
        return f"slots={self.lora_a.shape[0] - 1}, max_rank={self.max_rank}, slices={self.slice_names}"
