"""Per-step metadata of TRITON_MLA and its builder (one builder per MLA phase).

Decode: the split count is planned once per step on the host; the kernels read lengths
and block tables from the runner's device tensors. For CUDA graphs
(``build_for_cudagraph_capture``) the split count comes from the padded batch size and
``max_model_len`` instead of the step's longest sequence, so the grid and the workspace
views are the same at capture and at every replay of a batch size, and the kernel derives
each split's range from the request's own length. The workspace is one flat float32
buffer allocated at construction (sized by ``max_num_seqs`` and the split plan's bound)
and viewed as ``[B, H, S, L]``: the same address for the same ``(B, S)``.

Prefill: ``cu_seqlens_k`` (each request's whole sequence: cached prefix + new tokens, as
the core lays the decompressed K/V out) is built on the host from ``seq_lens_cpu``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvloom.interfaces import (
    MLA_DECODE,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLADims,
    cdiv,
)
from kvloom_backend_triton_mla.ops import MLAKernelConfig, plan_num_kv_splits, resolve_config

logger = logging.getLogger(__name__)

#: ``spec.extra`` key for an ``MLAKernelConfig`` or a dict of overrides (tests, benchmarks).
CONFIG_EXTRA_KEY = "triton_mla_config"
#: ``spec.extra`` key for the SM count to plan for off CUDA (interpreter tests).
NUM_SMS_EXTRA_KEY = "triton_mla_num_sms"
_DEFAULT_NUM_SMS_OFF_CUDA = 8


@dataclass
class TritonMLADecodeMetadata:
    num_reqs: int
    seq_lens: torch.Tensor  # int32 [>= B], device
    block_table: torch.Tensor  # int32 [>= B, max_blocks], device
    num_kv_splits: int
    partial_out: torch.Tensor | None  # float32 [B, H, S, L] when S > 1
    partial_lse: torch.Tensor | None  # float32 [B, H, S]
    config: MLAKernelConfig
    for_cudagraph: bool = False


@dataclass
class TritonMLAPrefillMetadata:
    num_reqs: int
    cu_seqlens_q: torch.Tensor  # int32 [B + 1], device
    cu_seqlens_k: torch.Tensor  # int32 [B + 1], device
    max_query_len: int
    config: MLAKernelConfig


class TritonMLAMetadataBuilder(AttentionMetadataBuilder[TritonMLADecodeMetadata | TritonMLAPrefillMetadata]):

    def __init__(self, spec: AttentionLayerSpec, device: torch.device, max_num_blocks: int) -> None:
        super().__init__(spec, device, max_num_blocks)
        self.dims = MLADims.from_spec(spec)
        self.phase = spec.extra.get("mla_phase", MLA_DECODE)
        self.config = resolve_config(spec.dtype, spec.extra.get(CONFIG_EXTRA_KEY))
        device = torch.device(device)
        if device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.num_sms = int(spec.extra.get(NUM_SMS_EXTRA_KEY, _DEFAULT_NUM_SMS_OFF_CUDA))
        self._retired: list[torch.Tensor] = []
        self._workspace: torch.Tensor | None = None
        if self.phase == MLA_DECODE:
            # plan_num_kv_splits never gives B * S above this (S <= cdiv(target, B * tiles)).
            cfg = self.config
            if cfg.force_num_splits is not None:
                rows = spec.max_num_seqs * cfg.force_num_splits
            else:
                rows = spec.max_num_seqs + cdiv(cfg.programs_per_sm * self.num_sms,
                                                cdiv(spec.num_heads, cfg.decode_block_h))
            self._allocate_workspace(rows)

    def _allocate_workspace(self, rows: int) -> None:
        # A captured graph keeps the address it was captured with: a replaced workspace
        # stays alive, never freed under a graph.
        if self._workspace is not None:
            self._retired.append(self._workspace)
        h, width = self.spec.num_heads, self.dims.kv_lora_rank + 1  # + 1: the lse next to each output row
        self._workspace = torch.empty(rows * h * width, dtype=torch.float32, device=self.device)
        self._workspace_rows = rows
        logger.debug("TRITON_MLA decode workspace: %d (request x split) rows", rows)

    def _workspace_views(self, num_reqs: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, L = self.spec.num_heads, self.dims.kv_lora_rank
        n_out = num_reqs * h * splits * L
        assert self._workspace is not None
        out = self._workspace[:n_out].view(num_reqs, h, splits, L)
        lse = self._workspace[n_out : n_out + num_reqs * h * splits].view(num_reqs, h, splits)
        return out, lse

    def _build_decode(self, common: CommonAttentionMetadata, for_cudagraph: bool) -> TritonMLADecodeMetadata:
        if common.max_query_len > 1:
            raise ValueError(f"TRITON_MLA decode metadata needs query_len 1 per request, got max {common.max_query_len}")
        longest = self.spec.max_model_len if for_cudagraph else common.max_seq_len
        splits = plan_num_kv_splits(common.num_reqs, self.spec.num_heads, longest, self.num_sms, self.config)
        partial_out = partial_lse = None
        if splits > 1:
            rows = common.num_reqs * splits
            if rows > self._workspace_rows:
                if for_cudagraph:
                    raise ValueError(f"CUDA-graph batch of {common.num_reqs} requests x {splits} splits exceeds the "
                                     f"decode workspace ({self._workspace_rows} rows, sized by max_num_seqs)")
                logger.info("TRITON_MLA: growing the decode workspace to %d rows", rows)
                self._allocate_workspace(rows)
            partial_out, partial_lse = self._workspace_views(common.num_reqs, splits)
        return TritonMLADecodeMetadata(
            num_reqs=common.num_reqs, seq_lens=common.seq_lens, block_table=common.block_table,
            num_kv_splits=splits, partial_out=partial_out, partial_lse=partial_lse, config=self.config,
            for_cudagraph=for_cudagraph,
        )

    def _build_prefill(self, common: CommonAttentionMetadata) -> TritonMLAPrefillMetadata:
        seq_lens = common.seq_lens_cpu[: common.num_reqs].to(torch.int32)
        cu_k = torch.zeros(common.num_reqs + 1, dtype=torch.int32)
        torch.cumsum(seq_lens, 0, out=cu_k[1:])
        return TritonMLAPrefillMetadata(
            num_reqs=common.num_reqs,
            cu_seqlens_q=common.query_start_loc[: common.num_reqs + 1],
            cu_seqlens_k=cu_k.to(self.device, non_blocking=True),
            max_query_len=common.max_query_len,
            config=self.config,
        )

    def build(self, common: CommonAttentionMetadata) -> TritonMLADecodeMetadata | TritonMLAPrefillMetadata:
        if not common.causal:
            raise ValueError("TRITON_MLA computes causal (decoder) attention only; got causal=False")
        if self.phase == MLA_DECODE:
            return self._build_decode(common, for_cudagraph=False)
        return self._build_prefill(common)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> TritonMLADecodeMetadata:
        if self.phase != MLA_DECODE:
            raise ValueError("TRITON_MLA captures CUDA graphs for MLA decode only")
        return self._build_decode(common, for_cudagraph=True)
