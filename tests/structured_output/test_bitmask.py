"""Applying a grammar bitmask to the logits (the CPU torch path), against a per-token
reference."""

from __future__ import annotations

import pytest
import torch

from kvloom.structured_output.bitmask import allowed_mask, apply_bitmask_torch, apply_grammar_bitmask


def _reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    rows = []
    for row in bitmask.tolist():
        rows.append([bool((row[t // 32] >> (t % 32)) & 1) for t in range(vocab)])
    return torch.tensor(rows)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 257])
def test_allowed_mask_matches_the_bit_layout(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(allowed_mask(bitmask, vocab), _reference_allowed(bitmask, vocab))


def test_apply_masks_only_the_structured_rows() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 70
    logits = torch.randn(4, vocab, generator=g)
    original = logits.clone()
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=g, dtype=torch.int64).to(torch.int32)
    # Requests b and d are structured, with bitmask rows 1 and 0.
    apply_grammar_bitmask(logits, ["a", "b", "c", "d"], {"d": 0, "b": 1}, bitmask)
    allowed = _reference_allowed(bitmask, vocab)
    for row, mask_row in ((1, 1), (3, 0)):
        expected = torch.where(allowed[mask_row], original[row], torch.tensor(float("-inf")))
        assert torch.equal(logits[row], expected)
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])


def test_a_bitmask_narrower_than_the_logits_disallows_the_padding() -> None:
    logits = torch.zeros(1, 40)
    apply_bitmask_torch(logits, torch.tensor([[-1]], dtype=torch.int32), [0])  # 32 tokens allowed
    assert torch.isfinite(logits[0, :32]).all() and torch.isneginf(logits[0, 32:]).all()
