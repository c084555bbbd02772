"""Triton W4A16 GEMMs over ``layout.W4Tensors``: 4-bit weights dequantized in registers,
16-bit activations, tensor-core dots accumulating in float32.

* ``w4_linear(x [M, K], w) -> [M, N]``: a linear layer. A program computes a ``BLOCK_M x
  BLOCK_N`` tile over a slice of ``K``: at decode sizes (a few rows) the weight read is the
  whole cost, so ``K`` is split over ``SPLIT_K`` programs until the grid fills the GPU
  (partial sums in float32, added by each tile's last program: ``kvloom_platform_cuda.split_k``);
* ``w4_fused_moe(hidden, w13, w2, topk_weights, topk_ids)``: the ``fused_moe`` op with
  4-bit experts. The (token, expert) pairs are grouped by expert on the device
  (``kvloom_platform_cuda.fused_moe.moe_align``, no host synchronisation: CUDA graphs
  capture it) and each program multiplies ``BLOCK_M`` pairs of one expert by that
  expert's dequantized tile.

The dequantization of a ``BLOCK_K x BLOCK_N`` tile (``_w4_dot_tile``) loads ``BLOCK_N / 8``
words per row, each once (a load per nibble staged eight copies of every word through
shared memory: 116 KB per program, one program per SM, ~50 GB/s on an H200), expands each
to its eight nibbles in registers, and forms ``(q - zero) * scale``
(integers) or ``e2m1(q) * scale`` (MXFP4) in float32, rounded to the activation dtype
for the dot. Act-order weights gather the activation's columns through ``perm`` and the
scales through ``gidx``. Every launch parameter depends only on the shapes, so the ops
replay in CUDA graphs. Under ``TRITON_INTERPRET=1`` (the CPU tests) the dots run in
float32 (the interpreter multiplies bfloat16 as raw integers).

The launches depend on the row count, so the layers call both through opaque torch ops
(``torch.ops.kvloom_quant_int4.linear`` / ``.fused_moe``, a ``W4Tensors`` passed as its
tensors and sizes): under ``torch.compile`` Dynamo records one node per call instead of
tracing the dispatch with the first trace's row count (the profile run's thousands of
tokens would fix the launch of every decode step), and each CUDA graph captures the
kernels of its own size.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from kvloom_platform_cuda.split_k import split_k_buffers, store_split_k

from kvloom.interfaces import k_splits
from kvloom_quant_int4.layout import W4Tensors

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _w4_dot_tile(
    acc,
    x_rows,
    row_ok,
    perm_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
    k0,
    offs_n,
    n_ok,
    N,
    K,
    stride_qk,
    stride_sg,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    E2M1: tl.constexpr,
    SCALE_ROW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """``acc`` plus one K tile of the product: the activations at the row pointers
    ``x_rows`` (rows ``row_ok``), columns ``perm[k0 ..]`` (act-order) or ``k0 ..``, times
    the dequantized float32 ``[BLOCK_K, BLOCK_N]`` weight tile of rows ``k0 ..`` (of the
    sorted K) and columns ``offs_n`` (starting on a multiple of BLOCK_N, itself a multiple
    of 8); rows and columns out of range are zero."""
    rows = k0 + tl.arange(0, BLOCK_K)
    k_ok = rows < K
    if HAS_PERM:
        cols = tl.load(perm_ptr + rows, mask=k_ok, other=0)
    else:
        cols = rows
    a = tl.load(x_rows[:, None] + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    # Each word once ([BLOCK_K, BLOCK_N / 8], coalesced along the row), its eight nibbles
    # unpacked in registers: nibble j of word w is column 8 w + j.
    words_n = tl.min(offs_n, axis=0) // 8 + tl.arange(0, BLOCK_N // 8)  # from the tile's first column
    word_ok = words_n < (N + 7) // 8
    words = tl.load(qw_ptr + rows[:, None] * stride_qk + words_n[None, :], mask=k_ok[:, None] & word_ok[None, :],
                    other=0)  # fmt: skip
    nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N))
    if SCALE_ROW:  # the whole tile is in one group (GROUP % BLOCK_K == 0, no act-order)
        # A split's last tile may start past K (K tiles not a multiple of SPLIT_K): its scale row
        # does not exist, and a scale read past the end times a zero activation can be NaN.
        group = k0 // GROUP
        scale_ok = n_ok & (k0 < K)
        scale = tl.load(s_ptr + group * stride_sg + offs_n, mask=scale_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_ZEROS:
            zero = tl.load(z_ptr + group * stride_sg + offs_n, mask=scale_ok, other=0).to(tl.float32)[None, :]
    else:
        if HAS_PERM:  # act-order: each row's group from gidx
            group = tl.load(gidx_ptr + rows, mask=k_ok, other=0)
        else:
            group = rows // GROUP
        ok = k_ok[:, None] & n_ok[None, :]
        at = group[:, None] * stride_sg + offs_n[None, :]
        scale = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + at, mask=ok, other=0).to(tl.float32)
    if E2M1:
        exponent = (q >> 1) & 3
        mantissa = (q & 1).to(tl.float32)
        normal = ((2 + (q & 1)) << exponent).to(tl.float32) * 0.25
        magnitude = tl.where(exponent == 0, mantissa * 0.5, normal)
        value = tl.where((q & 8) != 0, -magnitude, magnitude)
    elif HAS_ZEROS:
        value = q.to(tl.float32) - zero
    else:
        value = q.to(tl.float32) - 8.0
    w = value * scale
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _w4_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    gidx_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_om,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    E2M1: tl.constexpr,
    SCALE_ROW: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K): ``out[m, n] = sum over k of
    x[m, perm[k]] * w[k, n]``, split ``s`` summing the K tiles s, s + SPLIT_K, ...
    (``store_split_k`` adds the splits)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m * stride_xm
    K_TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    for i in range((K_TILES + SPLIT_K - 1) // SPLIT_K):
        k0 = (i * SPLIT_K + pid_k) * BLOCK_K
        acc = _w4_dot_tile(acc, x_rows, m_ok, perm_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, k0, offs_n, n_ok, N, K,
                           stride_qk, stride_sg, GROUP, HAS_ZEROS, HAS_PERM, E2M1, SCALE_ROW, DOT_PRECISION,
                           BLOCK_K, BLOCK_N, INTERPRET)  # fmt: skip
    store_split_k(acc, out_ptr, part_ptr, counter_ptr, offs_m, offs_n, M, N, stride_om, SPLIT_K)


@triton.jit
def _w4_moe_kernel(
    a_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    gidx_ptr,
    c_ptr,
    w_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    N,
    num_pairs,
    stride_am,
    stride_qe,
    stride_qk,
    stride_se,
    stride_sg,
    stride_pe,
    stride_cm,
    K: tl.constexpr,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    E2M1: tl.constexpr,
    SCALE_ROW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (blocks * cdiv(N, BLOCK_N),): ``c[p, n] = sum_k a[p // A_ROW_DIV, perm_e[k]] *
    w_e[k, n]`` (times ``w[p]`` with MUL_WEIGHT) for the BLOCK_M pairs of one block of the
    sorted layout, all of expert ``e``; sentinel rows are neither read nor written."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pairs < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    qw = qw_ptr + expert * stride_qe
    scales = s_ptr + expert * stride_se
    zeros = z_ptr + expert * stride_se
    perm = perm_ptr + expert * stride_pe
    gidx = gidx_ptr + expert * stride_pe
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = a_ptr + a_rows * stride_am
    for k0 in range(0, K, BLOCK_K):
        acc = _w4_dot_tile(acc, x_rows, row_ok, perm, qw, scales, zeros, gidx, k0, offs_n, n_ok, N, K,
                           stride_qk, stride_sg, GROUP, HAS_ZEROS, HAS_PERM, E2M1, SCALE_ROW, DOT_PRECISION,
                           BLOCK_K, BLOCK_N, INTERPRET)  # fmt: skip
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(OUT_DTYPE), mask=row_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------- launch


def _block_k(w: W4Tensors, preferred: int) -> tuple[int, bool]:
    """``(BLOCK_K, SCALE_ROW)``: a tile within one group reads one scale row."""
    if w.gidx is None and w.group_size % preferred == 0:
        return preferred, True
    for block in (64, 32, 16):
        if w.gidx is None and w.group_size % block == 0 and block <= preferred:
            return block, True
    return preferred, False


def _flags(w: W4Tensors) -> dict[str, object]:
    return {"GROUP": w.group_size, "HAS_ZEROS": w.zeros is not None, "HAS_PERM": w.perm is not None,
            "E2M1": w.e2m1}  # fmt: skip


def _dot_precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def check_inputs(x: torch.Tensor, w: W4Tensors) -> None:
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"the activation must be float16, bfloat16 or float32, got {x.dtype}")
    if x.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"the 4-bit kernels run on CUDA tensors (got {x.device}), or under TRITON_INTERPRET=1")
    if x.shape[-1] != w.k:
        raise ValueError(f"the activation has {x.shape[-1]} features, the weight {w.k}")


def w4_linear(x: torch.Tensor, w: W4Tensors) -> torch.Tensor:
    """``x [M, K] @ dequantize(w).T -> [M, N]`` in ``x``'s dtype."""
    check_inputs(x, w)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], w.n
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if m <= 16:
        block_m, block_n, preferred_k, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        block_m, block_n, preferred_k, warps, stages = 32, 64, 64, 4, 4
    else:
        block_m, block_n, preferred_k, warps, stages = 64, 128, 64, 8, 3
    block_k, scale_row = _block_k(w, preferred_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(w.k, block_k)
    # Split K until the grid covers the GPU about twice (a decode step's GEMMs have few tiles).
    split = k_splits(tiles, k_tiles, x.device, waves=2) if m <= 64 else 1
    split, partials, counters = split_k_buffers(m, n, split, tiles, x.device)
    zeros = w.zeros if w.zeros is not None else w.scales
    perm = w.perm if w.perm is not None else w.qweight
    gidx = w.gidx if w.gidx is not None else w.qweight
    launch = {} if _INTERPRET else {"num_warps": warps, "num_stages": stages}
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _w4_gemm_kernel[grid](
        x, w.qweight, w.scales, zeros, perm, gidx, out, partials, counters, m, n,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        K=w.k, **_flags(w), SCALE_ROW=scale_row, SPLIT_K=split, DOT_PRECISION=_dot_precision(x),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INTERPRET=_INTERPRET, **launch,
    )  # fmt: skip
    return out


def _moe_gemm(a: torch.Tensor, w: W4Tensors, c: torch.Tensor, weights: torch.Tensor | None, align: object,
              num_pairs: int, a_row_div: int) -> None:  # fmt: skip
    block_m = align.block_m  # type: ignore[attr-defined]
    block_n = 64 if block_m <= 16 else 128
    block_k, scale_row = _block_k(w, 64)
    blocks = align.block_expert.numel()  # type: ignore[attr-defined]
    zeros = w.zeros if w.zeros is not None else w.scales
    perm = w.perm if w.perm is not None else w.qweight
    gidx = w.gidx if w.gidx is not None else w.qweight
    launch = {} if _INTERPRET else {"num_warps": 4 if block_m <= 32 else 8, "num_stages": 3}
    _w4_moe_kernel[(blocks * triton.cdiv(w.n, block_n),)](
        a, w.qweight, w.scales, zeros, perm, gidx, c, weights if weights is not None else c,
        align.sorted_ids, align.block_expert, align.num_padded, w.n, num_pairs,  # type: ignore[attr-defined]
        a.stride(0), w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1),
        perm.stride(0) if w.perm is not None else 0, c.stride(0),
        K=w.k, A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, OUT_DTYPE=_TL_DTYPES[c.dtype], **_flags(w),
        SCALE_ROW=scale_row, DOT_PRECISION=_dot_precision(a), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRET=_INTERPRET, **launch,
    )  # fmt: skip


