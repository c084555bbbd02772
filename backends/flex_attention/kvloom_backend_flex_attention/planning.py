"""Host-side planning of a step for FlexAttention over the paged KV cache.

How a step maps onto one ``flex_attention`` call (per query group, see below):

- Keys/values: the whole cache of a layer seen as one sequence of
  ``num_blocks * block_size`` slots (physical order). Sparse KV blocks are the cache's
  pages, so the block mask's KV indices are simply block-table entries.
- Queries: the group's tokens packed into one sequence, each request's tokens padded to
  a multiple of the query block size so that every query block belongs to exactly one
  request. A query block's KV list is then its request's block-table row: pages that are
  fully visible to every row of the block are "full" blocks (no mask evaluated), the rest
  up to the page holding the block's last position are "partial" blocks, masked by
  ``mask_mod`` (ownership + causal order, see ``block_mask.py``).

With a sliding window ``W`` a query block's list starts at the page holding the window start
of its first row (the pages wholly before it are never read: the hybrid KV cache may have
given them back) and every listed page is partial (``mask_mod`` also applies the window).

Query groups: requests with fewer than ``LONG_QUERY_BLOCK`` query tokens (decodes, short
chunks) use 16-row query blocks, longer ones 64-row blocks, each group one flex call. A
single block size would either pad every decode to 64 rows or run long prefills with
16-row tiles; two groups keep both cheap and need only two kernel variants.

Everything here is computed from ``query_start_loc_cpu`` and ``seq_lens_cpu`` (no device
synchronisation); the builder copies the arrays to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.interfaces import window_start

SHORT_QUERY_BLOCK = 16
LONG_QUERY_BLOCK = 64


@dataclass(frozen=True)
class QueryGroupPlan:
    """One flex call: a subset of the step's requests, padded to ``q_block_size`` rows."""

    q_block_size: int
    #: Rows of the step's ``query``/``output`` that belong to this group ...
    token_index: torch.Tensor  # int64 [T]
    #: ... and the padded row each of them occupies.
    row_of_token: torch.Tensor  # int64 [T]
    #: Request (batch index) owning each padded row.
    req_of_row: torch.Tensor  # int64 [R]
    #: Sequence position of each padded row's token; -1 for padding rows.
    pos_of_row: torch.Tensor  # int64 [R]
    #: Request of each query block; its pages ``[first_pages, full_pages)`` are fully
    #: visible to every row of the block, ``[full_pages, visible_pages)`` partly.
    req_of_qblock: torch.Tensor  # int64 [QB]
    first_pages: torch.Tensor  # int32 [QB]
    full_pages: torch.Tensor  # int32 [QB]
    visible_pages: torch.Tensor  # int32 [QB]

    @property
    def num_rows(self) -> int:
        return self.req_of_row.shape[0]


@dataclass(frozen=True)
class PageOwnership:
    """The step's (request, logical page) -> physical page entries, as flat indices into
    the ``[B, W]`` block table, and the logical page index of each entry."""

    table_index: torch.Tensor  # int64 [P]: i * W + k
    logical_page: torch.Tensor  # int32 [P]: k


