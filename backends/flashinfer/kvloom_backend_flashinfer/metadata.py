"""Per-step metadata of the FLASHINFER backend (built by the builder, read by the impl)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FlashInferMetadata:
    """What ``FlashInferImpl.forward`` needs for one step (shared by all layers)."""

    #: The FlashInfer wrapper planned for this step; ``forward`` calls ``wrapper.run``.
    wrapper: Any
    #: Query rows the wrapper was planned for: ``num_reqs`` for a decode step (CUDA-graph
    #: padding included), ``query_start_loc[num_reqs]`` otherwise.
    num_query_rows: int
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    #: ``(scale, sliding_window, logits_soft_cap)`` the wrapper was planned with: a step
    #: plans once for a KV-cache group, whose layers must all have these.
    layer_features: tuple[float, int | None, float | None]
    is_decode: bool
