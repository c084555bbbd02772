"""Llama (SmolLM2, TinyLlama, Llama 2/3/3.1 incl. rope scaling) and Mistral.

The decoder is built from kvloom layers so that it matches HF transformers' arithmetic:
fused ``qkv_proj`` and ``gate_up_proj`` GEMMs, RoPE from a precomputed cos/sin table,
paged attention through the selected backend, RMSNorm in float32.

Mistral is the same network (``MistralForCausalLM`` maps here): its ``head_dim`` may
differ from ``hidden_size / num_attention_heads`` (handled) and it may declare a
``sliding_window``. Each layer's attention gets the window its config gives it
(``kvloom.kv_cache.spec.sliding_window_of``: every layer for Mistral, the layers
``layer_types`` names for Qwen2/3), at any ``max_model_len``: the backend masks to the
window and the KV cache keeps only the window's blocks for those layers.

Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm) subclass these classes and only
change the flags in ``LlamaAttention``; the mixture-of-experts models (Qwen3-MoE, Mixtral)
change the feed-forward block through ``mlp_block``.

Pipeline parallelism (``supports_pipeline_parallel``): on stage ``p`` of ``P`` the model
builds only its decoder layers (``kvloom.distributed.pipeline.stage_layer_range``), the
embedding on the first stage and the final norm and LM head on the last, and loads only
their checkpoint tensors (``checkpoint_tensor_elsewhere``); ``forward`` takes and returns
``IntermediateTensors`` between stages.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kvloom.attention.layer import Attention
from kvloom.config import EngineConfig
from kvloom.distributed import parallel_state
from kvloom.distributed.pipeline import IntermediateTensors, PPMissingLayer, stage_layer_range
from kvloom.kv_cache.spec import sliding_window_of
from kvloom.layers.activation import get_gated_activation
from kvloom.layers.custom_ops import get_custom_op
from kvloom.layers.layernorm import RMSNorm
from kvloom.layers.linear import Linear, MergedLinear, QKVLinear
from kvloom.layers.rotary import RotaryEmbedding, get_rope_parameters
from kvloom.layers.vocab_embedding import LMHead, VocabEmbedding
from kvloom.loader.lazy_tensor import materialize
from kvloom.models.interface import HiddenStateTaps
from kvloom.models.weights import LLAMA_STACKED_PARAMS, load_checkpoint_weights, packed_modules_mapping
from kvloom.utils import join_prefix


class LlamaAttention(nn.Module):
    """Self-attention: fused QKV projection, optional per-head q/k RMSNorm (Qwen3),
    RoPE, paged attention, output projection.

    What other models change (keywords): ``scale`` (default ``head_dim ** -0.5``; Gemma's
    ``query_pre_attn_scalar ** -0.5``), ``norm`` (the q/k norm class; Gemma 3's
    ``GemmaRMSNorm``), ``logits_soft_cap`` (Gemma 2) and ``sinks`` (gpt-oss: a float32
    ``sinks`` parameter of one learned logit per query head, HF's ``self_attn.sinks``). The
    layer's sliding window is its config's (``kvloom.kv_cache.spec.sliding_window_of``)."""

    def __init__(
        self,
        config: EngineConfig,
        layer_idx: int,
        prefix: str,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
        *,
        scale: float | None = None,
        norm: type[RMSNorm] = RMSNorm,
        logits_soft_cap: float | None = None,
        sinks: bool = False,
        input_size: int | None = None,
    ) -> None:
        super().__init__()
        hf = config.model.text_config
        self.head_dim = config.model.head_size
        # Tensor parallelism: column-parallel QKV (this rank's heads), row-parallel o_proj.
        # ``input_size``: the QKV projection's input when it is not hidden_size (EAGLE-3's 2 x).
        self.qkv_proj = QKVLinear(
            input_size or hf.hidden_size, self.head_dim, config.model.num_heads, config.model.num_kv_heads, bias=qkv_bias,
            prefix=join_prefix(prefix, "qkv_proj"), parallel=True,
        )
        # This rank's head counts (the whole model's at tensor-parallel size 1).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = Linear(
            config.model.num_heads * self.head_dim, hf.hidden_size, bias=o_bias, prefix=join_prefix(prefix, "o_proj"),
            parallel="row",
        )
        if qk_norm:
            self.q_norm: RMSNorm | None = norm(self.head_dim, eps=hf.rms_norm_eps)
            self.k_norm: RMSNorm | None = norm(self.head_dim, eps=hf.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        if sinks:
            self.sinks: nn.Parameter | None = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        else:
            self.register_parameter("sinks", None)
        self.attn = Attention(
            num_heads=self.num_heads,
            head_size=self.head_dim,
            scale=self.head_dim**-0.5 if scale is None else scale,
            num_kv_heads=self.num_kv_heads,
            backend=config.attention.backend,
            prefix=join_prefix(prefix, "attn"),
            kv_cache_dtype=config.cache.cache_dtype,
            sliding_window=sliding_window_of(hf, layer_idx, config.model.max_model_len),
            logits_soft_cap=logits_soft_cap,
            sinks=self.sinks,
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Load ``sinks`` (the only parameter this module owns itself): this rank's heads."""
        if param is not self.sinks:
            raise ValueError(f"{type(self).__name__}.weight_loader loads only sinks")
        # This rank's query heads are the qkv projection's first shard's rows.
        start = self.qkv_proj.shard_starts[0] // self.head_dim
        if loaded.dim() != 1 or loaded.shape[0] < start + self.num_heads:
            raise ValueError(f"sinks: checkpoint tensor has shape {tuple(loaded.shape)}, expected one logit per "
                             "attention head")  # fmt: skip
        param.data.copy_(materialize(loaded).narrow(0, start, self.num_heads).to(param.dtype))

    def forward(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        # Query and key heads are adjacent in the fused output: rotate them in one pass.
        heads = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size : self.q_size + 2 * self.kv_size]
        if self.q_norm is None or self.k_norm is None:
            qk = RotaryEmbedding.rotate_heads(heads, *cos_sin)
        elif self.q_norm.fused and self.k_norm.fused and (op := get_custom_op("qk_norm_rotary")) is not None:
            # Norms and rotation in one kernel (qk_norm_rotary_torch is the code below; a
            # norm subclass with its own formula, fused = False, keeps that code).
            qk = op(heads, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.q_norm.eps, *cos_sin)
        else:
            q, k = self.q_norm(heads[:, : self.num_heads]), self.k_norm(heads[:, self.num_heads :])
            qk = RotaryEmbedding.rotate_heads(torch.cat((q, k), dim=1), *cos_sin)
        # q and k are strided views of qk, v of qkv: backends must honour strides.
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """The gated MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``, with gate and up in one
    ``MergedLinear`` (``gate_up_proj``) and the activation from ``hidden_act`` (the config's
    by default: SiLU; Gemma passes its ``hidden_activation``)."""

    def __init__(self, config: EngineConfig, prefix: str, hidden_act: str | None = None) -> None:
        super().__init__()
        hf = config.model.text_config
        bias = bool(getattr(hf, "mlp_bias", False))
        # Tensor parallelism: column-parallel gate/up, row-parallel down_proj.
        self.gate_up_proj = MergedLinear(
            hf.hidden_size, [hf.intermediate_size] * 2, bias=bias, prefix=join_prefix(prefix, "gate_up_proj"),
            parallel="column",
        )
        self.down_proj = Linear(
            hf.intermediate_size, hf.hidden_size, bias=bias, prefix=join_prefix(prefix, "down_proj"), parallel="row"
        )
        self.act_fn = get_gated_activation(hidden_act or hf.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


#: Builds the feed-forward block of one decoder layer: ``(config, layer_idx, layer_prefix)
#: -> (attribute name, module)``. The name is the block's checkpoint module name (``mlp``;
#: Mixtral's ``block_sparse_moe``), so checkpoint tensors load under their own names.
MLPFactory = Callable[[EngineConfig, int, str], tuple[str, nn.Module]]


def llama_mlp(config: EngineConfig, layer_idx: int, prefix: str) -> tuple[str, nn.Module]:
    """The dense ``LlamaMLP`` of every layer, named ``mlp``."""
    return "mlp", LlamaMLP(config, join_prefix(prefix, "mlp"))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer: ``input_layernorm``, ``LlamaAttention``,
    ``post_attention_layernorm``, the feed-forward block; the residual adds happen inside
    the norms (``RMSNorm(x, residual)``), where HF adds them. ``attention_kwargs`` are
    ``LlamaAttention``'s ``qkv_bias``, ``o_bias`` and ``qk_norm``; ``mlp_factory`` builds
    the feed-forward block (``llama_mlp``: the dense ``LlamaMLP``; MoE models: a
    router and ``FusedMoE`` experts), any module mapping ``[N, H] -> [N, H]``."""

    def __init__(
        self,
        config: EngineConfig,
        layer_idx: int,
        prefix: str,
        attention_kwargs: dict[str, bool],
        mlp_factory: MLPFactory = llama_mlp,
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.self_attn = LlamaAttention(config, layer_idx, join_prefix(prefix, "self_attn"), **attention_kwargs)
        self.mlp_name, mlp = mlp_factory(config, layer_idx, prefix)
        self.add_module(self.mlp_name, mlp)
        self.input_layernorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp_output, residual)``; the caller adds them (in the next layer's
        input norm or the final norm), exactly where HF adds them."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos_sin)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return getattr(self, self.mlp_name)(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; on a pipeline stage only its part of them
    (the others are ``PPMissingLayer``)."""

    def __init__(
        self,
        config: EngineConfig,
        prefix: str,
        attention_kwargs: dict[str, bool],
        mlp_factory: MLPFactory = llama_mlp,
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        stage, num_stages = parallel_state.pp_rank(), parallel_state.pp_world_size()
        self.start_layer, self.end_layer = stage_layer_range(hf.num_hidden_layers, stage, num_stages)
        self.is_first_stage, self.is_last_stage = stage == 0, stage == num_stages - 1
        self.embed_tokens: nn.Module = (
            VocabEmbedding(hf.vocab_size, hf.hidden_size, prefix=join_prefix(prefix, "embed_tokens"), parallel=True)
            if self.is_first_stage else PPMissingLayer()
        )  # fmt: skip
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, join_prefix(prefix, f"layers.{i}"), attention_kwargs, mlp_factory)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(hf.num_hidden_layers)
        )  # fmt: skip
        self.norm: nn.Module = (
            RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps) if self.is_last_stage else PPMissingLayer()
        )
        self.rotary_emb = RotaryEmbedding(
            head_dim=config.model.head_size,
            max_position=config.model.max_model_len,
            rope_parameters=get_rope_parameters(hf),
            max_position_embeddings=hf.max_position_embeddings,
        )
        #: Hidden states a speculative draft model reads (``kvloom.models.interface.HiddenStateTaps``).
        self.hidden_taps: HiddenStateTaps | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        """The final hidden states on the last stage, the stream for the next stage on the
        others; ``intermediate_tensors``: the previous stage's (None on the first)."""
        if intermediate_tensors is None:
            hidden_states = self.embed_tokens(input_ids)
            residual: torch.Tensor | None = None
        else:
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        cos_sin = self.rotary_emb.cos_sin(positions)
        taps = self.hidden_taps
        for index, layer in enumerate(self.layers[self.start_layer : self.end_layer], self.start_layer):
            if taps is not None:
                taps.record(index, hidden_states, residual)
            hidden_states, residual = layer(hidden_states, residual, cos_sin)
        if not self.is_last_stage:
            assert residual is not None  # a stage holds at least one layer
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        if taps is not None:
            taps.record(len(self.layers), hidden_states, None)
        return hidden_states


