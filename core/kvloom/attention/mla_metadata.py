"""The per-step metadata of MLA models: the core's builder splits each step into decode
requests (``query_len == 1``) and prefill requests and asks each phase backend's own
builder for the metadata of its requests (the contract: ``kvloom.attention.mla_backend``;
the layer that reads this metadata: ``kvloom.attention.mla_layer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from kvloom.attention.mla_backend import MLA_DECODE, MLA_PREFILL, MLADims


@dataclass
class MLAPhaseBatch:
    """One phase's requests of a step."""

    common: CommonAttentionMetadata
    """The phase's requests alone (its own query_start_loc from 0, seq_lens, block table,
    slot mapping)."""
    token_rows: torch.Tensor | None
    """int64 rows of the phase's tokens in the step; ``None`` when they are the contiguous
    rows ``token_start : token_start + num_tokens`` (no gather)."""
    token_start: int
    num_tokens: int
    backend_metadata: Any
    """What the phase backend's builder built from ``common``."""

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The phase's rows of a step tensor ``x [N, ...]``."""
        if self.token_rows is None:
            return x[self.token_start : self.token_start + self.num_tokens]
        return x.index_select(0, self.token_rows)

    def scatter(self, dest: torch.Tensor, rows: torch.Tensor) -> None:
        """``dest[phase rows] = rows``."""
        if self.token_rows is None:
            dest[self.token_start : self.token_start + self.num_tokens] = rows
        else:
            dest.index_copy_(0, self.token_rows, rows)


@dataclass
class MLAPrefillBatch(MLAPhaseBatch):
    """The prefill requests, plus where their sequences' latent rows come from."""

    context_slots: torch.Tensor | None = None
    """int64 ``[sum(seq_lens)]``: the cache slot of every position of every prefill
    request's sequence, request by request; ``None`` when no request has context (the
    step's own latent rows are the whole sequences)."""


@dataclass
class MLAMetadata:
    """What every MLA layer of a step reads (built once per step)."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    """int64 ``[N]``: where each token's latent row goes (``-1`` = padding)."""
    decode: MLAPhaseBatch | None
    prefill: MLAPrefillBatch | None


def _subset_common(
    common: CommonAttentionMetadata, req_idx: np.ndarray, token_rows_np: np.ndarray, device: torch.device
) -> tuple[CommonAttentionMetadata, torch.Tensor | None, int]:
    """The requests ``req_idx`` of ``common`` as their own batch; also their token rows
    (``None`` when contiguous) and the first row."""
    qsl = common.query_start_loc_cpu.numpy()
    qlens = (qsl[1:] - qsl[:-1])[req_idx]
    seq_lens_cpu = common.seq_lens_cpu[torch.from_numpy(req_idx)]
    new_qsl = np.zeros(len(req_idx) + 1, dtype=np.int32)
    np.cumsum(qlens, out=new_qsl[1:])
    start = int(token_rows_np[0]) if len(token_rows_np) else 0
    contiguous = len(token_rows_np) == 0 or bool(np.all(np.diff(token_rows_np) == 1))
    idx = torch.from_numpy(req_idx).to(device, non_blocking=True)
    rows = None if contiguous else torch.from_numpy(token_rows_np).to(device, non_blocking=True)
    num_tokens = len(token_rows_np)
    slot_mapping = (
        common.slot_mapping[start : start + num_tokens] if rows is None else common.slot_mapping.index_select(0, rows)
    )
    qsl_cpu = torch.from_numpy(new_qsl)
    sub = CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device, non_blocking=True),
        seq_lens=common.seq_lens.index_select(0, idx),
        block_table=common.block_table.index_select(0, idx),
        slot_mapping=slot_mapping,
        num_reqs=len(req_idx),
        num_actual_tokens=num_tokens,
        max_query_len=int(qlens.max()) if len(qlens) else 0,
        max_seq_len=int(seq_lens_cpu.max()) if len(req_idx) else 0,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        causal=common.causal,
    )
    return sub, rows, start


