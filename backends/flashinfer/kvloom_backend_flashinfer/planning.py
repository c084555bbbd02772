"""Host-side arrays that FlashInfer's ``plan()`` takes, computed from kvloom's batch.

FlashInfer describes a batch's paged KV cache in CSR form instead of a block table:

- ``kv_indptr`` ``[B + 1]``: request ``i`` owns pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``;
- ``kv_indices``: the physical page ids, request after request, in logical order;
- ``kv_last_page_len`` ``[B]``: how many tokens of the request's last page are valid
  (``1..page_size``; ``0`` only for an empty sequence);
- ``qo_indptr`` ``[B + 1]`` (prefill only): the query rows of each request.

With a sliding window ``W`` a request's pages wholly before its first query's window
(positions ``< first_query_pos - W + 1``) are left out: FlashInfer never reads them (the
hybrid KV cache may have freed them) and, as its causal mask is aligned bottom-right, the
distances between queries and the keys kept are unchanged.

Everything here is computed on the CPU from ``seq_lens_cpu`` and ``query_start_loc_cpu``
(no device synchronisation). The block table itself lives on the device, so instead of
the page ids we compute ``kv_gather_index``: flat positions ``i * W + k`` into the
``[B, W]`` block table, which the builder turns into ``kv_indices`` with one
``torch.take`` on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.interfaces import window_start


@dataclass(frozen=True)
class PagedKVPlan:
    qo_indptr: torch.Tensor  # int32 [B + 1], CPU
    kv_indptr: torch.Tensor  # int32 [B + 1], CPU
    kv_last_page_len: torch.Tensor  # int32 [B], CPU
    kv_gather_index: torch.Tensor  # int64 [kv_indptr[-1]], CPU: flat index into block_table

    @property
    def num_reqs(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def num_pages(self) -> int:
        return int(self.kv_indptr[-1])

    @property
    def num_query_rows(self) -> int:
        return int(self.qo_indptr[-1])


def plan_paged_kv(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_size: int,
    block_table_width: int,
    sliding_window: int | None = None,
) -> PagedKVPlan:
    """CSR page arrays for ``B = len(seq_lens_cpu)`` requests.

    ``block_table_width`` is the number of columns of the device block table; a request
    needing more pages than that is a bad batch and raises ``ValueError``.
    ``sliding_window``: leave out the pages before each request's first window.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    seq_lens = seq_lens_cpu.to(torch.int64)
    num_reqs = seq_lens.shape[0]
    if query_start_loc_cpu.shape[0] < num_reqs + 1:
        raise ValueError(
            f"query_start_loc_cpu has {query_start_loc_cpu.shape[0]} entries, "
            f"needs num_reqs + 1 = {num_reqs + 1}"
        )
    if num_reqs and int(seq_lens.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got {seq_lens.tolist()}")

    pages = (seq_lens + block_size - 1) // block_size
    if num_reqs and int(pages.max()) > block_table_width:
        worst = int(pages.argmax())
        raise ValueError(
            f"request {worst} has seq_len {int(seq_lens[worst])}, which needs "
            f"{int(pages[worst])} blocks of {block_size}; the block table has only "
            f"{block_table_width} columns"
        )

    first_page = torch.zeros_like(pages)
    if sliding_window is not None:
        query_lens = (query_start_loc_cpu[1 : num_reqs + 1] - query_start_loc_cpu[:num_reqs]).to(torch.int64)
        first_seen = window_start(seq_lens - query_lens, sliding_window)  # by the step's first query
        first_page = torch.minimum(first_seen // block_size, (pages - 1).clamp(min=0))
    kept = pages - first_page

    kv_indptr = torch.zeros(num_reqs + 1, dtype=torch.int64)
    torch.cumsum(kept, dim=0, out=kv_indptr[1:])
    total_pages = int(kv_indptr[-1])

    # Tokens in the last page: seq_len - (pages - 1) * block_size, i.e. 1..block_size.
    last_page_len = torch.where(pages > 0, seq_lens - (pages - 1) * block_size, 0)

    req_of_page = torch.repeat_interleave(torch.arange(num_reqs), kept, output_size=total_pages)
    page_in_req = torch.arange(total_pages) - kv_indptr[:-1][req_of_page] + first_page[req_of_page]
    gather = req_of_page * block_table_width + page_in_req

    return PagedKVPlan(
        qo_indptr=query_start_loc_cpu[: num_reqs + 1].to(torch.int32).clone(),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_last_page_len=last_page_len.to(torch.int32),
        kv_gather_index=gather,
    )


def gather_kv_indices(block_table: torch.Tensor, plan: PagedKVPlan) -> torch.Tensor:
    """``kv_indices`` (int32, on the block table's device) for ``plan``.

    ``torch.take`` indexes the block table as if it were contiguous and row-major, so a
    strided view (e.g. the first B rows of a persistent buffer) works as is.
    """
    index = plan.kv_gather_index.to(block_table.device, non_blocking=True)
    return torch.take(block_table, index).to(torch.int32)
