"""``CausalLM``: the part of the model contract every decoder-only language model shares
(the vocabulary head, its tying to the embedding, ``forward`` and ``compute_logits``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvloom.layers.vocab_embedding import LMHead
from kvloom.utils import join_prefix


class CausalLM(nn.Module):
    """A decoder ``self.model`` (``[N] token ids, [N] positions -> [N, hidden]``, with an
    ``embed_tokens``) under a vocabulary head ``self.lm_head``.

    A subclass builds ``self.model`` in its ``__init__``, then calls ``add_lm_head``; it
    overrides ``compute_logits`` where the model changes the logits (a soft cap, a scale).
    """

    lm_head: LMHead
    """The vocabulary head (``add_lm_head`` builds it)."""
    tie_word_embeddings: bool
    """Whether the head shares the embedding's weight (the checkpoint's ``tie_word_embeddings``)."""

    def add_lm_head(
        self, hf_config: Any, prefix: str, *, tied_by_default: bool = False, parallel: bool = False
    ) -> None:
        """Build ``self.lm_head`` (``vocab_size`` x ``hidden_size`` of ``hf_config``, named
        ``lm_head`` under ``prefix``) and tie it to ``self.model.embed_tokens`` when
        ``hf_config.tie_word_embeddings`` says so (absent: ``tied_by_default``).
        ``parallel``: split the vocabulary over tensor-parallel ranks."""
        self.lm_head = LMHead(
            hf_config.vocab_size, hf_config.hidden_size, prefix=join_prefix(prefix, "lm_head"), parallel=parallel
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", tied_by_default))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @property
    def tied_weight_names(self) -> tuple[str, ...]:
        """The checkpoint names a tied head may lack (``load_checkpoint_weights``'
        ``tied_names``): ``("lm_head.weight",)`` when tied, else none."""
        return ("lm_head.weight",) if self.tie_word_embeddings else ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[N]`` token ids and positions -> ``[N, hidden]``: the decoder's output."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[M, hidden]`` -> ``[M, vocab]`` logits, in the head's dtype."""
        return self.lm_head(hidden_states)
