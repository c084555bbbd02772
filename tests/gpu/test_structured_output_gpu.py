"""Structured outputs on CUDA: xgrammar's kernel masks the same logits as the torch path
(bf16 and fp32, a padded vocabulary, structured rows among unstructured ones)."""

from __future__ import annotations

import pytest
import torch

from kvloom.structured_output.bitmask import allowed_mask, apply_grammar_bitmask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [151936, 49152, 1000])
def test_cuda_kernel_matches_the_torch_reference(dtype: torch.dtype, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g).to("cuda", dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (16, words), generator=g, dtype=torch.int64).to(torch.int32)
    req_ids = [f"r{i}" for i in range(64)]
    rows = {f"r{i}": j for j, i in enumerate(range(0, 64, 4))}  # every fourth request is structured
    expected = logits.clone()
    allowed = allowed_mask(bitmask, vocab).to("cuda")
    for req_id, j in rows.items():
        i = int(req_id[1:])
        expected[i] = expected[i].masked_fill(~allowed[j], float("-inf"))
    apply_grammar_bitmask(logits, req_ids, rows, bitmask)
    torch.cuda.synchronize()
    assert torch.equal(logits, expected)
