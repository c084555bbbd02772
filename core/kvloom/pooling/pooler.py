"""Pooling a request's hidden states into one vector (embeddings).

Prefill may arrive in chunks, so MEAN pooling keeps a running sum in the request's
runner state; LAST and CLS need only the right chunk. Prefix-cache hits would skip hidden
states, so pooling requests never read cached blocks (the scheduler enforces this).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.worker.input_batch import CachedRequestState


def pool_request(
    config: "EngineConfig", state: "CachedRequestState", chunk: torch.Tensor, prompt_done: bool,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Feed one prefill chunk's hidden states; returns the pooled vector after the last chunk
    (a classification model's ``head`` turns it into the labels' logits first)."""
    params = state.pooling_params
    pooling_type = (params.pooling_type if params and params.pooling_type else config.model.pooling_type).upper()
    normalize = params.normalize if params and params.normalize is not None else config.model.normalize
    first_chunk = state.num_computed_tokens == 0

    if pooling_type == "MEAN":
        partial = chunk.float().sum(dim=0)
        state.pooling_sum = partial if state.pooling_sum is None else state.pooling_sum + partial
        if not prompt_done:
            return None
        pooled = state.pooling_sum / state.num_prompt_tokens
    elif pooling_type == "CLS":
        if first_chunk:
            state.pooling_sum = chunk[0].float()
        if not prompt_done:
            return None
        assert state.pooling_sum is not None
        pooled = state.pooling_sum
    else:  # LAST
        if not prompt_done:
            return None
        pooled = chunk[-1].float()

    if head is not None:
        pooled = head(pooled)
    if params is not None and params.dimensions is not None:
        if params.dimensions > pooled.shape[-1]:
            raise ValueError(f"dimensions: {params.dimensions} exceeds the model's {pooled.shape[-1]}")
        pooled = pooled[: params.dimensions]
    if normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled.cpu()
