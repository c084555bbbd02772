"""kvloom's greedy tokens of a (quantized) checkpoint, for the quantization methods' tests:
the engine's config (quantization resolved from the checkpoint or the flag), the model
built and loaded as the engine does, stepped over the paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvloom.interfaces import ModelRegistry
from kvloom.testing import load_model, resolve_engine_config
from tests.helpers.model_fixtures import PagedRunner


def kvloom_greedy(
    model_dir: str | Path, prompts: Sequence[Sequence[int]], n: int, **engine_args: Any
) -> list[list[int]]:
    """Greedy ``n`` tokens of each prompt in float32 (``engine_args``: ``quantization=``, ...);
    the resolved config must quantize the model."""
    config = resolve_engine_config(model=str(model_dir), dtype="float32", **engine_args)
    assert config.model.quantization is not None, "the checkpoint resolved to no quantization method"
    model = load_model(ModelRegistry.load_model_cls(config.model.architecture), config)
    runner = PagedRunner(model, config)
    outs = []
    for i, prompt in enumerate(prompts):
        tokens = [int(runner.step({i: list(prompt)})[i][-1].argmax())]
        while len(tokens) < n:
            tokens.append(int(runner.step({i: tokens[-1:]})[i][-1].argmax()))
        outs.append(tokens)
    return outs
