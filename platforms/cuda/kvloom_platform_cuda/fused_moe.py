"""The ``fused_moe`` custom op on CUDA: grouped-GEMM Triton kernels over all experts.

The torch path (``kvloom.layers.fused_moe.fused_moe_torch``) runs three GEMMs per expert
that has tokens, after reading the group sizes on the host: at decode batch sizes a layer
of DeepSeek-V2-Lite (64 experts, top-6) launches a few hundred small kernels and cannot be
captured in a CUDA graph. Here a layer is:

1. **alignment** (``moe_align``: three small Triton kernels, no host synchronisation): the
   ``T * k`` (token, slot) pairs sorted by expert, each expert's group padded to a
   multiple of the block size ``BLOCK_M`` with a sentinel, and the expert of every block
   of ``BLOCK_M`` rows; sizes are upper bounds known on the host, the real length
   (``num_padded``) stays on the device;
2. **one Triton grouped GEMM for gate/up**: a program tile takes ``BLOCK_M`` sorted
   pairs (all of one expert) and ``BLOCK_N`` output columns, gathers the tokens' hidden
   rows and multiplies them by that expert's ``w13`` rows: ``[T * k, 2I]``;
3. ``silu_and_mul`` (``kvloom_platform_cuda.fused_ops``, bit-identical to torch's);
4. **one Triton grouped GEMM for down**, which also multiplies each row by its routing
   weight (in float32): ``[T * k, H]`` float32;
5. the sum over the ``k`` slots of each token, in float32, rounded once to the model dtype.

GEMMs accumulate in float32 (``tl.dot``); the gate/up output and the activation are
rounded to the model dtype as torch's GEMM outputs are. Blocks past ``num_padded`` return
at once, so the grid can be sized for the worst case and the op replays in a CUDA graph.

Inputs: ``hidden [T, H]`` float16/bfloat16 (float32 works too, with IEEE-precision dots),
``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in the same dtype, ``topk_weights [T, k]`` float32,
``topk_ids [T, k]`` int32 with values in ``[0, E)`` (not checked: that would read them on
the host). Outputs are new tensors; inputs are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvloom_platform_cuda.fused_ops import _INTERPRET, _TL_DTYPES, silu_and_mul

__all__ = ["MoEAlignment", "fused_moe", "moe_align", "moe_align_torch", "moe_block_config"]


@dataclass(frozen=True)
class MoEAlignment:
    """The (token, slot) pairs grouped by expert, in blocks of ``block_m`` rows.

    ``sorted_ids [max_padded]`` int32: flat pair indices ``token * k + slot`` sorted by
    expert, each expert's group padded to a multiple of ``block_m`` with ``T * k`` (the
    sentinel); ``block_expert [max_padded / block_m]`` int32: the expert of each block;
    ``num_padded [1]`` int32: how many entries of ``sorted_ids`` are in use (the rest,
    and the blocks there, are ignored)."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def _max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    # At most min(E, n) experts have pairs, each padded by at most block_m - 1 rows.
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """The alignment in torch ops (~30 small kernels; the reference ``moe_align`` is
    tested against): pairs sorted stably by expert, groups padded to ``block_m``."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(n, device=device) - count_start[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    max_padded = _max_padded(n, num_experts, block_m)
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    # The expert whose padded range holds the block's first row (empty experts have
    # start == end and are skipped by right=True); blocks past the end are never run.
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return MoEAlignment(sorted_ids, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32), block_m)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, E_BINS: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (cdiv(pairs, CHUNK),): counts[e] += pairs of expert e in this chunk."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts)  # masked -> bin E, never read
    bins = tl.arange(0, E_BINS)
    tl.atomic_add(counts_ptr + bins, tl.histogram(ids, E_BINS), mask=bins < num_experts)


@triton.jit
def _align_layout_kernel(
    counts_ptr, cursor_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, E_BINS: tl.constexpr, BLOCKS: tl.constexpr,
):
    """Grid (cdiv(num_blocks, BLOCKS),): from the counts, each program derives the padded
    layout (a scan over E), fills its BLOCKS blocks of sorted_ids with the sentinel and
    writes their experts; program 0 also writes num_padded and the experts' write cursors
    (the padded start of each group)."""
    bins = tl.arange(0, E_BINS)
    counts = tl.load(counts_ptr + bins, mask=bins < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    if tl.program_id(0) == 0:
        tl.store(cursor_ptr + bins, padded_end - padded, mask=bins < num_experts)
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    block_ok = blocks < num_blocks
    # The block's expert: how many experts' groups end at or before its first row
    # (empty groups end where they start and are skipped); past the end: clamped.
    ends = tl.where(bins < num_experts, padded_end, 2147483647)
    before = (ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32)
    expert = tl.minimum(tl.sum(before, axis=1), num_experts - 1)
    tl.store(block_expert_ptr + blocks, expert, mask=block_ok)
    rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids_ptr + rows, tl.full((BLOCKS, BLOCK_M), 0, tl.int32) + num_pairs, mask=block_ok[:, None])


@triton.jit
def _align_scatter_kernel(
    ids_ptr, cursor_ptr, scratch_ptr, sorted_ids_ptr, num_pairs, num_experts,
    E_BINS: tl.constexpr, CHUNK: tl.constexpr,
):
    """Grid (cdiv(pairs, CHUNK),): each pair's row in its expert's group. A chunk reserves
    its rows per expert with one atomic add on the cursors (chunks may take their turns
    in any order: each pair has its own output row, so the results do not depend on it),
    and ranks its pairs of the same expert in pair order."""
    pid = tl.program_id(0)
    idx = tl.arange(0, CHUNK)
    offs = pid * CHUNK + idx
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=num_experts)
    bins = tl.arange(0, E_BINS)
    base = tl.atomic_add(cursor_ptr + bins, tl.histogram(ids, E_BINS), mask=bins < num_experts)
    # Gather base[ids] through this program's scratch row (no register gather).
    tl.store(scratch_ptr + pid * E_BINS + bins, base, mask=bins < num_experts)
    tl.debug_barrier()
    start = tl.load(scratch_ptr + pid * E_BINS + ids, mask=ok, other=0)
    earlier_same = (ids[:, None] == ids[None, :]) & (idx[None, :] < idx[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    tl.store(sorted_ids_ptr + start + rank, offs, mask=ok)


#: Pairs per program of the alignment kernels (the rank is a CHUNK x CHUNK comparison).
_ALIGN_CHUNK = 64
#: Blocks per program of the layout kernel.
_ALIGN_BLOCKS = 16


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the pairs of ``topk_ids [T, k]`` by expert and pad each expert's group to a
    multiple of ``block_m``, on the device without reading anything back: three Triton
    kernels (count, layout, scatter) after one memset. Within an expert's group the pairs
    may come in another order than ``moe_align_torch``'s (chunks reserve rows atomically)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32 or not flat.is_contiguous():
        flat = flat.to(torch.int32).contiguous()
    n = flat.numel()
    max_padded = _max_padded(n, num_experts, block_m)
    num_blocks = max_padded // block_m
    e_bins = triton.next_power_of_2(num_experts + 1)  # + the bin of masked lanes
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    chunks = triton.cdiv(n, _ALIGN_CHUNK)
    scratch = torch.empty(chunks * e_bins, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _align_count_kernel[(chunks,)](flat, counts, n, num_experts, E_BINS=e_bins, CHUNK=_ALIGN_CHUNK)
    _align_layout_kernel[(triton.cdiv(num_blocks, _ALIGN_BLOCKS),)](
        counts, cursor, sorted_ids, block_expert, num_padded, n, num_experts, num_blocks,
        BLOCK_M=block_m, E_BINS=e_bins, BLOCKS=_ALIGN_BLOCKS,
    )  # fmt: skip
    _align_scatter_kernel[(chunks,)](flat, cursor, scratch, sorted_ids, n, num_experts, E_BINS=e_bins,
                                     CHUNK=_ALIGN_CHUNK)  # fmt: skip
    return MoEAlignment(sorted_ids, block_expert, num_padded, block_m)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    N, num_pairs,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    K: tl.constexpr, A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, OUT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (blocks * cdiv(N, BLOCK_N),): ``c[p, n] = sum_k a[p // A_ROW_DIV, k] * b[e, n, k]``
    (times ``w[p]`` with MUL_WEIGHT) for the BLOCK_M pairs ``p`` of one block of the sorted
    layout, all of expert ``e``; sentinel rows are neither read nor written. K (the hidden
    or intermediate size, two values per model) is a compile-time constant: a static trip
    count for the K loop (and the interpreter cannot loop to a runtime bound)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pairs < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if INTERPRET:
            # The interpreter's dot multiplies bfloat16 as raw integers; in float32 the
            # products of 16-bit values are exact, as in the tensor cores' fp32 accumulation.
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        w = tl.load(w_ptr + pairs, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(OUT_DTYPE), mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class _GemmConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_block_config(num_pairs: int, num_experts: int) -> int:
    """``BLOCK_M`` for ``num_pairs`` (token, slot) pairs over ``num_experts``: the
    smallest tile ``tl.dot`` takes (16) while experts hold few rows each (decode), larger
    once the average group fills it (prefill), so weights are read fewer times."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return 16
    if per_expert <= 48:
        return 32
    return 64


