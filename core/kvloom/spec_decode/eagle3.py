"""``method: eagle3`` (and vLLM's ``eagle`` for an EAGLE-3 head): an EAGLE-3 draft head
(Li et al., 2025) on a Llama-family target.

The head reads the target's hidden states from three layers (HF's ``output_hidden_states``
indices, by default ``(2, L // 2, L - 3)`` as vLLM uses, or the checkpoint's
``eagle_aux_hidden_state_layer_ids``), projects their concatenation with ``fc``, and runs
one decoder layer whose attention reads ``[input_layernorm(embed(token)),
hidden_norm(hidden)]`` (2 x hidden wide); ``norm`` then ``lm_head`` give logits over its
draft vocabulary, mapped to the target's by ``d2t`` (``target id = draft id +
d2t[draft id]``). Position p pairs the target's hidden states at p with the token at p + 1;
each further draft feeds the layer's pre-norm output back instead of the target's.

Checkpoints in HF's layout (EAGLE's and SpecForge's): ``config.json`` of ``model_type``
``llama`` with ``architectures`` naming EAGLE-3 (``LlamaForCausalLMEagle3``) or a
``draft_vocab_size``; tensors ``fc``, ``midlayer.*`` (or ``layers.0.*``), ``norm``,
``lm_head``, ``d2t`` (``t2d`` unused) and, optionally, ``embed_tokens`` (else the
target's is shared). EAGLE-1 heads (``fc`` over 2 x hidden) are not supported yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvloom.layers.layernorm import RMSNorm
from kvloom.layers.linear import Linear
from kvloom.layers.rotary import RotaryEmbedding, get_rope_parameters
from kvloom.layers.vocab_embedding import LMHead, VocabEmbedding
from kvloom.loader.lazy_tensor import materialize
from kvloom.models.llama import LlamaAttention, LlamaMLP
from kvloom.models.weights import LLAMA_STACKED_PARAMS, load_checkpoint_weights
from kvloom.spec_decode.proposer import DraftModelContext, ModelProposer

if TYPE_CHECKING:
    from kvloom.config import EngineConfig, SpeculativeConfig


def is_eagle3_config(hf_config: Any) -> bool:
    """Whether a draft checkpoint's config is an EAGLE-3 head's."""
    architectures = [a.lower() for a in (getattr(hf_config, "architectures", None) or [])]
    return any("eagle3" in a for a in architectures) or getattr(hf_config, "draft_vocab_size", None) is not None


def eagle3_layer_ids(draft_hf_config: Any, target_num_layers: int) -> tuple[int, ...]:
    """The target hidden states the head reads (HF ``output_hidden_states`` indices)."""
    ids = getattr(draft_hf_config, "eagle_aux_hidden_state_layer_ids", None)
    eagle_config = getattr(draft_hf_config, "eagle_config", None)
    if ids is None and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, target_num_layers // 2, target_num_layers - 3)
    return tuple(int(i) for i in ids)


class Eagle3DecoderLayer(nn.Module):
    """The head's one decoder layer: attention over [embedding; hidden] (2 x hidden wide)."""

    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.hidden_norm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.input_layernorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.self_attn = LlamaAttention(config, 0, f"{prefix}.self_attn", qkv_bias=False, o_bias=False,
                                        input_size=2 * hf.hidden_size)  # fmt: skip
        self.mlp = LlamaMLP(config, f"{prefix}.mlp")

    def forward(self, embeds: torch.Tensor, hidden_states: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        residual = hidden_states
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos_sin), residual)
        return self.mlp(x), residual