def w4_fused_moe(
    hidden: torch.Tensor, w13: W4Tensors, w2: W4Tensors, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The ``fused_moe`` op (``kvloom.interfaces.fused_moe_torch``'s arithmetic) with 4-bit
    experts ``w13 [E, K=H, 2I]`` and ``w2 [E, K=I, H]`` (``W4Tensors`` with an experts dim):
    the gate/up output and the activation rounded to the model dtype, the down projection
    times the routing weight in float32, summed over each token's experts, rounded once."""
    try:
        from kvloom_platform_cuda.fused_moe import moe_align, moe_block_config
    except ImportError as exc:  # pragma: no cover - the CUDA platform ships with every CUDA install
        raise RuntimeError("4-bit experts on CUDA group tokens by expert with the CUDA platform's kernels: "
                           "pip install kvloom-platform-cuda") from exc  # fmt: skip
    check_inputs(hidden, w13)
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    num_experts = w13.qweight.shape[0]
    align = moe_align(topk_ids, num_experts, moe_block_config(num_pairs, num_experts))
    inter = w13.n // 2
    gate_up = torch.empty((num_pairs, 2 * inter), dtype=hidden.dtype, device=hidden.device)
    _moe_gemm(hidden, w13, gate_up, None, align, num_pairs, a_row_div=top_k)
    act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()
    down = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    _moe_gemm(act, w2, down, topk_weights.contiguous(), align, num_pairs, a_row_div=1)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


# --------------------------------------------------------------------------- opaque ops


def _w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, perm: torch.Tensor | None,
        gidx: torch.Tensor | None, sizes: list[int]) -> W4Tensors:  # fmt: skip
    group_size, n, e2m1 = sizes
    return W4Tensors(qweight, scales, zeros, perm, gidx, group_size=group_size, n=n, e2m1=bool(e2m1))


def op_args(w: W4Tensors) -> tuple[object, ...]:
    """``w`` as the arguments of the opaque ops: its five tensors (None where absent) and its sizes."""
    return w.qweight, w.scales, w.zeros, w.perm, w.gidx, [w.group_size, w.n, int(w.e2m1)]


@torch.library.custom_op("kvloom_quant_int4::linear", mutates_args=())
def linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              perm: torch.Tensor | None, gidx: torch.Tensor | None, sizes: list[int]) -> torch.Tensor:  # fmt: skip
    """``w4_linear`` of the ``W4Tensors`` given by ``op_args``."""
    return w4_linear(x, _w4(qweight, scales, zeros, perm, gidx, sizes))


