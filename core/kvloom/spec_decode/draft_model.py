"""``method: draft_model``: a smaller model of any architecture kvloom serves, sharing the
target's vocabulary (SmolLM2-135M for SmolLM2-1.7B, Llama-3.2-1B for Llama-3.1-8B), drafts
greedily. Its layers run on the target's attention backend with their own KV cache in the
target's blocks (``kvloom.worker.draft_runner``); each step feeds it the positions the
target kept, so its cache follows the accepted tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from kvloom.spec_decode.proposer import DraftModelContext, ModelProposer

if TYPE_CHECKING:
    from kvloom.config import EngineConfig, SpeculativeConfig


class IndependentDraft(nn.Module):
    """A served model as a ``DraftModel``: position p reads its own token (``shift_tokens``
    False), no hidden states in or out."""

    shift_tokens = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(input_ids, positions), None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)


class DraftModelProposer(ModelProposer):
    """Drafts with ``speculative_config.model``, an independent smaller model."""

    NAME: ClassVar[str] = "draft_model"

    @classmethod
    def extra_validation(cls, speculative: SpeculativeConfig, config: EngineConfig) -> list[str]:
        from kvloom.engine.attention_config import backend_problems
        from kvloom.models.registry import ModelRegistry

        draft = speculative.draft
        if draft is None:
            return ["model: the draft checkpoint is required"]
        reasons = []
        if not ModelRegistry.is_supported(draft.architecture):
            reasons.append(f"model: the draft's architecture {draft.architecture} is not one kvloom serves")
        if draft.vocab_size != config.model.vocab_size:
            reasons.append(f"model: the draft's vocabulary ({draft.vocab_size} tokens) differs from the target's "
                           f"({config.model.vocab_size}); a draft model must share the target's tokenizer")  # fmt: skip
        reasons += [f"the draft on attention backend {config.attention.backend.NAME}: {r}"
                    for r in backend_problems(config.model_copy(update={"model": draft}))]  # fmt: skip
        return reasons

    def build_draft_model(self, context: DraftModelContext) -> nn.Module:
        from kvloom.models.registry import ModelRegistry

        draft = self.speculative.draft
        assert draft is not None
        return IndependentDraft(context.load(ModelRegistry.load_model_cls(draft.architecture), draft))