class Eagle3LlamaDraft(nn.Module):
    """An EAGLE-3 head as a ``kvloom.interfaces.DraftModel`` (see the module docstring)."""

    shift_tokens = True
    stacked_params = LLAMA_STACKED_PARAMS
    accepts_lazy_weights = True

    def __init__(self, config: EngineConfig, target_model: nn.Module | None = None, num_taps: int = 3) -> None:
        super().__init__()
        hf = config.model.hf_config
        self._target = (target_model,)  # a tuple: not a submodule (its weights are not the head's)
        target_hidden = getattr(hf, "target_hidden_size", None) or hf.hidden_size
        self.hidden_size = hf.hidden_size
        self.vocab_size = hf.vocab_size
        self.draft_vocab_size = getattr(hf, "draft_vocab_size", None) or hf.vocab_size
        self.embed_tokens: nn.Module | None = VocabEmbedding(hf.vocab_size, hf.hidden_size, "embed_tokens", parallel=True)
        self.fc = Linear(num_taps * target_hidden, hf.hidden_size, bias=False, prefix="fc")
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config, "layers.0")])
        self.norm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.lm_head = LMHead(self.draft_vocab_size, hf.hidden_size, prefix="lm_head", parallel=True)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)
        self.rotary_emb = RotaryEmbedding(
            head_dim=config.model.head_size, max_position=config.model.max_model_len,
            rope_parameters=get_rope_parameters(hf), max_position_embeddings=hf.max_position_embeddings,
        )  # fmt: skip

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self._target[0].model.embed_tokens(input_ids)  # type: ignore[union-attr]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert hidden_states is not None
        if hidden_states.shape[-1] != self.hidden_size:  # the target's taps: project them
            hidden_states = self.fc(hidden_states)
        x, residual = self.layers[0](self.embed(input_ids), hidden_states, self.rotary_emb.cos_sin(positions))
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.draft_vocab_size == self.vocab_size:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, torch.arange(self.draft_vocab_size, device=logits.device) + self.d2t] = logits
        return full

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load an EAGLE-3 head's tensors (``midlayer.`` read as ``layers.0.``); without
        ``embed_tokens`` in the checkpoint the target's embedding is shared."""
        kept = []
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "d2t":
                self.d2t.copy_(materialize(tensor).to(torch.long))
            elif name != "t2d":
                kept.append((name, tensor))
        if all(name != "embed_tokens.weight" for name, _ in kept):
            if self._target[0] is None:
                raise ValueError("the EAGLE-3 checkpoint has no embed_tokens and no target model shares one")
            self.embed_tokens = None  # the target's is shared
        return load_checkpoint_weights(self, kept, self.stacked_params)


class Eagle3Proposer(ModelProposer):
    """EAGLE-3 heads (``speculative_config.model``: the head's directory)."""

    NAME: ClassVar[str] = "eagle3"
    methods: ClassVar[tuple[str, ...]] = ("eagle",)

    @classmethod
    def extra_validation(cls, speculative: SpeculativeConfig, config: EngineConfig) -> list[str]:
        from kvloom.models.interface import supports_hidden_state_taps
        from kvloom.models.registry import ModelRegistry

        draft = speculative.draft
        if draft is None:
            return ["model: the EAGLE-3 head's checkpoint is required"]
        if not is_eagle3_config(draft.hf_config):
            return [f"model: {draft.model} is not an EAGLE-3 head (its config names neither an EAGLE-3 architecture "
                    "nor a draft_vocab_size); EAGLE-1 heads are not supported by kvloom yet"]  # fmt: skip
        reasons = []
        target_cls = ModelRegistry.load_model_cls(config.model.architecture)
        if not supports_hidden_state_taps(target_cls):
            reasons.append(f"the target {config.model.architecture} does not expose its hidden states "
                           "(supports_hidden_state_taps), which an EAGLE-3 head reads")  # fmt: skip
        num_layers = config.model.num_layers
        ids = eagle3_layer_ids(draft.hf_config, num_layers)
        if any(not 0 <= i <= num_layers for i in ids):
            reasons.append(f"model: the head reads the target's hidden states {list(ids)}, outside 0..{num_layers}")
        if draft.vocab_size != config.model.vocab_size:
            reasons.append(f"model: the head's vocab_size ({draft.vocab_size}) differs from the target's "
                           f"({config.model.vocab_size})")  # fmt: skip
        return reasons

    def target_hidden_layers(self) -> tuple[int, ...]:
        assert self.speculative.draft is not None
        return eagle3_layer_ids(self.speculative.draft.hf_config, self.config.model.num_layers)

    def build_draft_model(self, context: DraftModelContext) -> nn.Module:
        draft = self.speculative.draft
        assert draft is not None
        return context.load(Eagle3LlamaDraft, draft, target_model=context.target_model,
                            num_taps=len(self.target_hidden_layers()))  # fmt: skip