@linear_op.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
      perm: torch.Tensor | None, gidx: torch.Tensor | None, sizes: list[int]) -> torch.Tensor:  # fmt: skip
    return x.new_empty((x.shape[0], sizes[1]))


@torch.library.custom_op("kvloom_quant_int4::fused_moe", mutates_args=())
def fused_moe_op(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_qweight: torch.Tensor, w13_scales: torch.Tensor, w13_zeros: torch.Tensor | None,
    w13_perm: torch.Tensor | None, w13_gidx: torch.Tensor | None, w13_sizes: list[int],
    w2_qweight: torch.Tensor, w2_scales: torch.Tensor, w2_zeros: torch.Tensor | None,
    w2_perm: torch.Tensor | None, w2_gidx: torch.Tensor | None, w2_sizes: list[int],
) -> torch.Tensor:  # fmt: skip
    """``w4_fused_moe`` of the two ``W4Tensors`` given by ``op_args``."""
    w13 = _w4(w13_qweight, w13_scales, w13_zeros, w13_perm, w13_gidx, w13_sizes)
    w2 = _w4(w2_qweight, w2_scales, w2_zeros, w2_perm, w2_gidx, w2_sizes)
    return w4_fused_moe(hidden, w13, w2, topk_weights, topk_ids)


@fused_moe_op.register_fake
def _(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *w13_and_w2: object) -> torch.Tensor:
    return torch.empty_like(hidden)
