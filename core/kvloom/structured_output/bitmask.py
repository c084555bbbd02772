"""Applying a grammar bitmask to the logits before sampling.

The bitmask is int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is
allowed; a disallowed token's logit becomes -inf. On CUDA, xgrammar's kernel does it; elsewhere
(the CPU) a torch expansion of the bits."""

from __future__ import annotations

import torch

_BIT = None  # per-device cache of 1 << arange(32)


def _bits(device: torch.device) -> torch.Tensor:
    global _BIT
    if _BIT is None or _BIT.device != device:
        _BIT = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int32, device=device),
                                        torch.arange(32, dtype=torch.int32, device=device))  # fmt: skip
    return _BIT


def allowed_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool ``[rows, vocab_size]`` mask of allowed tokens that ``bitmask`` encodes."""
    expanded = (bitmask.unsqueeze(-1) & _bits(bitmask.device)) != 0
    return expanded.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: ``logits[rows[i]]`` keeps only the tokens row ``i`` of ``bitmask`` allows."""
    vocab = logits.shape[-1]
    allowed = allowed_mask(bitmask.to(logits.device), vocab)
    # A bitmask narrower than the logits (padded vocabulary) disallows the padding.
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.as_tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_grammar_bitmask(
    logits: torch.Tensor, req_ids: list[str], bitmask_rows: dict[str, int], bitmask: torch.Tensor
) -> None:
    """Mask ``logits`` (one row per request of ``req_ids``) with the bitmask rows of the
    structured requests among them."""
    rows, mask_rows = [], []
    for i, req_id in enumerate(req_ids):
        j = bitmask_rows.get(req_id)
        if j is not None:
            rows.append(i)
            mask_rows.append(j)
    apply_bitmask_rows(logits, rows, mask_rows, bitmask)


def apply_bitmask_rows(logits: torch.Tensor, rows: list[int], mask_rows: list[int], bitmask: torch.Tensor) -> None:
    """Mask ``logits[rows[i]]`` with ``bitmask[mask_rows[i]]`` (speculative decoding: a row
    per verified position)."""
    if not rows:
        return
    bitmask = bitmask[mask_rows]
    if logits.device.type == "cuda":
        import xgrammar as xgr

        # The kernel masks logits[rows[i]] with bitmask[rows[i]]: give it rows aligned so.
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        # From pinned memory the copy is queued behind the forward without the host waiting
        # for it (from pageable memory the driver may synchronise with the stream), so the
        # host goes on while the forward runs (async scheduling samples a step after it).
        full = full.pin_memory()
        xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True),
                                        vocab_size=min(logits.shape[-1], bitmask.shape[1] * 32), indices=rows)  # fmt: skip
        return
    apply_bitmask_torch(logits, bitmask, rows)
