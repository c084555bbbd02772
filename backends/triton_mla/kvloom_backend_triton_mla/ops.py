"""Host-side launchers of the MLA Triton kernels: shapes in, grids and constexprs out.

Nothing here reads a device tensor's values or synchronises: grids depend on tensor shapes
and host integers (batch size, split count), so a decode launch can be captured in a CUDA
graph and replayed with new lengths and block tables written into the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.interfaces import (
    cdiv,
    check_launch_fields,
    min_split_tiles,
    next_power_of_2,
    parse_kernel_overrides,
    resolve_kernel_config,
)

LOG2_E = 1.4426950408889634
#: Smallest M, N and K of a ``tl.dot`` operand: head tiles, position tiles and head dims
#: are padded up to it.
MIN_DOT = 16
ENV_VAR = "KVLOOM_TRITON_MLA_CONFIG"


@dataclass(frozen=True)
class MLAKernelConfig:
    """Tiles and launch parameters of the MLA kernels.

    decode: a program owns ``decode_block_h`` heads of one request and one KV split and
    steps through it ``decode_block_n`` latent vectors at a time. The split count aims at
    one wave of ``programs_per_sm`` programs per SM (two fit an H100 SM at the default
    tiles: ~208 registers x 128 threads, 55 KiB of shared memory), never below
    ``min_split_tokens`` positions per split nor above ``max_splits``;
    ``force_num_splits`` pins it (tests, benchmarks).
    prefill: ``prefill_block_m`` query rows x ``prefill_block_n`` keys per step.
    """

    decode_block_h: int = 16
    decode_block_n: int = 32
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    programs_per_sm: int = 2
    min_split_tokens: int = 128
    max_splits: int = 64
    force_num_splits: int | None = None
    prefill_block_m: int = 64
    prefill_block_n: int = 32
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2

    def __post_init__(self) -> None:
        check_launch_fields(
            self, tiles=("decode_block_h", "decode_block_n", "prefill_block_m", "prefill_block_n"),
            tile_sizes=(16, 32, 64, 128), warps=("decode_num_warps", "prefill_num_warps"),
            stages=("decode_num_stages", "prefill_num_stages"),
            positive=("programs_per_sm", "min_split_tokens", "max_splits", "force_num_splits"),
        )  # fmt: skip


def default_config(dtype: torch.dtype) -> MLAKernelConfig:
    # fp32 dots run as FMA loops with 4-byte operands in registers: smaller position tiles.
    if dtype == torch.float32:
        return MLAKernelConfig(decode_block_n=16, decode_num_stages=1, prefill_block_m=32, prefill_block_n=16)
    return MLAKernelConfig()


def parse_overrides(text: str) -> dict[str, int | None]:
    """``"a=1,b=2"`` -> ``{"a": 1, "b": 2}`` for fields of ``MLAKernelConfig``
    (``KVLOOM_TRITON_MLA_CONFIG``'s syntax)."""
    return parse_kernel_overrides(text, MLAKernelConfig, ENV_VAR)


def resolve_config(
    dtype: torch.dtype, override: MLAKernelConfig | dict[str, int | None] | None = None
) -> MLAKernelConfig:
    """The default for ``dtype``, then ``KVLOOM_TRITON_MLA_CONFIG``, then ``override``."""
    if isinstance(override, MLAKernelConfig):
        return override
    return resolve_kernel_config(default_config(dtype), ENV_VAR, override)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 dots default to tf32 on tensor cores (~3e-4 relative error); "ieee" keeps fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _require_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {tensor.stride(-1)})")


