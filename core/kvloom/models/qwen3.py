"""Qwen3: the Llama network with a per-head RMSNorm on queries and keys (before RoPE)
and ``head_dim`` independent of ``hidden_size / num_attention_heads``.

Biases follow ``attention_bias`` on all four projections, as in HF. Sliding-window
layers are refused as for Qwen2 (see ``kvloom.models.llama``).
"""

from __future__ import annotations

from typing import Any

from kvloom.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_kwargs(cls, hf_config: Any) -> dict[str, bool]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
