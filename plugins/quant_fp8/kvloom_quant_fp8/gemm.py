"""The fp8 W8A8 GEMM on CUDA: the activation quantized by a Triton kernel, then a Triton
GEMM with split K at decode sizes, or ``torch._scaled_mm`` for many rows of per-tensor /
per-channel weights.

``out[m, n] = sum_k xq[m, k] * wq[n, k] * x_scale[m, g(k)] * w_scale[n, g(k)]``, where the
scales are per row (``group == 0``: per-token or static activations, per-tensor or
per-channel weights, one scale per row on each side) or per ``group`` features
(block-wise checkpoints: the activation per token and 1 x ``group``, the weight per
``bo x group`` block, expanded at load to one row of scales per output row by
``row_block_scales``). Each K tile of the grouped kernel is one group, so the fp8 product
of a tile is exact in the float32 accumulator before the two scales multiply it.

At decode sizes (a few rows) a step's GEMMs only stream their weights: the kernel splits K
over programs until the grid covers the GPU, which cuBLAS's fp8 kernels do not do for a
handful of rows, and the last program of each output tile adds the float32 partial sums
(``kvloom_platform_cuda.split_k``: no second kernel). Quantizing the activation inside the
GEMM instead of in its own kernel was measured slower on an H200 (a per-token scale needs a
first pass over the row; a quantized tile is divisions on every program's critical path:
docs/benchmarks/quantization_h200.md), so the quantizer stays a kernel of its own. The
launch depends on the row count, so the whole GEMM is one opaque torch op
(``torch.ops.kvloom_quant_fp8.linear``): under ``torch.compile`` Dynamo records a node
instead of tracing the dispatch with the first trace's row count, and each CUDA graph
captures the kernels of its own size.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from kvloom_platform_cuda.split_k import split_k_buffers, store_split_k

from kvloom.interfaces import k_splits
from kvloom_quant_fp8 import ops

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: From this many rows per-tensor / per-channel weights run torch._scaled_mm (a compute-bound
#: GEMM, cuBLAS's tiles); below it the split-K Triton GEMM (a weight stream).
SCALED_MM_MIN_ROWS = 65


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
def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, stride_qm, num_groups,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr):  # fmt: skip
    """Grid (M, num_groups): ``q[m, g-th GROUP features] = fp8(x / scale)`` with ``scale =
    max(amax, MIN_AMAX) / 448`` of those features (or the static scale), stored in ``s[m, g]``
    -- ``ops.quantize_per_token(_group)``'s arithmetic."""
    m = tl.program_id(0)
    g = tl.program_id(1)
    k = g * GROUP + tl.arange(0, BLOCK)
    ok = (k < K) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + m * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + m * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + m * num_groups + g, scale)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, counter_ptr, M, N, num_groups, stride_xm, stride_wn, stride_om,
    K: tl.constexpr, GROUPED: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K): ``out[m, n]`` = the scaled product,
    split ``s`` summing the K tiles s, s + SPLIT_K, ... (``store_split_k`` adds the splits);
    with GROUPED each tile is one scale group (BLOCK_K == group), else the row scales
    multiply the sum once."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    K_TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    for i in range((K_TILES + SPLIT_K - 1) // SPLIT_K):
        k0 = (i * SPLIT_K + pid_k) * BLOCK_K
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if INTERPRET:  # the interpreter has no fp8 dot
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w, out_dtype=tl.float32)
        if GROUPED:
            kb = k0 // BLOCK_K
            x_scale = tl.load(xs_ptr + rm * num_groups + kb, mask=m_ok & (k0 < K), other=0.0)
            w_scale = tl.load(ws_ptr + rn * num_groups + kb, mask=n_ok & (k0 < K), other=0.0)
            acc += part * x_scale[:, None] * w_scale[None, :]
        else:
            acc += part
    if not GROUPED:
        acc = acc * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None] * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    store_split_k(acc, out_ptr, part_ptr, counter_ptr, rm, rn, M, N, stride_om, SPLIT_K)


