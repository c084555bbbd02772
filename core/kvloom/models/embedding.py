"""Decoder-only models as embedding models: the decoder without its LM head.

The pooling runner pools the final hidden states (after the last norm), so an embedding
model is the decoder stack alone. These classes serve

* checkpoints saved from HF's base classes (``LlamaModel``, ``Qwen2Model``,
  ``Qwen3Model``: weights named ``layers.0...`` without the ``model.`` prefix), and
* causal-LM checkpoints run with ``runner="pooling"`` (``model.layers.0...`` plus an
  ``lm_head.weight`` that is not needed and not loaded).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvloom.config import EngineConfig
from kvloom.models.llama import LlamaForCausalLM, LlamaModel
from kvloom.models.qwen2 import Qwen2ForCausalLM
from kvloom.models.qwen3 import Qwen3ForCausalLM
from kvloom.models.weights import LLAMA_STACKED_PARAMS, load_checkpoint_weights, packed_modules_mapping
from kvloom.utils import join_prefix


class LlamaEmbeddingModel(nn.Module):
    """``forward(input_ids, positions) -> hidden [N, H]``; no ``compute_logits``."""

    #: The causal-LM class whose attention flags (biases, q/k norm) and feed-forward
    #: blocks this model shares.
    causal_lm_cls: type[LlamaForCausalLM] = LlamaForCausalLM
    stacked_params = LLAMA_STACKED_PARAMS
    packed_modules_mapping = packed_modules_mapping(LLAMA_STACKED_PARAMS)
    accepts_lazy_weights = True
    """``load_weights`` takes lazy handles (it renames and filters): the LM head it drops
    is never read."""

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        hf = config.model.hf_config
        attention_kwargs = self.causal_lm_cls.attention_kwargs(hf)
        self.model = LlamaModel(
            config, join_prefix(prefix, "model"), attention_kwargs, self.causal_lm_cls.mlp_block
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @staticmethod
    def _decoder_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith("lm_head."):
                continue  # a causal-LM checkpoint: the head is not used for pooling
            yield (name if name.startswith("model.") else f"model.{name}"), tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint_weights(self, self._decoder_weights(weights), self.stacked_params)


class Qwen2EmbeddingModel(LlamaEmbeddingModel):
    causal_lm_cls = Qwen2ForCausalLM


class Qwen3EmbeddingModel(LlamaEmbeddingModel):
    causal_lm_cls = Qwen3ForCausalLM
