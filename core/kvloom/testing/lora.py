"""LoRA adapters in a test: random PEFT adapters for a model, made offline with peft.

``make_adapter(base_dir, out_dir)`` saves a normal PEFT LoRA adapter of the HF model in
``base_dir`` (``adapter_config.json`` and ``adapter_model.safetensors``, exactly what
``PeftModel.save_pretrained`` writes: ``base_model_name_or_path`` is ``base_dir``), with
random ``lora_A`` *and* ``lora_B`` (PEFT starts ``lora_B`` at zero, which would make the
adapter a no-op). ``edit_adapter_config`` changes fields of its config, to make adapters
kvloom must refuse (``peft_type="IA3"``, ``use_dora=True``, ...).
``kvloom.testing.models.hf_greedy_tokens(base_dir, prompts, n, adapter_dir=...)`` is the
reference: HF transformers + peft's greedy tokens through the adapter.

peft and transformers are imported inside ``make_adapter`` (peft is needed only there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["LORA_TARGET_MODULES", "edit_adapter_config", "make_adapter"]

LORA_TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every projection kvloom can adapt (the attention and MLP projections of the Llama
family); ``make_adapter``'s default ``target_modules``."""


def make_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: list[str] | None = None,
    safetensors: bool = True,
    **config: Any,
) -> Path:
    """Save a PEFT LoRA adapter of rank ``r`` for the HF causal LM in ``base_dir`` into
    ``out_dir`` and return ``out_dir``. Every ``lora_A`` and ``lora_B`` matrix is drawn from
    N(0, 0.2) with ``seed``, so the adapter changes the model's outputs. ``target_modules``
    defaults to ``LORA_TARGET_MODULES``; ``safetensors=False`` writes
    ``adapter_model.bin``; ``config`` are further ``peft.LoraConfig`` fields (``use_rslora``,
    ...). Needs ``peft`` (a kvloom dev requirement)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    lora_config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules or LORA_TARGET_MODULES),
                             lora_dropout=0.0, bias="none", **config)  # fmt: skip
    model = get_peft_model(base, lora_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, 0.2)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=safetensors)
    return out_dir


def edit_adapter_config(adapter_dir: str | Path, **changes: Any) -> dict[str, Any]:
    """Set fields of the adapter's ``adapter_config.json`` (``edit_adapter_config(path,
    peft_type="IA3")``) and return the new config."""
    path = Path(adapter_dir) / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return config
