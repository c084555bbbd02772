"""MLA decode through FlashInfer's ``flashinfer.mla.BatchMLAPagedAttentionWrapper``.

Written against FlashInfer 0.7's canonical wrapper API (checked in the 0.7.0.post1 wheel):
``plan(metadata=MLAPlanMetadata.csr(...), ...)`` and ``run(query=..., kv_cache=...)`` with
*packed* inputs, i.e. exactly kvloom's layouts: the absorbed query ``[B, H, L + R]`` and the
latent cache ``[num_blocks, block_size, L + R]`` (FlashInfer splits them into its
``q_nope``/``q_pe`` and ``ckv``/``kpe`` views itself; its kernels take row and page
strides, so nothing is copied).

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
from dataclasses import dataclass
from typing import Any

import flashinfer.mla
import torch

from kvloom.interfaces import (
    MLA_DECODE,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MLADims,
)
from kvloom_backend_flashinfer.mla_latent import FLASHINFER_MLA_LATENT
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
        metadata = flashinfer.mla.MLAPlanMetadata.csr(
            qo_indptr=plan.qo_indptr, kv_indptr=plan.kv_indptr, kv_indices=kv_indices,
            kv_len_arr=seq_lens_cpu.to(torch.int32),
        )
        wrapper.plan(
            metadata=metadata, num_heads=num_heads, head_dim_ckv=kv_lora_rank, head_dim_kpe=rope_dim,
            page_size=page_size, causal=False, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype,
        )
        self._planned = wrapper
        self._planned_scale = scale

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out [B, H, L]`` = absorbed MLA decode of ``q [B, H, L + R]`` over the latent
        cache ``[num_blocks, block_size, L + R]``."""
        if self._planned is None:
            raise RuntimeError("FlashInferMLADecoder.run called before plan_decode")
        self._planned.run(query=q, kv_cache=kv_cache, out=out)
        return out


# ---------------------------------------------------------------------- the backend's classes


@dataclass
class FlashInferMLAMetadata:
    """A decode step planned on the builder's decoder (shared by all layers)."""

    decoder: FlashInferMLADecoder
    num_reqs: int
    sm_scale: float


class FlashInferMLAMetadataBuilder(AttentionMetadataBuilder[FlashInferMLAMetadata]):
    """Plans FLASHINFER_MLA's decode phase once per step (the core builds it with the
    decode spec only: the backend declares no prefill)."""

    def __init__(self, spec: AttentionLayerSpec, device: torch.device, max_num_blocks: int) -> None:
        super().__init__(spec, device, max_num_blocks)
        self.dims = MLADims.from_spec(spec)
        phase = spec.extra.get("mla_phase", MLA_DECODE)
        if phase != MLA_DECODE:
            raise ValueError(f"FLASHINFER_MLA implements MLA decode only, asked to build for {phase}")
        if (self.dims.kv_lora_rank, self.dims.qk_rope_head_dim) != FLASHINFER_MLA_LATENT:
            raise ValueError(
                f"FLASHINFER_MLA: kv_lora_rank {self.dims.kv_lora_rank} / qk_rope_head_dim "
                f"{self.dims.qk_rope_head_dim} not supported (FlashInfer's MLA kernels take "
                f"{FLASHINFER_MLA_LATENT[0]} / {FLASHINFER_MLA_LATENT[1]})"
            )
        pages_per_seq = -(-spec.max_model_len // spec.block_size)
        self.decoder = FlashInferMLADecoder(
            device,
            backend=str(spec.extra.get("flashinfer_mla_backend", "fa2")),
            workspace_bytes=int(spec.extra.get("flashinfer_workspace_bytes", DEFAULT_WORKSPACE_BYTES)),
            max_num_seqs=spec.max_num_seqs,
            max_pages=spec.max_num_seqs * pages_per_seq,
        )

    def _build(self, common: CommonAttentionMetadata, for_cudagraph: bool) -> FlashInferMLAMetadata:
        if common.max_query_len > 1:
            raise ValueError(
                f"FLASHINFER_MLA decode needs query_len 1 per request, got max {common.max_query_len}"
            )
        d, spec = self.dims, self.spec
        self.decoder.plan_decode(
            common.seq_lens_cpu[: common.num_reqs], common.block_table, spec.block_size, d.num_heads,
            d.kv_lora_rank, d.qk_rope_head_dim, spec.scale, spec.dtype, for_cudagraph=for_cudagraph,
        )
        return FlashInferMLAMetadata(self.decoder, common.num_reqs, spec.scale)

    def build(self, common: CommonAttentionMetadata) -> FlashInferMLAMetadata:
        return self._build(common, for_cudagraph=False)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> FlashInferMLAMetadata:
        return self._build(common, for_cudagraph=True)


class FlashInferMLAImpl(MLAAttentionImpl):
    """Runs the step's planned wrapper; the latent cache is written by the contract's
    graph-safe torch default."""

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: FlashInferMLAMetadata, out: torch.Tensor
    ) -> torch.Tensor:
        md = attn_metadata
        if md.sm_scale != self.scale:
            raise ValueError(
                f"layer scale {self.scale} differs from the scale the step was planned with ({md.sm_scale}); "
                "FLASHINFER_MLA plans one scale for all layers"
            )
        b = md.num_reqs
        md.decoder.run(q[:b], kv_cache, out[:b])
        return out