def quantize_activation(x: torch.Tensor, group: int, static_scale: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``x [M, K]`` -> ``(fp8 [M, K], float32 scales [M, G])``: per row (``group == 0``, G = 1;
    the static scale on every row when given) or per row and ``group`` features."""
    m, k = x.shape
    width = group or k
    groups = ops.cdiv(k, width)
    q = torch.empty((m, k), dtype=ops.FP8, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        static = static_scale if static_scale is not None else scales
        launch = {} if _INTERPRET else {"num_warps": 4 if width <= 1024 else 8}
        _quantize_kernel[(m, groups)](x, q, scales, static, k, x.stride(0), q.stride(0), groups, GROUP=width,
                                      BLOCK=triton.next_power_of_2(width), STATIC=static_scale is not None,
                                      **launch)  # fmt: skip
    return q, scales


#: A launch of the GEMM: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, waves), waves = how
#: many times over the grid should cover the GPU's SMs when K is split (decode sizes).
Config = tuple[int, int, int, int, int, int]


def gemm_config(m: int, grouped: bool, group: int) -> Config:
    """The launch for ``m`` rows: the fastest of benchmarks/bench_quant_gemm.py --sweep on an H200
    over the Llama-3-8B layers (docs/benchmarks/quantization_h200.md)."""
    if m <= 16:
        return (16, 64, group, 4, 4, 2) if grouped else (16, 64, 512, 4, 3, 1)
    if m <= 64:
        return (64, 128, group, 4, 4, 1) if grouped else (64, 64, 256, 4, 3, 1)
    return 64, 64, group if grouped else 128, 4, 4, 1


def fp8_gemm(xq: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor,
             out_dtype: torch.dtype, group: int, config: Config | None = None) -> torch.Tensor:  # fmt: skip
    """The Triton GEMM of quantized rows ``xq [M, K]`` (scales ``[M, G]``) and the fp8 ``weight
    [N, K]`` (scales ``[N, G]``; G = 1 when ``group == 0``) -> ``[M, N]`` in ``out_dtype``;
    ``config`` overrides ``gemm_config`` (benchmarks)."""
    m, k = xq.shape
    n = weight.shape[0]
    grouped = group > 0
    block_m, block_n, block_k, warps, stages, waves = config or gemm_config(m, grouped, group)
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    # Split K until the grid covers the GPU `waves` times (a decode step's GEMMs have few tiles).
    split = k_splits(grid_m * grid_n, triton.cdiv(k, block_k), xq.device, waves) if m <= 64 else 1
    split, partials, counters = split_k_buffers(m, n, split, grid_m * grid_n, xq.device)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    launch = {} if _INTERPRET else {"num_warps": warps, "num_stages": stages}
    _fp8_gemm_kernel[(grid_m, grid_n, split)](
        xq, x_scales, weight, w_scales, out, partials, counters, m, n, x_scales.shape[1], xq.stride(0),
        weight.stride(0), out.stride(0), K=k, GROUPED=grouped, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, INTERPRET=_INTERPRET, **launch,
    )  # fmt: skip
    return out


def _check(group: int) -> None:
    if group and (group < 16 or group & (group - 1)):
        raise ValueError(f"fp8 GEMM: the K block must be a power of two >= 16, got {group}")


@torch.library.custom_op("kvloom_quant_fp8::linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor, group: int,
               static_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``x [M, K]`` (the model dtype) times the fp8 ``weight [N, K]`` with ``w_scales`` (``[N]``
    per row when ``group == 0``, else ``[N, ceil(K / group)]``): the activation quantized
    per token (or by ``static_scale``, or per token and ``group`` features), the product in
    ``x``'s dtype."""
    _check(group)
    x = x if x.stride(-1) == 1 else x.contiguous()
    xq, x_scales = quantize_activation(x, group, static_scale)
    if group == 0 and x.shape[0] >= SCALED_MM_MIN_ROWS and not _INTERPRET:
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scales, scale_b=w_scales.reshape(1, -1), out_dtype=x.dtype,
                                use_fast_accum=True)  # fmt: skip
    return fp8_gemm(xq, x_scales, weight, w_scales.reshape(weight.shape[0], -1), x.dtype, group)


@fp8_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor, group: int,
      static_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    return x.new_empty((x.shape[0], weight.shape[0]))
