"""Triton kernels for the batched LoRA update (punica's "bgmv" scheme, written anew):
the CUDA platform's ``lora_delta`` custom op (``kvloom.layers.custom_ops``), which
replaces the torch code of ``kvloom.lora.ops`` for every model dtype when LoRA is on.

Two kernels, one program per (token, output tile):

* shrink: ``tmp[t, r] = sum_k x[t, k] * A[slot[t], r, k]`` in float32;
* expand: ``y[t, n] += sum_r tmp[t, r] * B[slot[t], n, r]``.

Tokens with slot 0 (no adapter) load and store nothing. The slot of each token is read
on the device, so the launch is the same for every batch of a given size (CUDA-graph
safe). The layer sizes are compile-time constants (a model has a handful of shapes).
The kernels are checked on the CPU under ``TRITON_INTERPRET=1`` by
``platforms/cuda/tests/test_lora_ops.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from kvloom.interfaces import LoRAMapping

__all__ = ["lora_delta", "lora_delta_triton"]


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, tmp_ptr,
    stride_xm, stride_as, stride_ar, stride_tm,
    K: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    active = slot > 0
    mask_r = offs_r < R
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = (offs_k < K) & active
        xk = tl.load(x_ptr + t * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
            mask=mask_r[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(tmp_ptr + t * stride_tm + offs_r, acc, mask=mask_r)


@triton.jit
def _lora_expand_kernel(
    tmp_ptr, b_ptr, slots_ptr, y_ptr,
    stride_tm, stride_bs, stride_bn, stride_ym,
    N: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    active = slot > 0
    mask_n = (offs_n < N) & active
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = (offs_r < R) & active
        tr = tl.load(tmp_ptr + t * stride_tm + offs_r, mask=mask_r, other=0.0)
        b = tl.load(
            b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
            mask=mask_n[:, None] & mask_r[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(b * tr[None, :], axis=1)
    y_ptrs = y_ptr + t * stride_ym + offs_n
    y = tl.load(y_ptrs, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask_n)


def lora_delta_triton(
    x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """``y`` (updated in place and returned) plus each token's adapter update.

    ``x [T, in]``, ``y [T, out]``, ``lora_a [S, R, in]``, ``lora_b [S, out, R]``,
    ``token_slots [T]`` (int32/int64, 0 = no adapter); ``x``/``y`` may have more rows."""
    num_tokens = token_slots.shape[0]  # rows past it (padding) are left as they are
    k = x.shape[1]
    r = lora_a.shape[1]
    n = y.shape[1]
    if num_tokens == 0:
        return y
    x = x.contiguous()
    y = y.contiguous()
    lora_a = lora_a.contiguous()
    lora_b = lora_b.contiguous()
    tmp = torch.empty(num_tokens, r, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(min(r, 64)))
    _lora_shrink_kernel[(num_tokens, triton.cdiv(r, block_r))](
        x, lora_a, token_slots, tmp,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), tmp.stride(0),
        K=k, R=r, BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    block_n = 64
    _lora_expand_kernel[(num_tokens, triton.cdiv(n, block_n))](
        tmp, lora_b, token_slots, y,
        tmp.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        N=n, R=r, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
    return y


def lora_delta(
    x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: "LoRAMapping"
) -> torch.Tensor:
    """The ``lora_delta`` custom op: each token's slot is read on the device
    (``mapping.token_slots``), so one launch serves any mix of adapters."""
    return lora_delta_triton(x, y, lora_a, lora_b, mapping.token_slots)
