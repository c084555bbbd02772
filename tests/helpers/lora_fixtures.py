"""Random PEFT LoRA adapters for tiny test models (shared by the LoRA test modules)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    seed: int,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: list[str] | None = None,
    safetensors: bool = True,
    **config: Any,
) -> Path:
    """Save a PEFT LoRA adapter with random A and B (PEFT starts B at zero, which would
    make the adapter a no-op) for the HF model in ``base_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules or ALL_TARGETS,
                             lora_dropout=0.0, bias="none", **config)  # fmt: skip
    model = get_peft_model(base, lora_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, 0.2)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=safetensors)
    return out_dir


def edit_adapter_config(adapter_dir: Path, **changes: Any) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def hf_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from HF transformers (+ peft when an adapter is given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            min_new_tokens=max_new_tokens, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt_ids):].tolist()
