"""DeepSeek-V2 (V2-Lite included) and DeepSeek-V3 (without its MTP layer).

Attention is multi-head latent attention (``kvloom.attention.mla_layer.MLAAttention``: the
latent cache, the absorbed decode and the decompressing prefill, each phase on its own
selected backend). ``q_lora_rank`` None (V2-Lite: one ``q_proj``) or set (V2, V3:
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``). RoPE covers only the
``qk_rope_head_dim`` part; DeepSeek's YaRN scaling puts ``mscale / mscale_all_dim`` into
cos/sin and ``mscale(mscale_all_dim)**2`` into the softmax scale
(``kvloom.layers.rotary.deepseek_softmax_scale``).

The first ``first_k_dense_replace`` layers have a dense gated MLP; the others a
mixture of experts (``DeepseekMoE``: shared experts plus routed experts through
``kvloom.layers.fused_moe.FusedMoE``, expert weights stacked at load time).

V3 differs only in its config (sigmoid router scores with a correction bias,
group-limited top-k, ``rope_interleave``), so ``DeepseekV3ForCausalLM`` is this class.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.attention.mla_layer import MLAAttention
from kvloom.config import EngineConfig
from kvloom.layers.activation import get_gated_activation
from kvloom.layers.fused_moe import FusedMoE
from kvloom.layers.layernorm import RMSNorm
from kvloom.layers.linear import Linear, MergedLinear
from kvloom.layers.rotary import RotaryEmbedding, deepseek_softmax_scale, get_rope_parameters
from kvloom.layers.vocab_embedding import VocabEmbedding
from kvloom.models.causal_lm import CausalLM
from kvloom.models.interface import HiddenStateTaps
from kvloom.models.llama import LlamaDecoderLayer, LlamaModel
from kvloom.models.weights import load_checkpoint_weights
from kvloom.utils import join_prefix

#: (merged module, checkpoint module, shard): gate/up of the dense MLPs and shared experts.
DEEPSEEK_STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("gate_up_proj", "gate_proj", "0"),
    ("gate_up_proj", "up_proj", "1"),
)


class DeepseekMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with gate and up merged."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, prefix=join_prefix(prefix, "gate_up_proj")
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, prefix=join_prefix(prefix, "down_proj"))
        self.act_fn = get_gated_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DeepseekRouter(nn.Module):
    """The router's weight ``[n_routed_experts, hidden]``, kept in float32 as HF keeps it
    (the logits are computed in float32 whatever the model dtype)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    """Shared experts (a dense gated MLP of ``moe_intermediate_size * n_shared_experts``)
    plus routed experts (``FusedMoE``).

    Routing as DeepSeek's configs say: V2 softmax scores, greedy or group-limited greedy
    top-k (``topk_method``); V3 sigmoid scores steered by ``e_score_correction_bias``,
    group-limited top-k over ``n_group`` groups (``noaux_tc``); weights renormalised when
    ``norm_topk_prob``, times ``routed_scaling_factor``.
    """

    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        v3 = getattr(hf, "model_type", "") == "deepseek_v3"
        topk_method = getattr(hf, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
        scoring = getattr(hf, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
        grouped = topk_method in ("group_limited_greedy", "noaux_tc") and getattr(hf, "n_group", None)
        num_experts = hf.n_routed_experts
        self.gate = DeepseekRouter(num_experts, hf.hidden_size)
        self.experts = FusedMoE(
            num_experts,
            hf.num_experts_per_tok,
            hf.hidden_size,
            hf.moe_intermediate_size,
            renormalize=bool(getattr(hf, "norm_topk_prob", False)),
            scoring_func=scoring,
            use_correction_bias=topk_method == "noaux_tc",
            num_expert_group=hf.n_group if grouped else None,
            topk_group=hf.topk_group if grouped else None,
            routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
            prefix=join_prefix(prefix, "experts"),
        )
        shared = getattr(hf, "n_shared_experts", None) or 0
        self.shared_experts = (
            DeepseekMLP(hf.hidden_size, hf.moe_intermediate_size * shared, hf.hidden_act, False,
                        join_prefix(prefix, "shared_experts"))
            if shared else None
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm decoder layer: RMSNorm, MLA, RMSNorm, dense MLP or MoE; residual adds in
    the norms as in ``kvloom.models.llama``."""

    def __init__(self, config: EngineConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        rope = get_rope_parameters(hf)
        dims = config.model.mla_dims
        prefill_backend = config.attention.prefill_backend
        if prefill_backend is None:
            raise ValueError(f"{prefix}: an MLA model needs attention.prefill_backend (selected with use_mla)")
        self.self_attn = MLAAttention(
            hidden_size=hf.hidden_size,
            dims=dims,
            q_lora_rank=getattr(hf, "q_lora_rank", None),
            scale=deepseek_softmax_scale(rope, dims.qk_head_dim),
            rms_norm_eps=hf.rms_norm_eps,
            decode_backend=config.attention.backend,
            prefill_backend=prefill_backend,
            # V2 rotates interleaved pairs; V3 when rope_interleave (its default).
            rope_interleaved=bool(getattr(hf, "rope_interleave", True)),
            prefix=join_prefix(prefix, "self_attn"),
            kv_cache_dtype=config.cache.cache_dtype,
            bias=bool(getattr(hf, "attention_bias", False)),
        )
        first_dense = getattr(hf, "first_k_dense_replace", 0) or 0
        if layer_idx >= first_dense and getattr(hf, "n_routed_experts", None):
            self.mlp: nn.Module = DeepseekMoE(config, join_prefix(prefix, "mlp"))
        else:
            self.mlp = DeepseekMLP(
                hf.hidden_size, hf.intermediate_size, hf.hidden_act, bool(getattr(hf, "mlp_bias", False)),
                join_prefix(prefix, "mlp"),
            )  # fmt: skip
        self.input_layernorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)

    #: Llama's residual stream (input norm, attention, post-attention norm, feed-forward):
    #: only the attention and the feed-forward block differ.
    mlp_name = "mlp"
    forward = LlamaDecoderLayer.forward


class DeepseekV2Model(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.embed_tokens = VocabEmbedding(hf.vocab_size, hf.hidden_size, prefix=join_prefix(prefix, "embed_tokens"))
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, join_prefix(prefix, f"layers.{i}")) for i in range(hf.num_hidden_layers)
        )
        self.norm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        # LlamaModel.forward's stage attributes: DeepSeek is never pipeline-split (every layer here).
        self.start_layer, self.end_layer, self.is_last_stage = 0, hf.num_hidden_layers, True
        self.hidden_taps: HiddenStateTaps | None = None  # what an MTP draft reads
        self.rotary_emb = RotaryEmbedding(
            head_dim=hf.qk_rope_head_dim,
            max_position=config.model.max_model_len,
            rope_parameters=get_rope_parameters(hf),
            max_position_embeddings=hf.max_position_embeddings,
        )

    #: Embedding, rotary tables once per step, the layers, the final norm: as Llama.
    forward = LlamaModel.forward


class DeepseekV2ForCausalLM(CausalLM):
    """kvloom's model contract (see ``LlamaForCausalLM``) for DeepSeek-V2/V3."""

    stacked_params = DEEPSEEK_STACKED_PARAMS
    supports_hidden_state_taps = True
    """``self.model.hidden_taps`` records chosen hidden states (the MTP draft reads the output)."""
    accepts_lazy_weights = True
    """``load_weights`` takes lazy handles (it renames and filters): the MTP tensors it
    drops are never read."""

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        hf = config.model.hf_config
        self.model = DeepseekV2Model(config, join_prefix(prefix, "model"))
        self.add_lm_head(hf, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; those of the MTP layer (``model.layers.{num_hidden_layers}``
        and up) are skipped."""
        hf: Any = self.config.model.hf_config
        n = hf.num_hidden_layers
        mtp = tuple(f"model.layers.{i}." for i in range(n, n + (getattr(hf, "num_nextn_predict_layers", 0) or 0)))
        kept = ((_kvloom_name(name), t) for name, t in weights if not (mtp and name.startswith(mtp)))
        return load_checkpoint_weights(self, kept, self.stacked_params, tied_names=self.tied_weight_names)


#: HF keeps V3's correction bias on the router; kvloom's FusedMoE owns it.
_CORRECTION_BIAS = re.compile(r"\.mlp\.gate\.e_score_correction_bias$")


def _kvloom_name(name: str) -> str:
    return _CORRECTION_BIAS.sub(".mlp.experts.e_score_correction_bias", name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (and R1): the V2 network; the differences are config values (router
    scoring, group-limited top-k, rope_interleave), read where they are used."""
