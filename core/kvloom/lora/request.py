"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT-format LoRA adapter, identified by a unique positive integer id.

    ``lora_int_id`` goes into the prefix-cache hash of the request's first block, so
    requests with different adapters never share KV blocks.
    """

    lora_name: str
    """The adapter's name (the model name requests use)."""
    lora_int_id: int
    """A unique positive id."""
    lora_path: str
    """The PEFT adapter directory."""
    base_model_name: str | None = None
    """The model the adapter was trained for, if known."""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must be non-empty")
