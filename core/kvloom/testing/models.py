"""A model class outside the engine: built and loaded as the engine does, and run.

For model authors' tests (``kvloom.interfaces.models``): build the class from an
``EngineConfig`` (``kvloom.testing.resolve_engine_config``), load a checkpoint's weights
through its ``load_weights``, and run ``forward`` or single ``Attention`` layers inside a
``forward_context`` holding the attention backend's metadata for the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from kvloom.config import EngineConfig
from kvloom.forward_context import set_forward_context
from kvloom.loader.model_loader import default_dtype, model_weights

__all__ = ["forward_context", "load_model"]


def load_model(model_cls: type[nn.Module], config: EngineConfig, device: torch.device | str = "cpu") -> nn.Module:
    """``model_cls(config)`` built as the engine builds a model: on ``device`` in
    ``config.model.dtype``, its weights loaded by its ``load_weights`` from ``config``'s
    checkpoint (an HF directory or a GGUF file), in eval mode. The class need not be
    registered. (The engine also installs the platform's custom ops; this does not.)"""
    with default_dtype(config.model.dtype), torch.device(device):
        model = model_cls(config)
    model = model.to(device=device)
    model.load_weights(model_weights(config, model))
    return model.eval()


@contextmanager
def forward_context(attn_metadata: Any, **extras: Any) -> Iterator[None]:
    """Inside the block, ``Attention`` layers (and the models built from them) run one
    step with ``attn_metadata``, what the attention backend's metadata builder built for
    it (``builder.build(common)``); the model runner wraps every forward in the same
    context. ``extras`` are per-step data other layers read (e.g. LoRA's mapping)."""
    with set_forward_context(attn_metadata, **extras):
        yield
