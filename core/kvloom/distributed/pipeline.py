"""Pipeline parallelism's model side: which layers a stage holds, the placeholder of the
others, and the tensors that travel from stage to stage.

A model that supports pipeline parallelism (``kvloom.models.interface.SupportsPP``)
builds, on stage ``p`` of ``P``, only the decoder layers ``stage_layer_range(L, p, P)``
(``PPMissingLayer`` stands in for the others, so layer indices and checkpoint names stay
those of the whole model), the token embedding only on the first stage and the final norm
and LM head only on the last. Its ``forward`` takes the previous stage's
``IntermediateTensors`` (None on the first stage) and returns them on every stage but the
last, which returns the final hidden states. The model runner moves them between stages
(``parallel_state.send_to_next_stage`` / ``recv_from_previous_stage``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class IntermediateTensors:
    """What one stage hands the next: the residual stream after its last layer, as the
    pair the Llama decoder layers pass along (``hidden_states`` is the last layer's
    feed-forward output, ``residual`` the stream it will be added to)."""

    hidden_states: torch.Tensor
    residual: torch.Tensor

    def pack(self) -> torch.Tensor:
        """Both as one ``[2, N, H]`` tensor: one message per step instead of two."""
        return torch.stack((self.hidden_states, self.residual))

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> IntermediateTensors:
        return cls(packed[0], packed[1])


def stage_layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` of pipeline stage ``stage`` of ``num_stages``:
    an even split, the first ``num_layers % num_stages`` stages one layer more (the last
    stage also runs the LM head and the sampler, so it gets the fewer layers)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pipeline_parallel_size: {num_stages} stages for {num_layers} layers "
                         f"(allowed: 1..{num_layers})")  # fmt: skip
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage: {stage} is outside 0..{num_stages - 1}")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


class PPMissingLayer(nn.Module):
    """Stands for a layer (or the embedding, norm, LM head) another pipeline stage holds:
    no parameters, and calling it is a bug."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("PPMissingLayer: this module lives on another pipeline stage")
