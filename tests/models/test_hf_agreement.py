"""The HF yardsticks of the GPU tests (tests/helpers/hf_agreement.py), on the CPU."""

from __future__ import annotations

import torch

from kvloom.testing.models import load_hf_model, tiny_model_dir
from tests.helpers.hf_agreement import hf_greedy, top1_agreement


def test_hf_agrees_with_its_own_greedy_tokens_and_not_with_others():
    hf = load_hf_model(tiny_model_dir("llama"))
    prompts = [[5, 9, 11, 40], [7, 3]]
    greedy = hf_greedy(hf, prompts, 6)
    assert [len(g) for g in greedy] == [6, 6]
    assert top1_agreement(hf, prompts, greedy) == 1.0
    vocab = hf.config.vocab_size
    shifted = [[(t + 1) % vocab for t in g] for g in greedy]  # never the argmax of a greedy step
    assert top1_agreement(hf, prompts, shifted) < 1.0
    assert torch.is_grad_enabled()  # the helpers leave autograd as they found it
