"""Random PEFT LoRA adapters for tiny test models: ``kvloom.testing.lora``'s (shipped
with kvloom for plugin authors), under the names kvloom's LoRA tests use."""

from __future__ import annotations

from pathlib import Path

from kvloom.testing.lora import LORA_TARGET_MODULES, edit_adapter_config, make_adapter
from kvloom.testing.models import hf_greedy_tokens

ALL_TARGETS = list(LORA_TARGET_MODULES)

__all__ = ["ALL_TARGETS", "edit_adapter_config", "hf_greedy", "make_adapter"]


def hf_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of one prompt from HF transformers (+ peft when an adapter is given)."""
    return hf_greedy_tokens(base_dir, [prompt_ids], max_new_tokens, adapter_dir=adapter_dir)[0]
