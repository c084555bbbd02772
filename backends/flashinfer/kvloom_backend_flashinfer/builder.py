"""The FLASHINFER metadata builder: plans FlashInfer's wrappers once per step.

FlashInfer splits attention into ``plan()`` (host-side scheduling from the batch's page
tables, done once per step and shared by every layer) and ``run()`` (the kernel, once per
layer). This builder owns the wrappers and does the planning; the impl only runs them.

Batch handling. kvloom's model runner does not reorder requests, so decodes and prefill
chunks may come in any order. Rather than splitting the batch (index-select the decode
rows, run two wrappers, scatter the outputs back), the builder picks one wrapper per step:

- every request has ``query_len == 1`` (a pure decode step): the decode wrapper;
- anything else (prefills, chunked prefills with context, or a mix with decodes): one
  ``BatchPrefillWithPagedKVCacheWrapper`` planned over the whole batch with
  ``causal=True``. FlashInfer aligns the causal mask bottom-right (query row ``j`` of a
  request with ``q`` query rows and ``k`` keys sees keys ``<= k - q + j``), which is
  exactly kvloom's contract, and a decode request is simply a prefill of length 1.

This keeps the step to a single kernel launch per layer and no gathers, at the cost of
running the decode rows of a mixed step through the prefill kernel (which handles them
correctly; only pure-decode steps need the decode kernel's speed and CUDA graphs).

Kernel variants. Both wrappers use FlashInfer's FA2 tensor-core kernels: the prefill
wrapper with ``backend="fa2"`` (fa3 costs ~100 s of JIT per variant on a fresh Hopper
machine) and the decode wrapper with ``use_tensor_cores=True``, which FlashInfer 0.7
serves with the same batch-prefill module (one JIT build per dtype/head-size, ~27 s) and
which accepts any GQA group size (the CUDA-core decode kernel only 1/2/3/4/6/8).

CUDA graphs (``UNIFORM_SINGLE_TOKEN_DECODE``). ``build_for_cudagraph_capture`` creates one
decode wrapper per captured batch size with ``use_cuda_graph=True``; its indptr, indices
and last-page-length arrays live in persistent device buffers that ``plan()`` rewrites in
place, so a graph captured once replays correctly after every later ``build`` of a decode
step of that size (``build`` uses the graph wrapper whenever one exists for the size).
All graph wrappers share the buffers (one step runs at a time) and the workspace.
"""

from __future__ import annotations

import logging
from typing import Any

import flashinfer
import torch

from kvloom.interfaces import AttentionLayerSpec, AttentionMetadataBuilder, CommonAttentionMetadata
from kvloom_backend_flashinfer.metadata import FlashInferMetadata
from kvloom_backend_flashinfer.planning import PagedKVPlan, gather_kv_indices, plan_paged_kv

logger = logging.getLogger(__name__)

#: FlashInfer's float workspace (split-KV partial results). 256 MiB as in FlashInfer's
#: and vLLM's defaults; override with ``spec.extra["flashinfer_workspace_bytes"]``.
DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024