class MLAMetadataBuilder(AttentionMetadataBuilder[MLAMetadata]):
    """The core's per-step builder of MLA models: splits the step into decode requests
    (``query_len == 1``) and prefill requests, and asks each phase backend's own builder
    for its metadata over its requests only.

    A pure-decode step (every request ``query_len == 1``, what CUDA graphs capture) hands
    the step's ``CommonAttentionMetadata`` unchanged to the decode builder (through
    ``build_for_cudagraph_capture`` when capturing or replaying), so that path needs no
    host work and no gathers.
    """

    def __init__(
        self,
        spec: AttentionLayerSpec,
        device: torch.device,
        max_num_blocks: int,
        decode_backend: type[AttentionBackend],
        prefill_backend: type[AttentionBackend],
    ) -> None:
        super().__init__(spec, device, max_num_blocks)
        self.dims = MLADims.from_spec(spec)
        decode_spec = AttentionLayerSpec(
            num_heads=spec.num_heads, num_kv_heads=1, head_size=self.dims.latent_size, dtype=spec.dtype,
            kv_cache_dtype=spec.kv_cache_dtype, block_size=spec.block_size, max_num_seqs=spec.max_num_seqs,
            max_model_len=spec.max_model_len, scale=spec.scale, extra=dict(spec.extra, mla_phase=MLA_DECODE),
        )  # fmt: skip
        prefill_spec = AttentionLayerSpec(
            num_heads=spec.num_heads, num_kv_heads=spec.num_heads, head_size=self.dims.qk_head_dim,
            dtype=spec.dtype, kv_cache_dtype=spec.kv_cache_dtype, block_size=spec.block_size,
            max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len, scale=spec.scale,
            extra=dict(spec.extra, mla_phase=MLA_PREFILL),
        )  # fmt: skip
        self.decode_builder = decode_backend.get_builder_cls()(decode_spec, device, max_num_blocks)
        self.prefill_builder = prefill_backend.get_builder_cls()(prefill_spec, device, max_num_blocks)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> MLAMetadata:
        if common.max_query_len != 1:
            raise ValueError(f"MLA CUDA graphs capture pure decode batches only (max_query_len {common.max_query_len})")
        md = self.decode_builder.build_for_cudagraph_capture(common)
        decode = MLAPhaseBatch(common, None, 0, common.num_reqs, md)
        return MLAMetadata(common.num_actual_tokens, common.slot_mapping, decode, None)

    def build(self, common: CommonAttentionMetadata) -> MLAMetadata:
        qsl = common.query_start_loc_cpu.numpy()
        qlens = qsl[1:] - qsl[:-1]
        if common.max_query_len <= 1:
            decode = MLAPhaseBatch(common, None, 0, common.num_reqs, self.decode_builder.build(common))
            return MLAMetadata(common.num_actual_tokens, common.slot_mapping, decode, None)
        is_decode = qlens == 1
        decode = prefill = None
        dec_idx = np.flatnonzero(is_decode)
        pre_idx = np.flatnonzero(~is_decode & (qlens > 0))
        if len(dec_idx):
            rows = qsl[dec_idx].astype(np.int64)
            sub, token_rows, start = _subset_common(common, dec_idx, rows, self.device)
            decode = MLAPhaseBatch(sub, token_rows, start, len(rows), self.decode_builder.build(sub))
        if len(pre_idx):
            rows = np.concatenate([np.arange(qsl[i], qsl[i + 1], dtype=np.int64) for i in pre_idx])
            sub, token_rows, start = _subset_common(common, pre_idx, rows, self.device)
            context_slots = self._context_slots(sub)
            prefill = MLAPrefillBatch(
                sub, token_rows, start, len(rows), self.prefill_builder.build(sub), context_slots=context_slots
            )
        return MLAMetadata(common.num_actual_tokens, common.slot_mapping, decode, prefill)

    def _context_slots(self, sub: CommonAttentionMetadata) -> torch.Tensor | None:
        """Cache slots of every position of each prefill request's sequence, when any
        request has cached context (prefix-cache hits, earlier chunks); else ``None``."""
        seq_lens = sub.seq_lens_cpu.numpy().astype(np.int64)
        if np.array_equal(seq_lens, sub.query_lens_cpu.numpy()):
            return None
        bs = self.spec.block_size
        req = np.repeat(np.arange(len(seq_lens)), seq_lens)
        starts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
        pos = np.arange(int(seq_lens.sum()), dtype=np.int64) - starts
        req_t = torch.from_numpy(req).to(self.device, non_blocking=True)
        pos_t = torch.from_numpy(pos).to(self.device, non_blocking=True)
        blocks = sub.block_table[req_t, pos_t // bs].to(torch.int64)
        return blocks * bs + pos_t % bs
