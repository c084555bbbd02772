"""Per-step metadata of TRITON_ATTN and its builder.

The builder runs once per step on the host, shared by all layers: it picks the kernel
(single-token decode or mixed batch) and the decode split plan, and hands the layers the
runner's device tensors unchanged (no copies, no host syncs).

A mixed batch (some request has more than one query token) runs its single-token
requests through the split-KV decode kernel too, and the rest through the mixed-batch
kernel, which skips them: a decode then costs what it costs in a pure decode step, instead
of a prefill-sized tile of rows (mostly padding) that reads its whole context unsplit.

CUDA graphs (declared ``UNIFORM_BATCH``): a captured graph bakes every kernel argument and
grid. The kernels read all per-request numbers (query offsets, sequence lengths, block
tables, slots) from the runner's persistent device tensors, which the runner refills in
place before each replay, so only host numbers need care. ``build_for_cudagraph_capture``
plans the decode splits from the padded batch size and ``max_model_len`` instead of the
step's longest sequence: for a fixed padded batch size the grids, the split count and the
workspace are then the same at capture and at every replay, whatever the lengths (the
kernel sizes each request's splits from its own length). Mixed-batch grids depend only on
the padded token and request counts and on ``max_query_len``, which a uniform batch fixes.
Such a graph runs the decode kernel for every request, whatever their query lengths: both
kernels read each request's query length on the device, so the launches hold for any mix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvloom.interfaces import AttentionLayerSpec, AttentionMetadataBuilder, CommonAttentionMetadata
from kvloom_backend_triton.config import KernelConfig, resolve_config
from kvloom_backend_triton.ops import plan_decode_splits

logger = logging.getLogger(__name__)

#: ``spec.extra`` key for a ``KernelConfig`` or a dict of overrides (benchmarks, tests).
CONFIG_EXTRA_KEY = "triton_attn_config"
#: ``spec.extra`` key for the SM count to plan for when the device is not CUDA (tests run
#: the kernels in the Triton interpreter on CPU tensors).
NUM_SMS_EXTRA_KEY = "triton_attn_num_sms"
_DEFAULT_NUM_SMS_OFF_CUDA = 8


@dataclass
class TritonAttentionMetadata:
    """What ``TritonAttentionImpl.forward`` needs for one step (shared by all layers)."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [B + 1], device
    seq_lens: torch.Tensor  # int32 [B], device
    block_table: torch.Tensor  # int32 [B, max_blocks], device
    slot_mapping: torch.Tensor  # int64 [N], device
    #: Every request has exactly one query token: the split-KV decode kernel alone.
    decode_only: bool
    #: Requests of one query token in a mixed batch: the decode kernel runs them and the
    #: mixed-batch kernel skips them. Always False when ``decode_only``.
    split_single: bool
    #: Splits of each single-token request's positions (1: no split, no reduction).
    num_splits: int
    #: Decode workspace (float32), at least ``num_reqs * num_splits`` rows when splitting.
    partial_out: torch.Tensor  # [rows, num_heads, head_size]
    partial_lse: torch.Tensor  # [rows, num_heads]
    config: KernelConfig
    #: Built by ``build_for_cudagraph_capture`` (split plan from fixed limits).
    for_cudagraph: bool = False


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder[TritonAttentionMetadata]):

    def __init__(self, spec: AttentionLayerSpec, device: torch.device, max_num_blocks: int) -> None:
        super().__init__(spec, device, max_num_blocks)
        if spec.num_heads % spec.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({spec.num_heads}) must be a multiple of num_kv_heads ({spec.num_kv_heads})"
            )
        self._retired_workspaces: list[tuple[torch.Tensor, torch.Tensor]] = []
        device = torch.device(device)
        arch = None
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            self.num_sms = props.multi_processor_count
            arch = 10 * props.major + props.minor
        else:
            self.num_sms = int(spec.extra.get(NUM_SMS_EXTRA_KEY, _DEFAULT_NUM_SMS_OFF_CUDA))
        self.config = resolve_config(spec.head_size, spec.dtype, spec.extra.get(CONFIG_EXTRA_KEY), arch)
        # The split plan never asks for more rows than this (see plan_decode_splits:
        # splits <= cdiv(target, B * Hkv), so B * splits < target / Hkv + B).
        if self.config.force_num_splits is not None:
            rows = spec.max_num_seqs * self.config.force_num_splits
        else:
            target = self.config.programs_per_sm * self.num_sms
            rows = spec.max_num_seqs + -(-target // spec.num_kv_heads)
        self._allocate_workspace(rows)
        logger.debug("TRITON_ATTN kernel config %s, %d SMs, decode workspace %d rows", self.config, self.num_sms, rows)

    def _allocate_workspace(self, rows: int) -> None:
        # A captured CUDA graph keeps the addresses of the workspace it was captured
        # with: a replaced workspace is kept alive, never freed under a graph.
        if hasattr(self, "partial_out"):
            self._retired_workspaces.append((self.partial_out, self.partial_lse))
        self.partial_out = torch.empty(
            (rows, self.spec.num_heads, self.spec.head_size), dtype=torch.float32, device=self.device
        )
        self.partial_lse = torch.empty((rows, self.spec.num_heads), dtype=torch.float32, device=self.device)

    def _build(self, common: CommonAttentionMetadata, for_cudagraph: bool) -> TritonAttentionMetadata:
        if not common.causal:
            raise ValueError("TRITON_ATTN computes causal (decoder) attention only; got causal=False")
        decode_only = common.max_query_len == 1
        # Both kernels check each request's query length on the device, so a graph may
        # plan for every request being single-token (its grids then hold for any lengths).
        if decode_only or for_cudagraph:
            num_single = common.num_reqs
        else:
            num_single = int((common.query_lens_cpu == 1).sum())
        num_splits = 1
        if num_single:
            longest = self.spec.max_model_len if for_cudagraph else common.max_seq_len
            num_splits = plan_decode_splits(num_single, self.spec.num_kv_heads, longest, self.num_sms, self.config)
            rows = common.num_reqs * num_splits
            if num_splits > 1 and rows > self.partial_out.shape[0]:
                if for_cudagraph:
                    raise ValueError(
                        f"CUDA-graph batch of {common.num_reqs} requests exceeds max_num_seqs "
                        f"({self.spec.max_num_seqs}) the decode workspace was sized for"
                    )
                if decode_only:
                    logger.info("TRITON_ATTN: growing the decode workspace to %d rows", rows)
                    self._allocate_workspace(rows)
                else:
                    # The workspace has a row per (request, split), prefills' rows unused:
                    # fewer splits rather than a workspace for rows nobody writes.
                    num_splits = max(1, self.partial_out.shape[0] // common.num_reqs)
        return TritonAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            max_query_len=common.max_query_len,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            decode_only=decode_only,
            split_single=not decode_only and num_single > 0,
            num_splits=num_splits,
            partial_out=self.partial_out,
            partial_lse=self.partial_lse,
            config=self.config,
            for_cudagraph=for_cudagraph,
        )

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return self._build(common, for_cudagraph=False)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return self._build(common, for_cudagraph=True)
