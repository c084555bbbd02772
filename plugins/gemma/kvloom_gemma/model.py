"""Gemma (v1) from kvloom layers: the Llama attention block (fused QKV, RoPE, paged
attention through kvloom's backends) with Gemma's differences:

* RMSNorm scales by ``1 + weight`` and multiplies in float32 before casting back;
* token embeddings are multiplied by ``sqrt(hidden_size)`` (in the model dtype);
* the MLP is gated GELU (tanh approximation);
* the LM head is always tied to the embedding.

Weights load by HF names; ``q/k/v_proj`` and ``gate/up_proj`` are merged as in kvloom's
Llama, so ``stacked_params`` and ``packed_modules_mapping`` (LoRA) are Llama's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.interfaces import EngineConfig
from kvloom.interfaces.models import (
    LLAMA_STACKED_PARAMS,
    CausalLM,
    Linear,
    LlamaAttention,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    get_rope_parameters,
    load_checkpoint_weights,
    packed_modules_mapping,
)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class GemmaRMSNorm(RMSNorm):
    """``(x / rms(x)) * (1 + weight)`` in float32, cast back to the input dtype."""

    fused = False  # the platform's rms_norm kernels compute Llama's formula

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        act = getattr(hf, "hidden_activation", None) or hf.hidden_act
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise NotImplementedError(f"Gemma hidden activation {act!r} is not supported (gelu_pytorch_tanh, gelu)")
        # HF's Gemma runs the tanh approximation for both names.
        self.gate_up_proj = MergedLinear(
            hf.hidden_size, [hf.intermediate_size] * 2, prefix=_join(prefix, "gate_up_proj")
        )
        self.down_proj = Linear(hf.intermediate_size, hf.hidden_size, prefix=_join(prefix, "down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: EngineConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        bias = bool(getattr(hf, "attention_bias", False))
        self.self_attn = LlamaAttention(config, layer_idx, _join(prefix, "self_attn"), qkv_bias=bias, o_bias=bias)
        self.mlp = GemmaMLP(config, _join(prefix, "mlp"))
        self.input_layernorm = GemmaRMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)

    def forward(
        self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden_states), cos_sin)
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class GemmaModel(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.embed_tokens = VocabEmbedding(hf.vocab_size, hf.hidden_size, prefix=_join(prefix, "embed_tokens"))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, _join(prefix, f"layers.{i}")) for i in range(hf.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            head_dim=config.model.head_size,
            max_position=config.model.max_model_len,
            rope_parameters=get_rope_parameters(hf),
            max_position_embeddings=hf.max_position_embeddings,
        )
        self.embed_scale = float(hf.hidden_size) ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # HF rounds the scale to the model dtype before multiplying.
        hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
        cos_sin = self.rotary_emb.cos_sin(positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos_sin)
        return self.norm(hidden_states)


class GemmaForCausalLM(CausalLM):
    """kvloom's model contract: ``forward(input_ids, positions) -> hidden``,
    ``compute_logits(hidden) -> logits`` (model dtype), ``load_weights`` by HF names."""

    stacked_params = LLAMA_STACKED_PARAMS
    packed_modules_mapping = packed_modules_mapping(LLAMA_STACKED_PARAMS)

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        self.model = GemmaModel(config, _join(prefix, "model"))
        # Gemma's checkpoints tie the head; one that sets tie_word_embeddings false carries
        # its own lm_head.weight, which must be loaded, not dropped.
        self.add_lm_head(hf, prefix, tied_by_default=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint_weights(self, weights, self.stacked_params, tied_names=self.tied_weight_names)
