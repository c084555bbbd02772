"""Qwen3-MoE: Qwen3's decoder (per-head q/k RMSNorm) whose feed-forward blocks are mixtures
of experts, except in the layers ``mlp_only_layers`` names and those that
``decoder_sparse_step`` skips (a layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step
== 0``), which keep a dense MLP of ``intermediate_size``.

A sparse block (``SparseMoeBlock``, HF's ``mlp``) is a router ``gate`` (a bias-free linear
layer in the model dtype, ``[num_experts, hidden]``) and the experts (``FusedMoE``, each
an MLP of ``moe_intermediate_size``): softmax over the router logits, top
``num_experts_per_tok``, renormalised when ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvloom.config import EngineConfig
from kvloom.layers.fused_moe import FusedMoE
from kvloom.layers.linear import Linear
from kvloom.models.llama import llama_mlp
from kvloom.models.qwen3 import Qwen3ForCausalLM
from kvloom.utils import join_prefix


def check_silu(hf_config: Any) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r} is not supported for experts (supported: silu)")


class SparseMoeBlock(nn.Module):
    """A router and its experts, HF's Mixtral / Qwen3-MoE sparse block:
    ``experts(x, gate(x))`` with the router ``gate`` a bias-free ``Linear`` (its logits in
    the model dtype; ``select_experts`` scores them in float32). ``fused_moe_kwargs`` go to
    ``FusedMoE`` (routing flags, ``expert_weight_names``).

    Tensor parallelism: the router is replicated (every rank routes every token alike) and
    the experts are sharded by their intermediate dimension (``FusedMoE(parallel=True)``),
    which all-reduces the block's output once."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        prefix: str,
        **fused_moe_kwargs: Any,
    ) -> None:
        super().__init__()
        # Routers stay in the model dtype in quantized checkpoints (fp8, compressed-tensors).
        self.gate = Linear(hidden_size, num_experts, bias=False, prefix=join_prefix(prefix, "gate"), quantizable=False)
        self.experts = FusedMoE(
            num_experts, top_k, hidden_size, intermediate_size, prefix=join_prefix(prefix, "experts"), parallel=True,
            **fused_moe_kwargs,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of a Qwen3-MoE config has experts (HF's rule)."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, got {step}")
    return (
        layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and hf_config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    supports_tensor_parallel = True
    """Qwen3's split attention, dense MLPs and vocabulary, and experts sharded by their
    intermediate dimension (Qwen3-MoE has no shared experts)."""

    @classmethod
    def mlp_block(cls, config: EngineConfig, layer_idx: int, prefix: str) -> tuple[str, nn.Module]:
        hf = config.model.hf_config
        if not is_sparse_layer(hf, layer_idx):
            return llama_mlp(config, layer_idx, prefix)
        check_silu(hf)
        block = SparseMoeBlock(
            hf.hidden_size, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
            join_prefix(prefix, "mlp"), renormalize=bool(getattr(hf, "norm_topk_prob", False)),
        )  # fmt: skip
        return "mlp", block
