"""Qwen2: the Llama network with biases on the q/k/v projections (not on o_proj).

Qwen2 checkpoints may enable sliding-window attention on some layers
(``use_sliding_window``: the layers from ``max_window_layers`` on, HF's ``layer_types``);
those layers attend within the window (see ``kvloom.models.llama``).
"""

from __future__ import annotations

from typing import Any

from kvloom.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_kwargs(cls, hf_config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}
