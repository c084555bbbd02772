"""A Llama variant written against ``kvloom.interfaces.models``: Qwen2's structure
(biases on the q/k/v projections, none on o_proj), as kvloom's own Qwen2 is built."""

from __future__ import annotations

from typing import Any

from kvloom.interfaces.models import LlamaForCausalLM


class KvloomTestQwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_kwargs(cls, hf_config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}