#: The only KV layout used: ``(num_blocks, 2, block_size, kv_heads, head_size)``.
KV_LAYOUT = "NHD"


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):

    def __init__(self, spec: AttentionLayerSpec, device: torch.device, max_num_blocks: int) -> None:
        super().__init__(spec, device, max_num_blocks)
        if spec.num_heads % spec.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({spec.num_heads}) must be a multiple of num_kv_heads ({spec.num_kv_heads})"
            )
        workspace_bytes = int(spec.extra.get("flashinfer_workspace_bytes", DEFAULT_WORKSPACE_BYTES))
        # FlashInfer requires the float workspace to be zero before its first use.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, KV_LAYOUT, backend="fa2"
        )
        self._decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, KV_LAYOUT, use_tensor_cores=True
        )
        # CUDA-graph decode wrappers by batch size, and their shared persistent buffers
        # (allocated on the first capture).
        self._graph_decode_wrappers: dict[int, Any] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        pages_per_seq = -(-spec.max_model_len // spec.block_size)
        self._max_graph_pages = spec.max_num_seqs * pages_per_seq

    # ------------------------------------------------------------------ public API
    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        plan = self._host_plan(common)
        if common.is_uniform_single_token_decode:
            wrapper = self._graph_decode_wrappers.get(common.num_reqs, self._decode_wrapper)
            return self._plan_decode(wrapper, plan, common)
        return self._plan_prefill(plan, common)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        if not common.is_uniform_single_token_decode:
            raise ValueError(
                "FLASHINFER captures CUDA graphs only for uniform single-token decode batches "
                "(cudagraph_support=UNIFORM_SINGLE_TOKEN_DECODE); got max_query_len="
                f"{common.max_query_len}"
            )
        plan = self._host_plan(common)
        wrapper = self._graph_decode_wrapper(common.num_reqs)
        return self._plan_decode(wrapper, plan, common)

    # ------------------------------------------------------------------ planning
    def _host_plan(self, common: CommonAttentionMetadata) -> PagedKVPlan:
        return plan_paged_kv(
            common.query_start_loc_cpu,
            common.seq_lens_cpu[: common.num_reqs],
            self.spec.block_size,
            common.block_table.shape[1],
            self.spec.sliding_window,
        )

    def _plan_kwargs(self) -> dict[str, Any]:
        window = self.spec.sliding_window
        return {
            "sm_scale": self.spec.scale,
            "q_data_type": self.spec.dtype,
            "kv_data_type": self.spec.kv_cache_dtype,
            # FlashInfer's window counts the keys left of the query's own: W - 1.
            "window_left": -1 if window is None else window - 1,
            "logits_soft_cap": self.spec.logits_soft_cap,
        }

    def _paged_kv_args(self, plan: PagedKVPlan, common: CommonAttentionMetadata) -> tuple[Any, ...]:
        """The arguments both wrappers' ``plan`` take after the query layout: the paged KV
        (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) and the head geometry."""
        spec = self.spec
        kv_indices = gather_kv_indices(common.block_table[: common.num_reqs], plan)
        return (
            plan.kv_indptr,
            kv_indices,
            plan.kv_last_page_len,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
            spec.block_size,
        )

    def _metadata(
        self, wrapper: Any, num_query_rows: int, common: CommonAttentionMetadata, is_decode: bool
    ) -> FlashInferMetadata:
        return FlashInferMetadata(
            wrapper=wrapper,
            num_query_rows=num_query_rows,
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping,
            layer_features=(self.spec.scale, self.spec.sliding_window, self.spec.logits_soft_cap),
            is_decode=is_decode,
        )

    def _plan_decode(
        self, wrapper: Any, plan: PagedKVPlan, common: CommonAttentionMetadata
    ) -> FlashInferMetadata:
        wrapper.plan(*self._paged_kv_args(plan, common), pos_encoding_mode="NONE", **self._plan_kwargs())
        return self._metadata(wrapper, common.num_reqs, common, is_decode=True)

    def _plan_prefill(self, plan: PagedKVPlan, common: CommonAttentionMetadata) -> FlashInferMetadata:
        self._prefill_wrapper.plan(
            plan.qo_indptr, *self._paged_kv_args(plan, common), causal=True, **self._plan_kwargs()
        )
        return self._metadata(self._prefill_wrapper, plan.num_query_rows, common, is_decode=False)

    # ------------------------------------------------------------------ CUDA graphs
    def _graph_decode_wrapper(self, batch_size: int) -> Any:
        wrapper = self._graph_decode_wrappers.get(batch_size)
        if wrapper is not None:
            return wrapper
        max_seqs = self.spec.max_num_seqs
        if not 1 <= batch_size <= max_seqs:
            raise ValueError(
                f"CUDA-graph batch size {batch_size} out of range 1..{max_seqs} (max_num_seqs)"
            )
        if self._graph_buffers is None:
            self._graph_buffers = (
                torch.zeros(max_seqs + 1, dtype=torch.int32, device=self.device),
                torch.zeros(self._max_graph_pages, dtype=torch.int32, device=self.device),
                torch.zeros(max_seqs, dtype=torch.int32, device=self.device),
            )
        indptr, indices, last_page_len = self._graph_buffers
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            KV_LAYOUT,
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr[: batch_size + 1],
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len[:batch_size],
        )
        self._graph_decode_wrappers[batch_size] = wrapper
        logger.debug("FLASHINFER: created CUDA-graph decode wrapper for batch size %d", batch_size)
        return wrapper
