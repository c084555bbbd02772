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
    #: Softmax scale the wrapper was planned with (checked against each layer's scale).
    sm_scale: float
    is_decode: bool
