"""Token embedding and LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """``input_ids [N] -> [N, embedding_dim]``; weight ``[num_embeddings, embedding_dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "") -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Copy a checkpoint tensor into ``param`` (shapes must match; ``shard`` is unused)."""
        if tuple(param.shape) != tuple(loaded.shape):
            raise ValueError(
                f"{self.prefix}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits.

    ``tie_to(embedding)`` makes this head use the embedding's weight (the same
    Parameter, so it is loaded once and moved once).
    """

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Use ``embedding``'s weight (the same Parameter) as this head's."""
        if (embedding.num_embeddings, embedding.embedding_dim) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"{self.prefix}: cannot tie to an embedding of another shape")
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``[M, embedding_dim] -> float32 [M, num_embeddings]``.

        The GEMM runs in the model dtype (as HF's ``lm_head``), then upcasts.
        """
        return F.linear(hidden_states, self.weight).float()
