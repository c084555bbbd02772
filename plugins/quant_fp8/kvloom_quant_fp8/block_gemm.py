"""The block-scaled fp8 GEMM (DeepSeek-V3 / Qwen3-FP8 checkpoints) in Triton, the CUDA path
of block-wise weights.

``out[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * x_scale[m, kb] * w_scale[n, kb]``: the
activation quantized per token and ``bi`` features (``ops.quantize_per_token_group``), the
weight per ``bo x bi`` block. Each K step of the kernel is one ``bi``-wide group, so the
fp8 product of a tile is exact in the float32 accumulator before the two scales multiply it.

The weight's block scales are expanded once at load to one row per output row
(``row_block_scales``): a merged layer's shards each start on a block row of their own,
so ``n // bo`` would not find a row's scale, and the expansion costs ``1/bi`` of the
weight's bytes in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom_quant_fp8 import ops

BLOCK_M = 16
BLOCK_N = 64


def row_block_scales(scale: torch.Tensor, shard_sizes: list[int], block_rows: int) -> torch.Tensor:
    """Block scales ``[sum(ceil(n / bo)), kb]`` (each shard on block rows of its own) -> one
    row of ``kb`` scales per output row, ``[sum(shard_sizes), kb]`` float32."""
    rows, start = [], 0
    for n in shard_sizes:
        count = ops.cdiv(n, block_rows)
        rows.append(scale[start : start + count].float().repeat_interleave(block_rows, dim=0)[:n])
        start += count
    return torch.cat(rows).contiguous()


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, num_groups,
    stride_xm, stride_wn, stride_om,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, GROUP):
        kb = k0 // GROUP
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        x_scale = tl.load(xs_ptr + rm * num_groups + kb, mask=m_ok, other=0.0)
        w_scale = tl.load(ws_ptr + rn * num_groups + kb, mask=n_ok, other=0.0)
        acc += tl.dot(x, w, out_dtype=tl.float32) * x_scale[:, None] * w_scale[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, row_scales: torch.Tensor, group: int) -> torch.Tensor:
    """``x [..., K]`` (the model dtype) times the fp8 ``weight [N, K]`` with ``row_scales
    [N, ceil(K / group)]``: the activation quantized per token and ``group`` features, the
    GEMM in the kernel; the result in ``x``'s dtype."""
    if group < 16 or group & (group - 1):
        raise ValueError(f"block-scaled fp8 GEMM: the K block must be a power of two >= 16, got {group}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    xq, x_scale = ops.quantize_per_token_group(x2, group)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        grid = (triton.cdiv(x2.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
        _fp8_block_gemm_kernel[grid](
            xq, x_scale, weight, row_scales, out, x2.shape[0], n, x_scale.shape[1],
            xq.stride(0), weight.stride(0), out.stride(0), K=k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP=group,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
