"""``method: mtp`` (vLLM's older ``deepseek_mtp``): DeepSeek-V3's multi-token-prediction
layer, shipped in the target's own checkpoint as ``model.layers.{num_hidden_layers}``
(``num_nextn_predict_layers`` of them; the target's loader skips them).

The layer (DeepSeek-V3 report, section 2.2) combines, at position p, the target's final
hidden state at p with the embedding of the token at p + 1: ``eh_proj([enorm(embed),
hnorm(hidden)])``, then one DeepSeek decoder layer (MLA and MoE, with its own KV cache in
the target's blocks) and ``shared_head``: a norm, then the target's LM head. The
embedding and the head are the target's (the checkpoint's copies are not loaded). Each
further draft feeds the layer's output back as the hidden state; with
``num_speculative_tokens`` above the checkpoint's layers, the first layer is reused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvloom.layers.layernorm import RMSNorm
from kvloom.layers.linear import Linear
from kvloom.layers.rotary import RotaryEmbedding, get_rope_parameters
from kvloom.models.deepseek_v2 import DEEPSEEK_STACKED_PARAMS, DeepseekV2DecoderLayer, _kvloom_name
from kvloom.models.weights import load_checkpoint_weights
from kvloom.spec_decode.proposer import DraftModelContext, ModelProposer

if TYPE_CHECKING:
    from kvloom.config import EngineConfig, SpeculativeConfig

#: Target architectures whose checkpoints carry MTP layers kvloom runs.
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")


class SharedHead(nn.Module):
    """The MTP layer's ``shared_head``: its own norm (the head itself is the target's)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=eps)


class DeepseekMTPDraft(nn.Module):
    """The first MTP layer of a DeepSeek-V3 checkpoint as a ``kvloom.interfaces.DraftModel``."""

    shift_tokens = True
    stacked_params = DEEPSEEK_STACKED_PARAMS
    accepts_lazy_weights = True

    def __init__(self, config: EngineConfig, target_model: nn.Module | None = None) -> None:
        super().__init__()
        hf = config.model.hf_config
        self._target = (target_model,)  # its embedding and LM head (not submodules: not this model's weights)
        self.prefix = f"model.layers.{hf.num_hidden_layers}."
        self.enorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.hnorm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
        self.eh_proj = Linear(2 * hf.hidden_size, hf.hidden_size, bias=False, prefix=self.prefix + "eh_proj")
        self.shared_head = SharedHead(hf.hidden_size, hf.rms_norm_eps)
        self.block = DeepseekV2DecoderLayer(config, hf.num_hidden_layers, self.prefix.rstrip("."))
        self.rotary_emb = RotaryEmbedding(
            head_dim=hf.qk_rope_head_dim, max_position=config.model.max_model_len,
            rope_parameters=get_rope_parameters(hf), max_position_embeddings=hf.max_position_embeddings,
        )  # fmt: skip

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert hidden_states is not None
        target: Any = self._target[0]
        embeds = self.enorm(target.model.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat([embeds, self.hnorm(hidden_states)], dim=-1))
        out, residual = self.block(x, None, self.rotary_emb.cos_sin(positions))
        hidden = out + residual
        return hidden, hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        target: Any = self._target[0]
        return target.compute_logits(self.shared_head.norm(hidden_states))

    def checkpoint_tensor_elsewhere(self, name: str) -> bool:
        """Only the first MTP layer's tensors are read (and not its embedding or head copies)."""
        return not name.startswith(self.prefix) or name.endswith(("embed_tokens.weight", "shared_head.head.weight"))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """The MTP layer's tensors, renamed to this module's (``enorm``, ``hnorm``, ``eh_proj``,
        ``shared_head.norm`` as they are; the decoder layer's under ``block.``)."""
        own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
        kept = []
        for name, tensor in weights:
            if self.checkpoint_tensor_elsewhere(name):
                continue
            rest = _kvloom_name(name).removeprefix(self.prefix)
            kept.append((rest if rest.startswith(own) else "block." + rest, tensor))
        return load_checkpoint_weights(self, kept, self.stacked_params)


class MTPProposer(ModelProposer):
    """DeepSeek-V3's MTP layer (``speculative_config.model``: none, or the target's own path)."""

    NAME: ClassVar[str] = "mtp"
    methods: ClassVar[tuple[str, ...]] = ("deepseek_mtp",)

    @classmethod
    def extra_validation(cls, speculative: SpeculativeConfig, config: EngineConfig) -> list[str]:
        from pathlib import Path

        reasons = []
        if config.model.architecture not in MTP_ARCHITECTURES:
            reasons.append(f"the target {config.model.architecture} has no MTP layer kvloom runs "
                           f"(allowed: {', '.join(MTP_ARCHITECTURES)})")  # fmt: skip
        elif not (getattr(config.model.hf_config, "num_nextn_predict_layers", 0) or 0):
            reasons.append("the target's config has no MTP layer (num_nextn_predict_layers is 0)")
        if speculative.model is not None and Path(speculative.model).resolve() != Path(config.model.model).resolve():
            reasons.append(f"model: the MTP layer is the target's own; model must be omitted or {config.model.model}")
        return reasons

    def target_hidden_layers(self) -> tuple[int, ...]:
        return (self.config.model.num_layers,)  # the final normed output

    def build_draft_model(self, context: DraftModelContext) -> nn.Module:
        return context.load(DeepseekMTPDraft, self.config.model, target_model=context.target_model)