def _gemm_config(block_m: int) -> _GemmConfig:
    # Memory-bound at small block_m: narrow N tiles give more programs to stream the
    # weights with; wider tiles once the GEMM is compute-bound.
    if block_m <= 16:
        return _GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
    return _GemmConfig(block_n=128, block_k=64, num_warps=8 if block_m >= 64 else 4, num_stages=3)


def _check(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype | None, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of hidden), got {t.device}")


def _launch(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor | None, align: MoEAlignment,
    num_pairs: int, a_row_div: int,
) -> None:
    n, k = b.shape[1], b.shape[2]
    cfg = _gemm_config(align.block_m)
    blocks = align.block_expert.numel()
    grid = (blocks * triton.cdiv(n, cfg.block_n),)
    launch_opts = {} if _INTERPRET else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _moe_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, align.sorted_ids, align.block_expert, align.num_padded,
        n, num_pairs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        K=k, A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, OUT_DTYPE=_TL_DTYPES[c.dtype],
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=align.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, INTERPRET=_INTERPRET, **launch_opts,
    )  # fmt: skip


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ hidden[t])`` with
    ``e = topk_ids[t, j]``: the ``fused_moe`` custom op (see the module docstring)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a [tokens, hidden_size] tensor, got {getattr(hidden, 'shape', hidden)!r}")
    if hidden.dtype not in _TL_DTYPES:
        raise ValueError(f"hidden must be float16, bfloat16 or float32, got {hidden.dtype}")
    num_tokens, hidden_size = hidden.shape
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [experts, 2 * intermediate, hidden], got {getattr(w13, 'shape', w13)!r}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    _check("w13", w13, (num_experts, 2 * inter, hidden_size), hidden.dtype, hidden.device)
    _check("w2", w2, (num_experts, hidden_size, inter), hidden.dtype, hidden.device)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [tokens={num_tokens}, top_k], got {getattr(topk_ids, 'shape', topk_ids)!r}")
    top_k = topk_ids.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"topk_ids must have top_k in [1, experts={num_experts}] columns, got {top_k}")
    _check("topk_ids", topk_ids, (num_tokens, top_k), torch.int32, hidden.device)
    _check("topk_weights", topk_weights, (num_tokens, top_k), torch.float32, hidden.device)
    if hidden.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"hidden must be a CUDA tensor (got one on {hidden.device}); on the CPU the kernels run "
                         "only under TRITON_INTERPRET=1")  # fmt: skip
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    num_pairs = num_tokens * top_k
    align = moe_align(topk_ids, num_experts, moe_block_config(num_pairs, num_experts))
    gate_up = torch.empty((num_pairs, 2 * inter), dtype=hidden.dtype, device=hidden.device)
    _launch(hidden, w13, gate_up, None, align, num_pairs, a_row_div=top_k)
    act = silu_and_mul(gate_up)
    down = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    _launch(act, w2, down, topk_weights.contiguous(), align, num_pairs, a_row_div=1)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
