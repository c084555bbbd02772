"""Granite from kvloom's layers: Llama (fused QKV and gate/up projections, RoPE, RMSNorm,
SiLU MLP, paged attention through the selected backend) with four scalars from its config:

* ``embedding_multiplier`` scales the token embeddings;
* ``attention_multiplier`` is the softmax scale (instead of ``1/sqrt(head_dim)``);
* ``residual_multiplier`` scales each attention and MLP output before the residual add;
* ``logits_scaling`` divides the logits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvloom.interfaces.models import (
    LLAMA_STACKED_PARAMS,
    Attention,
    CausalLM,
    EngineConfig,
    Linear,
    LlamaMLP,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    get_rope_parameters,
    load_checkpoint_weights,
    packed_modules_mapping,
)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class GraniteAttention(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf, m = config.model.hf_config, config.model  # m: head size and head counts, resolved
        self.head_size = m.head_size
        bias = bool(getattr(hf, "attention_bias", False))
        self.qkv_proj = QKVLinear(hf.hidden_size, m.head_size, m.num_heads, m.num_kv_heads, bias=bias,
                                  prefix=_join(prefix, "qkv_proj"))  # fmt: skip
        self.o_proj = Linear(m.num_heads * m.head_size, hf.hidden_size, bias=bias, prefix=_join(prefix, "o_proj"))
        self.attn = Attention(
            num_heads=m.num_heads,
            head_size=m.head_size,
            scale=hf.attention_multiplier,  # Granite's twist; Llama uses head_size ** -0.5
            num_kv_heads=m.num_kv_heads,
            backend=config.attention.backend,  # the backend the engine selected
            prefix=_join(prefix, "attn"),
            kv_cache_dtype=config.cache.cache_dtype,
        )

    def forward(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = RotaryEmbedding.rotate_heads(q.view(n, -1, self.head_size), *cos_sin)
        k = RotaryEmbedding.rotate_heads(k.view(n, -1, self.head_size), *cos_sin)
        return self.o_proj(self.attn(q.view(n, -1), k.view(n, -1), v))


class GraniteDecoderLayer(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.residual_multiplier = hf.residual_multiplier
        self.self_attn = GraniteAttention(config, _join(prefix, "self_attn"))
        self.mlp = LlamaMLP(config, _join(prefix, "mlp"))  # gate_up_proj, SiLU, down_proj
        self.input_layernorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden_states), cos_sin)
        hidden_states = hidden_states + attn_out * self.residual_multiplier
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + mlp_out * self.residual_multiplier


class GraniteModel(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.embedding_multiplier = hf.embedding_multiplier
        self.embed_tokens = VocabEmbedding(hf.vocab_size, hf.hidden_size, prefix=_join(prefix, "embed_tokens"))
        self.layers = nn.ModuleList(
            GraniteDecoderLayer(config, _join(prefix, f"layers.{i}")) for i in range(hf.num_hidden_layers)
        )
        self.norm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            head_dim=config.model.head_size,
            max_position=config.model.max_model_len,
            rope_parameters=get_rope_parameters(hf),
            max_position_embeddings=hf.max_position_embeddings,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.embedding_multiplier
        cos_sin = self.rotary_emb.cos_sin(positions)  # once per step, shared by every layer
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos_sin)
        return self.norm(hidden_states)


class GraniteForCausalLM(CausalLM):
    # HF's q/k/v_proj and gate/up_proj load into the merged qkv_proj and gate_up_proj.
    stacked_params = LLAMA_STACKED_PARAMS
    packed_modules_mapping = packed_modules_mapping(LLAMA_STACKED_PARAMS)  # for LoRA

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        self.logits_scaling = hf.logits_scaling
        self.model = GraniteModel(config, _join(prefix, "model"))
        self.add_lm_head(hf, prefix)  # lm_head, tied to embed_tokens if the checkpoint says so
        # forward (from CausalLM): [N] token ids, [N] positions -> self.model -> [N, hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states) / self.logits_scaling  # [M, vocab], model dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint_weights(self, weights, self.stacked_params, tied_names=self.tied_weight_names)