def plan_query_group(
    req_ids: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_size: int,
    q_block_size: int,
    sliding_window: int | None = None,
) -> QueryGroupPlan:
    """Plan the requests ``req_ids`` (int64, batch order; each with query_len >= 1)."""
    qsl = query_start_loc_cpu.to(torch.int64)
    q_lens = (qsl[1:] - qsl[:-1])[req_ids]
    if q_lens.numel() and int(q_lens.min()) < 1:
        raise ValueError("every request of a query group needs query_len >= 1")
    ctx_lens = seq_lens_cpu.to(torch.int64)[req_ids] - q_lens
    if ctx_lens.numel() and int(ctx_lens.min()) < 0:
        raise ValueError("seq_lens must be >= query lengths")

    qblocks = (q_lens + q_block_size - 1) // q_block_size
    padded = qblocks * q_block_size
    padded_start = torch.cumsum(padded, 0) - padded
    num_rows = int(padded.sum())
    num_tokens = int(q_lens.sum())
    num_qblocks = int(qblocks.sum())

    # Tokens: request r's j-th token is step row qsl[r] + j and padded row padded_start + j.
    tok_req = torch.repeat_interleave(torch.arange(len(req_ids)), q_lens, output_size=num_tokens)
    tok_j = torch.arange(num_tokens) - (torch.cumsum(q_lens, 0) - q_lens)[tok_req]
    token_index = qsl[req_ids][tok_req] + tok_j
    row_of_token = padded_start[tok_req] + tok_j

    # Padded rows: position ctx + j for j < query_len, -1 for the padding after it.
    row_req = torch.repeat_interleave(torch.arange(len(req_ids)), padded, output_size=num_rows)
    row_j = torch.arange(num_rows) - padded_start[row_req]
    pos_of_row = torch.where(row_j < q_lens[row_req], ctx_lens[row_req] + row_j, -1)

    # Query blocks: block m of a request covers rows m*QB .. its last real row.
    blk_req = torch.repeat_interleave(torch.arange(len(req_ids)), qblocks, output_size=num_qblocks)
    blk_m = torch.arange(num_qblocks) - (torch.cumsum(qblocks, 0) - qblocks)[blk_req]
    first_pos = ctx_lens[blk_req] + blk_m * q_block_size
    last_pos = ctx_lens[blk_req] + torch.minimum((blk_m + 1) * q_block_size, q_lens[blk_req]) - 1
    # Page k is fully visible to every row iff its last slot (k+1)*bs - 1 <= first_pos.
    full_pages = (first_pos + 1) // block_size
    visible_pages = last_pos // block_size + 1
    first_pages = torch.zeros_like(full_pages)
    if sliding_window is not None:  # every page from the first row's window start on is partial
        first_pages = window_start(first_pos, sliding_window) // block_size
        full_pages = first_pages

    return QueryGroupPlan(
        q_block_size=q_block_size,
        token_index=token_index,
        row_of_token=row_of_token,
        req_of_row=req_ids[row_req],
        pos_of_row=pos_of_row,
        req_of_qblock=req_ids[blk_req],
        first_pages=first_pages.to(torch.int32),
        full_pages=full_pages.to(torch.int32),
        visible_pages=visible_pages.to(torch.int32),
    )


def plan_query_groups(
    query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, block_size: int, sliding_window: int | None = None
) -> list[QueryGroupPlan]:
    """Split the step's requests into the short- and long-query groups (skipping empty
    groups and requests without query tokens) and plan each."""
    num_reqs = seq_lens_cpu.shape[0]
    q_lens = (query_start_loc_cpu[1 : num_reqs + 1] - query_start_loc_cpu[:num_reqs]).to(torch.int64)
    groups = []
    for q_block, selected in (
        (SHORT_QUERY_BLOCK, (q_lens >= 1) & (q_lens < LONG_QUERY_BLOCK)),
        (LONG_QUERY_BLOCK, q_lens >= LONG_QUERY_BLOCK),
    ):
        req_ids = torch.nonzero(selected).flatten()
        if req_ids.numel():
            groups.append(
                plan_query_group(req_ids, query_start_loc_cpu, seq_lens_cpu, block_size, q_block, sliding_window)
            )
    return groups


def plan_page_ownership(seq_lens_cpu: torch.Tensor, block_size: int, block_table_width: int) -> PageOwnership:
    """Every (request, logical page) of the step as a flat block-table index."""
    pages = (seq_lens_cpu.to(torch.int64) + block_size - 1) // block_size
    if pages.numel() and int(pages.max()) > block_table_width:
        worst = int(pages.argmax())
        raise ValueError(
            f"request {worst} has seq_len {int(seq_lens_cpu[worst])}, which needs {int(pages[worst])} "
            f"blocks of {block_size}; the block table has only {block_table_width} columns"
        )
    total = int(pages.sum())
    req = torch.repeat_interleave(torch.arange(pages.shape[0]), pages, output_size=total)
    logical = torch.arange(total) - (torch.cumsum(pages, 0) - pages)[req]
    return PageOwnership(table_index=req * block_table_width + logical, logical_page=logical.to(torch.int32))
