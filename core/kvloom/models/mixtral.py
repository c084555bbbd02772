"""Mixtral: Mistral's decoder (``kvloom.models.llama``) with a mixture of experts in every
layer, HF's ``block_sparse_moe``: a router ``gate`` and ``num_local_experts`` experts
(checkpoint names ``w1`` gate, ``w3`` up, ``w2`` down), softmax over the router logits,
top ``num_experts_per_tok``, always renormalised.
"""

from __future__ import annotations

from torch import nn

from kvloom.config import EngineConfig
from kvloom.models.llama import LlamaForCausalLM
from kvloom.models.qwen3_moe import SparseMoeBlock, check_silu
from kvloom.utils import join_prefix


class MixtralForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = True
    """Mistral's split attention and vocabulary, and experts sharded by their intermediate
    dimension (``SparseMoeBlock``)."""

    @classmethod
    def mlp_block(cls, config: EngineConfig, layer_idx: int, prefix: str) -> tuple[str, nn.Module]:
        hf = config.model.hf_config
        check_silu(hf)
        name = "block_sparse_moe"
        block = SparseMoeBlock(
            hf.hidden_size, hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size,
            join_prefix(prefix, name), renormalize=True, expert_weight_names=("w1", "w3", "w2"),
        )  # fmt: skip
        return name, block
