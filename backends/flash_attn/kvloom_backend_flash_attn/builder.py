"""Per-step metadata of FLASH_ATTN and its builder (pure torch; no flash_attn import).

The builder runs once per step, shared by all layers. It picks the kernel and hands the
layers the runner's device tensors, plus one derived tensor: ``cu_seqlens_k``, the
cumulative sequence lengths ``[0, s0, s0+s1, ...]`` that ``flash_attn_varlen_func``
takes. (vLLM passes ``seqused_k`` instead, an argument of its own flash-attn fork; the
released flash-attn 2.8.3's public ``flash_attn_varlen_func`` has no ``seqused_k``, and
with a ``block_table`` it reads each request's key length from ``cu_seqlens_k``.) It is
computed on the device with one ``cumsum``: no host synchronisation.

Kernel choice per step:

- ``max_query_len == 1`` (every request decodes one token) and the decode kernel is
  ``"kvcache"`` (the default): ``flash_attn_with_kvcache(q[B, 1, H, D], k_cache, v_cache,
  cache_seqlens=seq_lens, block_table=...)``;
- anything else, or decode kernel ``"varlen"``: ``flash_attn_varlen_func`` with
  ``cu_seqlens_q=query_start_loc``, ``cu_seqlens_k`` and the block table.

The decode kernel is a switch so both can be measured (``benchmarks/
bench_attention_kernels.py`` runs FLASH_ATTN once with each): ``spec.extra[
"flash_attn_decode_kernel"]``, else the environment variable
``KVLOOM_FLASH_ATTN_DECODE_KERNEL``, each ``"kvcache"`` or ``"varlen"``.

CUDA graphs (``UNIFORM_BATCH``). ``build_for_cudagraph_capture`` is called when the graph
of a batch size is captured and again before every replay. It writes ``cu_seqlens_k``
into one builder-owned buffer (sized from ``max_num_seqs``), so the captured kernels read
the current lengths from the same address at every replay, and fixes every launch
parameter from the batch shape and fixed limits: ``max_seqlen_k = max_model_len`` (not
the step's longest sequence, which changes between replays), ``max_seqlen_q`` = the
uniform query length, the query rows = batch size x query length.
``flash_attn_with_kvcache`` takes no host lengths at all (its split heuristic uses the
block table's width, which is fixed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvloom.interfaces import AttentionLayerSpec, AttentionMetadataBuilder, CommonAttentionMetadata

#: ``AttentionLayerSpec.extra`` key choosing the pure-decode kernel.
DECODE_KERNEL_EXTRA_KEY = "flash_attn_decode_kernel"
#: Environment variable choosing the pure-decode kernel when ``spec.extra`` does not.
DECODE_KERNEL_ENV = "KVLOOM_FLASH_ATTN_DECODE_KERNEL"
DECODE_KERNELS = ("kvcache", "varlen")
DEFAULT_DECODE_KERNEL = "kvcache"


def resolve_decode_kernel(spec: AttentionLayerSpec) -> str:
    """The pure-decode kernel for this builder: ``spec.extra``, the environment, the default."""
    if DECODE_KERNEL_EXTRA_KEY in spec.extra:
        value, source = spec.extra[DECODE_KERNEL_EXTRA_KEY], f'spec.extra["{DECODE_KERNEL_EXTRA_KEY}"]'
    elif os.environ.get(DECODE_KERNEL_ENV):
        value, source = os.environ[DECODE_KERNEL_ENV], DECODE_KERNEL_ENV
    else:
        return DEFAULT_DECODE_KERNEL
    if value not in DECODE_KERNELS:
        raise ValueError(
            f"{source}: {value!r} is not a FLASH_ATTN decode kernel (allowed: {', '.join(DECODE_KERNELS)})"
        )
    return value


@dataclass
class FlashAttentionMetadata:
    """What ``FlashAttentionImpl.forward`` needs for one step (shared by all layers)."""

    num_actual_tokens: int
    num_reqs: int
    #: Query rows the kernels compute: ``query_start_loc[num_reqs]`` (CUDA-graph filler
    #: requests included, token padding past it excluded).
    num_query_rows: int
    max_query_len: int  # max_seqlen_q
    max_seq_len: int  # max_seqlen_k (max_model_len for CUDA graphs)
    query_start_loc: torch.Tensor  # int32 [B + 1], device (cu_seqlens_q)
    seq_lens: torch.Tensor  # int32 [B], device (cache_seqlens)
    #: int32 [B + 1], device; ``None`` when the step uses ``flash_attn_with_kvcache``.
    cu_seqlens_k: torch.Tensor | None
    block_table: torch.Tensor  # int32 [B, max_blocks], device
    slot_mapping: torch.Tensor  # int64 [N], device
    #: This step is a pure decode run through ``flash_attn_with_kvcache``.
    decode_with_kvcache: bool
    causal: bool = True


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):

    def __init__(self, spec: AttentionLayerSpec, device: torch.device, max_num_blocks: int) -> None:
        super().__init__(spec, device, max_num_blocks)
        if spec.num_heads % spec.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({spec.num_heads}) must be a multiple of num_kv_heads ({spec.num_kv_heads})"
            )
        self.decode_kernel = resolve_decode_kernel(spec)
        # cu_seqlens_k of CUDA-graph batches: one persistent buffer, entry 0 stays 0.
        self._graph_cu_seqlens_k = torch.zeros(spec.max_num_seqs + 1, dtype=torch.int32, device=device)

    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        return self._build(common, for_cudagraph=False)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        rows = int(common.query_start_loc_cpu[common.num_reqs])
        if rows != common.num_reqs * common.max_query_len:
            raise ValueError(
                "FLASH_ATTN captures CUDA graphs only for uniform batches (every request with the same "
                "query length; cudagraph_support=UNIFORM_BATCH); got query lengths "
                f"{common.query_lens_cpu[: common.num_reqs].tolist()}"
            )
        if common.num_reqs > self.spec.max_num_seqs:
            raise ValueError(
                f"CUDA-graph batch size {common.num_reqs} out of range 1..{self.spec.max_num_seqs} (max_num_seqs)"
            )
        return self._build(common, for_cudagraph=True)

    def _build(self, common: CommonAttentionMetadata, for_cudagraph: bool) -> FlashAttentionMetadata:
        if not common.causal:
            raise ValueError("FLASH_ATTN computes causal (decoder) attention only; got causal=False")
        num_reqs = common.num_reqs
        seq_lens = common.seq_lens[:num_reqs]
        decode_with_kvcache = common.max_query_len == 1 and self.decode_kernel == "kvcache"
        cu_seqlens_k = None
        if not decode_with_kvcache:
            if for_cudagraph:
                cu_seqlens_k = self._graph_cu_seqlens_k[: num_reqs + 1]
            else:
                cu_seqlens_k = torch.zeros(num_reqs + 1, dtype=torch.int32, device=seq_lens.device)
            torch.cumsum(seq_lens, dim=0, dtype=torch.int32, out=cu_seqlens_k[1:])
        return FlashAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=num_reqs,
            num_query_rows=int(common.query_start_loc_cpu[num_reqs]),
            max_query_len=common.max_query_len,
            max_seq_len=self.spec.max_model_len if for_cudagraph else common.max_seq_len,
            query_start_loc=common.query_start_loc[: num_reqs + 1],
            seq_lens=seq_lens,
            cu_seqlens_k=cu_seqlens_k,
            block_table=common.block_table[:num_reqs],
            slot_mapping=common.slot_mapping,
            decode_with_kvcache=decode_with_kvcache,
            causal=common.causal,
        )