#: A checkpoint name of one decoder layer; group 1 is its index.
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    """kvloom's model contract: ``forward(input_ids [N], positions [N]) -> hidden [N, H]``,
    ``compute_logits(hidden [M, H]) -> [M, vocab]`` (model dtype), ``load_weights`` by HF names."""

    stacked_params = LLAMA_STACKED_PARAMS
    """(merged parameter, HF name, shard) for the fused q/k/v and gate/up projections."""
    supports_tensor_parallel = True
    """Heads, MLP columns and vocabulary are split over tensor-parallel ranks (subclasses
    inherit it: the MoE subclasses' experts are split too, ``FusedMoE(parallel=True)``)."""
    packed_modules_mapping = packed_modules_mapping(LLAMA_STACKED_PARAMS)
    """Merged module -> its HF modules, for LoRA (``{"qkv_proj": ["q_proj", ...], ...}``)."""
    supports_pipeline_parallel = True
    """Decoder layers are split over pipeline stages (embedding on the first, norm and LM
    head on the last); every subclass (Qwen2/3, Mistral, Qwen3-MoE, Mixtral) inherits it."""
    accepts_lazy_weights = True
    """``load_weights`` takes lazy safetensors handles (it only renames and filters them):
    each tensor-parallel rank's layers read their own slices (``kvloom.loader.lazy_tensor``)."""
    supports_hidden_state_taps = True
    """``self.model.hidden_taps`` records chosen hidden states (EAGLE-3 drafts read them)."""

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        hf = config.model.hf_config
        self.model = LlamaModel(config, join_prefix(prefix, "model"), self.attention_kwargs(hf), self.mlp_block)
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        self.lm_head: nn.Module = PPMissingLayer()
        if self.model.is_last_stage:
            self.lm_head = LMHead(hf.vocab_size, hf.hidden_size, prefix=join_prefix(prefix, "lm_head"), parallel=True)
            # A last stage without the embedding loads the tied weight into its own head.
            if self.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def attention_kwargs(cls, hf_config: Any) -> dict[str, bool]:
        """Bias and norm flags of the attention block (what Qwen2/Qwen3 change)."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    @classmethod
    def mlp_block(cls, config: EngineConfig, layer_idx: int, prefix: str) -> tuple[str, nn.Module]:
        """The feed-forward block of layer ``layer_idx`` and its attribute name (an
        ``MLPFactory``; what the MoE models change): the dense ``LlamaMLP``."""
        return llama_mlp(config, layer_idx, prefix)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[M, vocab]`` (model dtype) of the hidden states the sampler needs."""
        return self.lm_head(hidden_states)

    def checkpoint_tensor_elsewhere(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another pipeline stage only (the
        loader then never reads it): another stage's layers, the embedding off the first
        stage (unless this last stage's head is tied to it), norm and head off the last."""
        model = self.model
        if (match := _LAYER_NAME.match(name)) is not None:
            return not model.start_layer <= int(match.group(1)) < model.end_layer
        if name.startswith("model.embed_tokens."):
            return not (model.is_first_stage or (model.is_last_stage and self.tie_word_embeddings))
        if name.startswith(("model.norm.", "lm_head.")):
            return not model.is_last_stage
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors (merging q/k/v and gate/up); the names loaded.
        Tensors of other pipeline stages are skipped."""
        model = self.model
        tied = ("lm_head.weight",) if self.tie_word_embeddings and model.is_first_stage else ()
        # A tied head on a last stage without the embedding: the embedding is its weight.
        own_head = self.tie_word_embeddings and model.is_last_stage and not model.is_first_stage
        kept = (
            ("lm_head.weight" if own_head and name == "model.embed_tokens.weight" else name, tensor)
            for name, tensor in weights
            if not self.checkpoint_tensor_elsewhere(name)
        )
        return load_checkpoint_weights(self, kept, self.stacked_params, tied_names=tied)