def plan_num_kv_splits(
    num_reqs: int, num_heads: int, max_seq_len: int, num_sms: int, cfg: MLAKernelConfig
) -> int:
    """Split count for a decode launch of ``num_reqs`` requests.

    As many splits as fit ``programs_per_sm`` (request, head tile, split) programs per SM
    in one wave (rounded down: a second, partial wave of programs would cost as long as
    the first), no split shorter than ``min_split_tokens`` (the partial writes and the
    reduce must stay small next to the latent reads), at most ``max_splits``, at least 1.
    ``max_seq_len`` is the longest sequence the launch may meet: the step's longest
    eagerly, ``max_model_len`` for a CUDA graph (the kernel cuts each request's own
    length into that many splits, none shorter than ``min_split_tokens``:
    ``kvloom.interfaces.min_split_tiles``).
    """
    if cfg.force_num_splits is not None:
        return cfg.force_num_splits
    head_tiles = cdiv(num_heads, cfg.decode_block_h)
    fit = (cfg.programs_per_sm * num_sms) // max(1, num_reqs * head_tiles)
    return max(1, min(fit, cdiv(max(1, max_seq_len), cfg.min_split_tokens), cfg.max_splits))


def decode_workspace(
    num_reqs: int, num_heads: int, kv_lora_rank: int, num_kv_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial_out [B, H, S, L], partial_lse [B, H, S])``, float32, for ``mla_decode``."""
    return (
        torch.empty((num_reqs, num_heads, num_kv_splits, kv_lora_rank), dtype=torch.float32, device=device),
        torch.empty((num_reqs, num_heads, num_kv_splits), dtype=torch.float32, device=device),
    )


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_kv_splits: int,
    cfg: MLAKernelConfig,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over the paged latent cache; writes and returns ``out``.

    ``q_nope [B, H, L]``, ``q_pe [B, H, R]`` (views of one ``[B, H, L+R]`` query are fine),
    ``kv_cache [num_blocks, block_size, L + R]``, ``block_table`` int32 ``[>= B, max_blocks]``,
    ``seq_lens`` int32 ``[>= B]`` (each request's cached positions, its new token included),
    ``out [B, H, L]``. With ``num_kv_splits > 1`` the workspace (``decode_workspace``, at
    least ``B`` requests and exactly ``num_kv_splits`` splits) holds the partial results.
    """
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_nope [B, H, L] and q_pe [B, H, R] expected, got {tuple(q_nope.shape)} and "
                         f"{tuple(q_pe.shape)}")
    num_reqs, num_heads, kv_lora_rank = q_nope.shape
    rope_dim = q_pe.shape[2]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != kv_lora_rank + rope_dim:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, {kv_lora_rank + rope_dim}] "
                         f"(kv_lora_rank + rope dim), got {tuple(kv_cache.shape)}")
    if out.shape != (num_reqs, num_heads, kv_lora_rank):
        raise ValueError(f"out must be [{num_reqs}, {num_heads}, {kv_lora_rank}], got {tuple(out.shape)}")
    if q_nope.dtype != kv_cache.dtype or q_pe.dtype != kv_cache.dtype:
        raise ValueError(f"query ({q_nope.dtype}, {q_pe.dtype}) and kv_cache ({kv_cache.dtype}) dtypes must match")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if block_table.shape[0] < num_reqs or seq_lens.shape[0] < num_reqs:
        raise ValueError(f"block_table ({block_table.shape[0]} rows) and seq_lens ({seq_lens.shape[0]}) "
                         f"must cover the {num_reqs} requests")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("kv_cache", kv_cache), ("out", out)):
        _require_last_dim_contiguous(name, t)
    if num_reqs == 0:
        return out
    split = num_kv_splits > 1
    if split:
        if partial_out is None or partial_lse is None:
            partial_out, partial_lse = decode_workspace(num_reqs, num_heads, kv_lora_rank, num_kv_splits, q_nope.device)
        if (partial_out.shape[0] < num_reqs or partial_out.shape[1:] != (num_heads, num_kv_splits, kv_lora_rank)
                or partial_lse.shape[0] < num_reqs or partial_lse.shape[1:] != (num_heads, num_kv_splits)):
            raise ValueError(
                f"decode workspace {tuple(partial_out.shape)}/{tuple(partial_lse.shape)} does not fit "
                f"{num_reqs} requests x {num_heads} heads x {num_kv_splits} splits x {kv_lora_rank}"
            )
    else:
        # Never touched with SPLIT=False; any float32 tensors keep the signature uniform.
        partial_out, partial_lse = out, out
    from kvloom_backend_triton_mla.decode_kernels import mla_decode_kernel, mla_decode_reduce_kernel

    block_h = max(MIN_DOT, min(cfg.decode_block_h, next_power_of_2(num_heads)))
    block_l = max(MIN_DOT, next_power_of_2(kv_lora_rank))
    block_r = max(MIN_DOT, next_power_of_2(rope_dim))
    po_strides = (partial_out.stride(0), partial_out.stride(1), partial_out.stride(2)) if split else (0, 0, 0)
    pl_strides = (partial_lse.stride(0), partial_lse.stride(1)) if split else (0, 0)
    grid = (num_reqs, cdiv(num_heads, block_h), num_kv_splits)
    mla_decode_kernel[grid](
        q_nope, q_pe, kv_cache, out, partial_out, partial_lse, block_table, seq_lens,
        scale * LOG2_E, num_heads,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), *po_strides, *pl_strides,
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, PAGE_SIZE=kv_cache.shape[1], NUM_SPLITS=num_kv_splits,
        BLOCK_H=block_h, BLOCK_N=cfg.decode_block_n, BLOCK_L=block_l, BLOCK_R=block_r,
        SPLIT=split, DOT_PRECISION=_dot_precision(q_nope.dtype),
        MIN_SPLIT_TILES=min_split_tiles(cfg.min_split_tokens, cfg.decode_block_n, cfg.force_num_splits),
        num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages,
    )
    if split:
        mla_decode_reduce_kernel[(num_reqs, num_heads)](
            partial_out, partial_lse, out, *po_strides, *pl_strides, out.stride(0), out.stride(1),
            KV_LORA_RANK=kv_lora_rank, NUM_SPLITS=num_kv_splits, BLOCK_L=block_l,
            num_warps=4 if block_l >= 512 else 1,
        )
    return out


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    scale: float,
    cfg: MLAKernelConfig,
) -> torch.Tensor:
    """Causal varlen attention with ``q``/``k`` ``[*, H, Dqk]`` and ``v``/``out`` ``[*, H, Dv]``.

    Request ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; its queries are its last keys' positions (a key
    count larger than the query count is a cached prefix). ``max_query_len`` is a host
    integer bounding every request's query count (it sizes the grid). Returns ``out``.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or out.dim() != 3:
        raise ValueError("q, k, v and out must be [tokens, heads, dim]")
    num_heads, qk_dim = q.shape[1], q.shape[2]
    v_dim = v.shape[2]
    if k.shape[1:] != (num_heads, qk_dim) or v.shape[1] != num_heads or v.shape[0] != k.shape[0]:
        raise ValueError(f"k must be [*, {num_heads}, {qk_dim}] and v [k rows, {num_heads}, Dv]; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if out.shape[1:] != (num_heads, v_dim) or out.shape[0] < q.shape[0]:
        raise ValueError(f"out must be [>= {q.shape[0]}, {num_heads}, {v_dim}], got {tuple(out.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both be [num_reqs + 1]")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        _require_last_dim_contiguous(name, t)
    num_reqs = cu_seqlens_q.shape[0] - 1
    if num_reqs == 0 or max_query_len == 0:
        return out
    from kvloom_backend_triton_mla.prefill_kernels import varlen_causal_attention_kernel

    block_m = cfg.prefill_block_m
    grid = (cdiv(max_query_len, block_m), num_reqs, num_heads)
    varlen_causal_attention_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, scale * LOG2_E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        QK_DIM=qk_dim, V_DIM=v_dim, BLOCK_M=block_m, BLOCK_N=cfg.prefill_block_n,
        BLOCK_DQK=max(MIN_DOT, next_power_of_2(qk_dim)), BLOCK_DV=max(MIN_DOT, next_power_of_2(v_dim)),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.prefill_num_warps, num_stages=cfg.prefill_num_stages,
    )
    return out
