"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 (``Gemma3ForCausalLM``, and the language
model of ``Gemma3ForConditionalGeneration`` checkpoints), as HF transformers computes them.

Both are Llama's attention block (fused QKV, RoPE, paged attention) with Gemma's
differences:

* every norm is ``GemmaRMSNorm`` (``(1 + weight)``, in float32), and each decoder layer has
  four: before and after attention, before and after the MLP (the residual is added after
  the post-norms);
* embeddings are multiplied by ``sqrt(hidden_size)`` in the model dtype; the MLP is gated
  GELU (``hidden_activation``, the tanh approximation); the LM head is tied to the
  embedding unless ``tie_word_embeddings`` is false;
* the softmax scale is ``query_pre_attn_scalar ** -0.5``;
* sliding-window attention on the layers ``layer_types`` names (Gemma 2: every other one;
  Gemma 3: five of six): a hybrid KV cache (``kvloom.kv_cache.spec``);
* Gemma 2 soft-caps the attention logits (``attn_logit_softcapping``, the backend must
  declare ``supports_logits_soft_cap``) and the final logits (``final_logit_softcapping``);
* Gemma 3 normalises q and k per head (``GemmaRMSNorm``) and rotates sliding-window and
  full-attention layers with their own RoPE parameters (``rope_parameters`` per layer type:
  a local base frequency, and a global one possibly scaled).

Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``) run as text-only
models: the text config is ``hf_config.text_config``, the language model's tensors load
under either naming (``language_model.model.*`` or ``model.language_model.*``), the vision
tower and projector are not loaded, and a request with an image is refused by the server
(400) as for every kvloom model.

Why in the core, not in the Gemma plugin: both need the hybrid KV cache and the attention
features of the core's backend contract, and they are among the most deployed models; the
plugin stays the example of an out-of-tree model (Gemma 1), built on the same layers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvloom.config import EngineConfig
from kvloom.kv_cache.spec import layer_type_of
from kvloom.layers.layernorm import GemmaRMSNorm
from kvloom.layers.rotary import RotaryEmbedding, get_rope_parameters
from kvloom.layers.vocab_embedding import VocabEmbedding
from kvloom.models.causal_lm import CausalLM
from kvloom.models.llama import LlamaAttention, LlamaMLP
from kvloom.models.weights import LLAMA_STACKED_PARAMS, load_checkpoint_weights, packed_modules_mapping
from kvloom.utils import join_prefix


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); ``x`` when ``cap`` is None."""
    return x if cap is None else cap * torch.tanh(x / cap)


class GemmaDecoderLayer(nn.Module):
    """One Gemma 2/3 decoder layer: four norms around attention and the MLP."""

    def __init__(self, config: EngineConfig, layer_idx: int, prefix: str, qk_norm: bool) -> None:
        super().__init__()
        hf = config.model.text_config
        bias = bool(getattr(hf, "attention_bias", False))
        self.layer_type = layer_type_of(hf, layer_idx)
        self.self_attn = LlamaAttention(
            config, layer_idx, join_prefix(prefix, "self_attn"), qkv_bias=bias, o_bias=bias, qk_norm=qk_norm,
            scale=float(hf.query_pre_attn_scalar) ** -0.5, norm=GemmaRMSNorm,
            logits_soft_cap=getattr(hf, "attn_logit_softcapping", None),
        )  # fmt: skip
        self.mlp = LlamaMLP(config, join_prefix(prefix, "mlp"), hidden_act=hf.hidden_activation)
        eps = hf.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hf.hidden_size, eps=eps)
        self.post_attention_layernorm = GemmaRMSNorm(hf.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hf.hidden_size, eps=eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hf.hidden_size, eps=eps)

    def forward(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden_states), cos_sin)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    """Embedding (scaled), decoder layers, final norm; one RoPE table per layer type when the
    config gives each its own parameters (Gemma 3), else one."""

    def __init__(self, config: EngineConfig, prefix: str, qk_norm: bool) -> None:
        super().__init__()
        hf = config.model.text_config
        self.embed_tokens = VocabEmbedding(hf.vocab_size, hf.hidden_size, prefix=join_prefix(prefix, "embed_tokens"),
                                           parallel=True)  # fmt: skip
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, join_prefix(prefix, f"layers.{i}"), qk_norm)
            for i in range(hf.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        kinds = sorted({layer.layer_type for layer in self.layers})
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(
                head_dim=config.model.head_size,
                max_position=config.model.max_model_len,
                rope_parameters=get_rope_parameters(hf, kind),
                max_position_embeddings=hf.max_position_embeddings,
            )
            for kind in kinds
        })  # fmt: skip
        self.embed_scale = float(hf.hidden_size) ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # HF rounds the scale to the model dtype before multiplying.
        hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
        cos_sin = {kind: rotary.cos_sin(positions) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos_sin[layer.layer_type])
        return self.norm(hidden_states)


class Gemma2ForCausalLM(CausalLM):
    """kvloom's model contract over ``GemmaModel`` (see the module docstring)."""

    stacked_params = LLAMA_STACKED_PARAMS
    packed_modules_mapping = packed_modules_mapping(LLAMA_STACKED_PARAMS)
    supports_tensor_parallel = True
    """Heads, MLP columns and vocabulary are split over tensor-parallel ranks."""
    qk_norm = False
    """Whether q and k are normalised per head (Gemma 3)."""

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.text_config
        self.model = GemmaModel(config, join_prefix(prefix, "model"), self.qk_norm)
        self.add_lm_head(hf, prefix, tied_by_default=True, parallel=True)
        self.final_logit_softcapping = getattr(hf, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(hidden_states), self.final_logit_softcapping)

    def checkpoint_name(self, name: str) -> str | None:
        """The name this model gives a checkpoint tensor (None: not the language model's)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((self.checkpoint_name(name), tensor) for name, tensor in weights)
        return load_checkpoint_weights(self, ((n, t) for n, t in renamed if n is not None), self.stacked_params,
                                       tied_names=self.tied_weight_names)  # fmt: skip


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (``model_type`` ``gemma3_text``): Gemma 2 with q/k norms and
    RoPE per layer type."""

    qk_norm = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 multimodal checkpoint, text only (the vision tower
    and projector are not loaded)."""

    #: Checkpoint prefixes of the language model, newest naming first (transformers >= 5,
    #: then the Hub's original one).
    _LANGUAGE_PREFIXES: tuple[tuple[str, str], ...] = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    _VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                        "multi_modal_projector.")  # fmt: skip

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(self._VISION_PREFIXES):
            return None
        for old, new in self._LANGUAGE_PREFIXES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

