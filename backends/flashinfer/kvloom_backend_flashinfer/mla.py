"""MLA decode through FlashInfer's ``flashinfer.mla.BatchMLAPagedAttentionWrapper``.

The wrapper takes the absorbed query split as ``q_nope [B, H, L]`` / ``q_pe [B, H, R]`` and
the latent cache split as ``ckv [pages, page_size, L]`` / ``kpe [pages, page_size, R]``;
kvloom's latent cache is one ``[num_blocks, block_size, L + R]`` tensor, so both halves
are strided views of it (the kernel takes page and token strides, no copy).

Like the standard FLASHINFER backend, it plans once per step on the host (CSR page arrays
from ``planning.plan_paged_kv``: ``kv_indptr`` and the block-table gather, plus
``kv_len_arr`` = the sequence lengths) and runs once per layer. For CUDA graphs one
wrapper per captured batch size is created with ``use_cuda_graph=True`` over persistent
index buffers that ``plan()`` rewrites in place before every replay.

This module imports ``flashinfer``; the backend declarations import it only when the
builder is asked for, so a missing library stays a validation reason.
"""

from __future__ import annotations

import logging
from typing import Any

import flashinfer.mla
import torch

from kvloom_backend_flashinfer.planning import gather_kv_indices, plan_paged_kv

logger = logging.getLogger(__name__)

#: Float workspace for the wrapper's split-KV partial results (FlashInfer recommends 128 MiB).
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferMLADecoder:
    """Plans and runs absorbed MLA decode (one query token per request) for all layers.

    ``backend`` is the wrapper's kernel family: ``"fa2"`` (default: one JIT build of
    ~half a minute on a fresh machine) or ``"fa3"`` (Hopper only, longer JIT) or
    ``"auto"`` (FlashInfer's choice for the device).
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        backend: str = "fa2",
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        max_num_seqs: int = 0,
        max_pages: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.backend = backend
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self._workspace, backend=backend)
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_buffers: tuple[torch.Tensor, ...] | None = None
        self._max_num_seqs = max_num_seqs
        self._max_pages = max_pages
        self._planned: Any = None
        self._planned_scale: float | None = None

    def _graph_wrapper(self, batch_size: int) -> Any:
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is not None:
            return wrapper
        if not 1 <= batch_size <= self._max_num_seqs:
            raise ValueError(f"CUDA-graph batch size {batch_size} out of range 1..{self._max_num_seqs} (max_num_seqs)")
        if self._graph_buffers is None:
            n = self._max_num_seqs
            self._graph_buffers = (
                torch.zeros(n + 1, dtype=torch.int32, device=self.device),  # qo_indptr
                torch.zeros(n + 1, dtype=torch.int32, device=self.device),  # kv_indptr
                torch.zeros(self._max_pages, dtype=torch.int32, device=self.device),  # kv_indices
                torch.zeros(n, dtype=torch.int32, device=self.device),  # kv_len_arr
            )
        qo, kv_indptr, kv_indices, kv_len = self._graph_buffers
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self._workspace, use_cuda_graph=True, qo_indptr=qo[: batch_size + 1],
            kv_indptr=kv_indptr[: batch_size + 1], kv_indices=kv_indices, kv_len_arr=kv_len[:batch_size],
            backend=self.backend,
        )
        self._graph_wrappers[batch_size] = wrapper
        logger.debug("FLASHINFER_MLA: created CUDA-graph wrapper for batch size %d", batch_size)
        return wrapper

    def plan_decode(
        self,
        seq_lens_cpu: torch.Tensor,
        block_table: torch.Tensor,
        page_size: int,
        num_heads: int,
        kv_lora_rank: int,
        rope_dim: int,
        scale: float,
        dtype: torch.dtype,
        *,
        for_cudagraph: bool = False,
    ) -> None:
        """Plan one decode step of ``B = len(seq_lens_cpu)`` requests (host lengths, device
        block table ``[>= B, W]``). With ``for_cudagraph`` the batch size's graph wrapper
        is planned (created on first use); otherwise that wrapper too when it exists."""
        num_reqs = seq_lens_cpu.shape[0]
        qo_indptr = torch.arange(num_reqs + 1, dtype=torch.int32)
        plan = plan_paged_kv(qo_indptr, seq_lens_cpu, page_size, block_table.shape[1])
        if for_cudagraph and plan.num_pages > self._max_pages:
            raise ValueError(f"CUDA-graph batch needs {plan.num_pages} pages; buffers hold {self._max_pages}")
        kv_indices = gather_kv_indices(block_table[:num_reqs], plan)
        if for_cudagraph:
            wrapper = self._graph_wrapper(num_reqs)
        else:
            wrapper = self._graph_wrappers.get(num_reqs, self._wrapper)
        wrapper.plan(
            plan.qo_indptr, plan.kv_indptr, kv_indices, seq_lens_cpu.to(torch.int32),
            num_heads, kv_lora_rank, rope_dim, page_size, False, scale, dtype, dtype,
        )
        self._planned = wrapper
        self._planned_scale = scale

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out [B, H, L]`` = absorbed MLA decode over ``kv_cache [blocks, block_size, L + R]``."""
        if self._planned is None:
            raise RuntimeError("FlashInferMLADecoder.run called before plan_decode")
        L = q_nope.shape[-1]
        self._planned.run(q_nope, q_pe, kv_cache[..., :L], kv_cache[..., L:], out=out)
        return out
