"""Decoder-only models with a classification head (HF's ``*ForSequenceClassification``):
the decoder stack, then ``score``, a bias-free linear layer from the hidden size to
``num_labels``, on the last token's hidden state. They run with the pooling runner: the
pooled vector is the head's logits (``classify``), one per label. A one-label model is a
cross-encoder (reranker): ``/v1/score``, ``/rerank`` and ``LLM.score`` take the sigmoid of
its logit as the pair's relevance, as sentence-transformers' ``CrossEncoder`` does."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvloom.config import EngineConfig
from kvloom.models.embedding import LlamaEmbeddingModel
from kvloom.models.qwen2 import Qwen2ForCausalLM
from kvloom.models.qwen3 import Qwen3ForCausalLM


class LlamaForSequenceClassification(LlamaEmbeddingModel):
    """``forward(input_ids, positions) -> hidden [N, H]``; ``classify(pooled) -> logits``."""

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__(config, prefix)
        hf = config.model.hf_config
        self.num_labels = int(getattr(hf, "num_labels", 1))
        self.score = nn.Linear(hf.hidden_size, self.num_labels, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The labels' logits (float32) of pooled hidden states ``[..., H]``."""
        weight = self.score.weight
        return self.score(pooled.to(device=weight.device, dtype=weight.dtype)).float()

    @staticmethod
    def _decoder_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith("score."):
                yield name, tensor
            else:
                yield from LlamaEmbeddingModel._decoder_weights([(name, tensor)])


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    causal_lm_cls = Qwen2ForCausalLM


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    causal_lm_cls = Qwen3ForCausalLM
