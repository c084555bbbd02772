"""Greedy generation and teacher-forced top-1 agreement with an HF model: the two
measurements the GPU tests compare kvloom's tokens with (tests/gpu/test_e2e_gpu.py,
tests/gpu/test_mla_gpu.py). The caller loads the HF model (dtype, device) and frees it."""

from __future__ import annotations

from typing import Any

import torch


def hf_greedy(hf: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Exactly ``n`` greedy tokens per prompt from ``hf`` (EOS ignored)."""
    device = next(hf.parameters()).device
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            outs.append(out[0, len(p) :].tolist())
    return outs


def top1_agreement(hf: Any, prompts: list[list[int]], generated: list[list[int]]) -> float:
    """Share of the ``generated`` tokens that ``hf``, teacher-forced on prompt + generated,
    ranks first."""
    device = next(hf.parameters()).device
    agree = total = 0
    with torch.no_grad():
        for p, g in zip(prompts, generated):
            ids = torch.tensor([p + g], device=device)
            pred = hf(ids).logits[0, len(p) - 1 : len(p) + len(g) - 1].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(pred, g))
            total += len(g)
    return agree / total
