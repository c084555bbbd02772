"""The paged block mask: which cache slots each packed query row may attend to.

The KV sequence flex sees is the physical cache (slot ``kv_idx`` is offset
``kv_idx % block_size`` of page ``kv_idx // block_size``), so the mask needs the logical
position of a physical slot. ``logical_of_page[p]`` is the logical page index that
physical page ``p`` holds in the step's block tables (-1 if no request of the step uses
it). That a page has one logical index for every request using it is an invariant of
the KV cache, not an assumption of convenience: a page's keys were computed at its
positions (rotary embeddings make them position-specific) and prefix caching shares a
page only between requests with the same tokens before it, hence at the same index.

``mask_mod`` is the full definition of the mask (the eager reference path of flex
evaluates it everywhere); the block lists only let the compiled kernels skip pages that
the mask rules out, and skip evaluating it on pages it fully allows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvloom_backend_flex_attention.planning import PageOwnership


def build_logical_of_page(
    block_table: torch.Tensor, ownership: PageOwnership, num_blocks: int
) -> torch.Tensor:
    """``int32 [num_blocks]``: logical page index of each physical page, -1 if unused."""
    logical_of_page = torch.full((num_blocks,), -1, dtype=torch.int32, device=block_table.device)
    pages = torch.take(block_table, ownership.table_index.to(block_table.device, non_blocking=True))
    logical_of_page[pages.long()] = ownership.logical_page.to(block_table.device, non_blocking=True)
    return logical_of_page


def paged_causal_mask_mod(
    req_of_row: torch.Tensor,
    pos_of_row: torch.Tensor,
    block_table: torch.Tensor,
    logical_of_page: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> Callable:
    """``mask_mod(b, h, q_idx, kv_idx)``: True iff the slot's page belongs to the row's
    request and the slot's position is at or before the row's position (padding rows have
    position -1 and see nothing) and, with a window ``W``, after its position - ``W``."""
    width = block_table.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // block_size
        logical = logical_of_page[page]
        req = req_of_row[q_idx]
        owned = block_table[req, logical.clamp(0, width - 1)] == page
        position = logical * block_size + kv_idx % block_size
        visible = (logical >= 0) & owned & (position <= pos_of_row[q_idx])
        if sliding_window is not None:  # a constant of the closure: traced as one mask or the other
            visible = visible & (position > pos_of_row[q_idx] - sliding_window)
        return visible

    return mask_mod


def build_paged_block_mask(
    *,
    q_block_size: int,
    num_rows: int,
    req_of_qblock: torch.Tensor,
    first_pages: torch.Tensor,
    full_pages: torch.Tensor,
    visible_pages: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_blocks: int,
    mask_mod: Callable,
    min_index_width: int = 0,
) -> BlockMask:
    """Block lists per query block: its request's pages ``[first_pages, full_pages)`` are
    full, ``[full_pages, visible_pages)`` partial. All inputs are device tensors.

    ``min_index_width`` pads the index lists with unused columns (flex's CPU kernel wants
    ``width * block_size >= kv_len``); entries past the counts are never read.
    """
    rows = block_table.index_select(0, req_of_qblock)  # [QB, W]: the requests' pages in order
    width = rows.shape[1]
    columns = torch.arange(width, device=rows.device)
    partial = rows.gather(1, (full_pages.long().unsqueeze(1) + columns).clamp_(max=width - 1))
    full = rows.gather(1, (first_pages.long().unsqueeze(1) + columns).clamp_(max=width - 1))
    if min_index_width > width:
        pad = (0, min_index_width - width)
        partial = torch.nn.functional.pad(partial, pad)
        full = torch.nn.functional.pad(full, pad)
    return BlockMask.from_kv_blocks(
        (visible_pages - full_pages).to(torch.int32)[None, None],
        partial.to(torch.int32)[None, None].contiguous(),
        (full_pages - first_pages).to(torch.int32)[None, None],
        full.to(torch.int32)[None, None].contiguous(),
        BLOCK_SIZE=(q_block_size, block_size),
        mask_mod=mask_mod,
        seq_lengths=(num_rows, num_blocks * block_size),
        compute_q_blocks=False,
    )
