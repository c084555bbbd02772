"""Fused Triton kernels for the elementwise chains of a decode step on CUDA.

Why: in eager PyTorch every small op of a layer is its own CUDA kernel: RMSNorm alone is
about seven (cast, square, mean, add eps, rsqrt, multiply, cast, multiply by the weight),
SiLU-and-mul three, rotary embedding of query and key about twelve. A Llama-8B decode
step launches ~1,200 such kernels, and each costs ~2-3 µs even inside a CUDA graph, which
at small batch sizes is a large part of the step. Each function here is one kernel launch.

Exactness contract: for float16 and bfloat16 inputs the kernels repeat the rounding steps
of the native torch code (HF transformers' numerics) by casting to the input dtype
wherever torch stores an intermediate tensor in that dtype, and use the same fp32
arithmetic as torch's CUDA kernels (IEEE division, CUDA's ``expf``/``rsqrtf`` through
libdevice with denormals kept, no FMA contraction). Hence

* ``silu_and_mul`` and ``rotary_qk`` are bit-identical to the native torch ops on CUDA;
* ``qk_norm_rotary`` normalises each head as the norms below do (within two ulp) and
  rotates the normalised values exactly as ``rotary_qk``;
* ``rms_norm`` and ``fused_add_rms_norm`` sum the squares in another order than torch's
  reduction kernel, so the fp32 variance may differ in its last bit. After rounding to
  the 16-bit dtype the normalised value ``(x * rsqrt(var + eps)).to(dtype)`` is within one
  ulp of torch's; the multiplication by the weight can stretch that to two ulps of the
  output (one ulp of the normalised value times |weight| is under two ulps of the product
  before rounding). Nearly all elements are identical (>= 99.9% in the GPU tests). The
  residual sum of ``fused_add_rms_norm`` is bit-identical.

float32 inputs work too, but may differ from torch by fp32 rounding (the engine uses the
fused ops only for 16-bit dtypes). All functions return new tensors and leave their
inputs untouched. On the CPU the kernels run only in Triton's interpreter
(``TRITON_INTERPRET=1``, used by the tests), which has no libdevice: it then uses
``tl.exp``/``tl.math.rsqrt``/``tl.math.div_rn`` instead.
"""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["fused_add_rms_norm", "qk_norm_rotary", "rms_norm", "rotary_qk", "silu_and_mul"]

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# One program holds a whole row for the norms; past this the block would not fit in registers.
_MAX_NORM_BLOCK = 65536
# Elements per program for silu_and_mul (a row is split across programs) and for the
# rotary tile [heads, D // 2] (heads are split across programs beyond it).
_SILU_BLOCK = 1024
_ROTARY_TILE = 2048


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Decided once, like @triton.jit decides whether the kernels below are interpreted.
_INTERPRET = _interpreting()
# Compile options: no FMA contraction (torch's separate kernels round every product) and
# libdevice without flush-to-zero (torch's CUDA kernels keep denormals).
_LAUNCH_OPTS = {} if _INTERPRET else {"enable_fp_fusion": False, "enable_reflect_ftz": False}


# --------------------------------------------------------------------------- helpers


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """Round fp32 ``x`` to DTYPE (round-to-nearest-even) and widen it back to fp32: the
    rounding torch applies whenever it stores an intermediate in the model dtype."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    # CUDA's expf (what torch's silu calls); tl.exp would be the faster ex2.approx.
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _div(x, y, INTERPRET: tl.constexpr):
    # IEEE round-to-nearest division, as nvcc compiles ``/`` without fast math (Triton's
    # plain ``/`` on fp32 is the approximate div.full.f32).
    if INTERPRET:
        return tl.math.div_rn(x, y)
    else:
        return libdevice.div_rn(x, y)


@triton.jit
def _rsqrt(x, INTERPRET: tl.constexpr):
    # CUDA's rsqrtf (the approximate rsqrt instruction), which torch.rsqrt calls.
    if INTERPRET:
        return tl.math.rsqrt(x)
    else:
        return libdevice.rsqrt(x)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    x_row_stride, res_row_stride, H, inv_h, eps,
    HAS_RESIDUAL: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One program per row: out = weight * (x * rsqrt(mean(x^2) + eps)) in torch's roundings;
    with HAS_RESIDUAL, x is first replaced by x + residual (also stored to sum_ptr)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # torch: s = x + residual, computed in fp32 and stored in the model dtype.
        x = _round(x + r, DTYPE)
        tl.store(sum_ptr + row * H + cols, x.to(DTYPE), mask=mask)
    # torch: x32.pow(2).mean(-1) on CUDA = (sum of fp32 squares) * factor, where factor is
    # the fp32 value rows / numel computed on the host (inv_h). For 16-bit inputs the
    # squares are exact in fp32; only the summation order differs from torch's reduction.
    var = tl.sum(x * x, axis=0) * inv_h
    # torch: rsqrt(var + eps) in fp32 (eps arrives as fp32, as torch casts the scalar).
    r_std = _rsqrt(var + eps, INTERPRET)
    # torch: (x32 * rstd).to(input_dtype): one fp32 product, rounded to the model dtype.
    y = _round(x * r_std, DTYPE)
    # torch: weight * y with both in the model dtype: fp32 product (exact for 16-bit
    # inputs), rounded once to the model dtype on the store.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (w * y).to(DTYPE), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, x_row_stride, D,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (rows, cdiv(D, BLOCK)): out[row, j] = silu(x[row, j]) * x[row, D + j]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    base = x_ptr + row * x_row_stride
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + D + cols, mask=mask, other=0.0).to(tl.float32)
    # torch F.silu on 16-bit: x / (1 + expf(-x)) in fp32, stored in the model dtype.
    act = _round(_div(gate, 1.0 + _exp(-gate, INTERPRET), INTERPRET), DTYPE)
    # torch: act * up, fp32 product rounded once to the model dtype on the store.
    tl.store(out_ptr + row * D + cols, (act * up).to(DTYPE), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, qw_ptr, kw_ptr,
    x_tok_stride, x_head_stride, cos_tok_stride, cos_col_stride, sin_tok_stride, sin_col_stride,
    num_heads, num_q_heads, HALF, inv_q, inv_k, eps,
    NORM: tl.constexpr, DTYPE: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (tokens, cdiv(heads, HEADS_BLOCK)): rotate a [HEADS_BLOCK, D] tile of one token
    ("rotate half" layout) into the contiguous output [tokens, heads, 2 * HALF]. With NORM,
    each head is first RMS-normalised over its D values (weight qw_ptr on the first
    num_q_heads heads, kw_ptr on the rest), as ``rms_norm`` does a row."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)[:, None]
    cols = tl.arange(0, HALF_BLOCK)[None, :]
    col_mask = cols < HALF
    mask = (heads < num_heads) & col_mask
    cos = tl.load(cos_ptr + tok * cos_tok_stride + cols * cos_col_stride, mask=col_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * sin_tok_stride + cols * sin_col_stride, mask=col_mask, other=0.0).to(tl.float32)
    src = x_ptr + tok * x_tok_stride + heads * x_head_stride + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        # rms_norm per head, in torch's roundings (see _rms_norm_kernel): the fp32 sum of
        # squares times the host's mean factor, rsqrt, the normalised value rounded to
        # the model dtype, then the product with the weight rounded again.
        is_q = heads < num_q_heads
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1))[:, None] * tl.where(is_q, inv_q, inv_k)
        r_std = _rsqrt(var + eps, INTERPRET)
        qw1 = tl.load(qw_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        qw2 = tl.load(qw_ptr + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
        kw1 = tl.load(kw_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        kw2 = tl.load(kw_ptr + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
        x1 = _round(tl.where(is_q, qw1, kw1) * _round(x1 * r_std, DTYPE), DTYPE)
        x2 = _round(tl.where(is_q, qw2, kw2) * _round(x2 * r_std, DTYPE), DTYPE)
    # torch: every product is its own op stored in the model dtype, then the sum/difference
    # is computed in fp32 and rounded once more: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin.
    out1 = _round(x1 * cos, DTYPE) - _round(x2 * sin, DTYPE)
    out2 = _round(x2 * cos, DTYPE) + _round(x1 * sin, DTYPE)
    dst = out_ptr + tok * (num_heads * 2 * HALF) + heads * (2 * HALF) + cols
    tl.store(dst, out1.to(DTYPE), mask=mask)
    tl.store(dst + HALF, out2.to(DTYPE), mask=mask)


# --------------------------------------------------------------------------- validation


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _TL_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    return t


def _check_like(name: str, t: object, x: torch.Tensor) -> torch.Tensor:
    """``t`` is a tensor with x's dtype on x's device."""
    t = _check_tensor(name, t)
    if t.dtype != x.dtype:
        raise ValueError(f"{name} must have the dtype of x ({x.dtype}), got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on the device of x ({x.device}), got {t.device}")
    return t


def _check_device(x: torch.Tensor, name: str = "x") -> None:
    if x.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"{name} must be a CUDA tensor (got one on {x.device}); on the CPU the "
                         "kernels run only under TRITON_INTERPRET=1")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D [rows, last] view with unit column stride (a copy only when no such
    view of it exists)."""
    if t.dim() == 2 and t.stride(-1) == 1:
        return t
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims not mergeable into one row stride
        return t.contiguous().view(-1, t.shape[-1])


def _mean_factor(rows: int, hidden: int) -> float:
    """The fp32 factor torch's CUDA mean multiplies the sum by: float(rows) / float(numel).
    Double division then rounding to fp32 is correctly rounded (53 >= 2 * 24 + 2)."""
    f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]  # noqa: E731
    return f32(f32(float(rows)) / f32(float(rows * hidden)))


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 512))


# --------------------------------------------------------------------------- public ops


def _rms_norm_impl(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    if residual is not None:
        _check_like("residual", residual, x)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    _check_like("weight", weight, x)
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},) (the last dim of x), got {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    block = triton.next_power_of_2(hidden)
    if block > _MAX_NORM_BLOCK:
        raise ValueError(f"x's last dimension {hidden} is too large for the one-block norm kernel "
                         f"(at most {_MAX_NORM_BLOCK})")
    _check_device(x)

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    x2 = _rows(x)
    rows = x2.shape[0]
    if rows == 0:
        return out, summed
    r2 = _rows(residual) if residual is not None else x2
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    _rms_norm_kernel[(rows,)](
        x2, r2, w, out, summed if summed is not None else out,
        x2.stride(0), r2.stride(0), hidden, _mean_factor(rows, hidden), float(eps),
        HAS_RESIDUAL=residual is not None, DTYPE=_TL_DTYPES[x.dtype], BLOCK=block, INTERPRET=_INTERPRET,
        num_warps=_norm_warps(block), **_LAUNCH_OPTS,
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x [..., H]`` (rows may be strided), as HF's
    ``LlamaRMSNorm``::

        x32 = x.float(); var = x32.pow(2).mean(-1, keepdim=True)
        out = weight * (x32 * torch.rsqrt(var + eps)).to(x.dtype)

    ``weight [H]`` has x's dtype. Returns a new contiguous tensor shaped like ``x``. For
    16-bit dtypes nearly all elements equal torch's on CUDA; the fp32 variance is summed
    in another order and may differ in its last bit, which moves the normalised value by
    at most one ulp and the output by at most two (see the module docstring).
    """
    out, _ = _rms_norm_impl(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to the model dtype), then ``(rms_norm(s), s)``, in one
    kernel. Both outputs are new contiguous tensors; the inputs are not modified. ``s`` is
    bit-identical to torch's sum; the norm matches as in :func:`rms_norm`."""
    out, summed = _rms_norm_impl(x, residual, weight, eps)
    assert summed is not None
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]`` (rows may be strided) ->
    new contiguous ``[..., d]``. Bit-identical to torch on CUDA for 16-bit dtypes."""
    _check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even, non-zero last dimension [..., 2d], got shape {tuple(x.shape)}")
    _check_device(x)
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    rows = x2.shape[0]
    if rows == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
        x2, out, x2.stride(0), d,
        DTYPE=_TL_DTYPES[x.dtype], BLOCK=block, INTERPRET=_INTERPRET, num_warps=4, **_LAUNCH_OPTS,
    )
    return out


def _check_cos_sin(name: str, t: object, x: torch.Tensor, half: int) -> torch.Tensor:
    t = _check_like(name, t, x)
    n = x.shape[0]
    if not (t.dim() == 3 and t.shape == (n, 1, half)) and not (t.dim() == 2 and t.shape == (n, half)):
        raise ValueError(f"{name} must have shape ({n}, 1, {half}) or ({n}, {half}) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(t.shape)}")
    return t


def _rotary_impl(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, int, float] | None,
) -> torch.Tensor:
    """``rotary_qk`` (``norm`` None) or ``qk_norm_rotary`` (``norm`` = q_weight, k_weight,
    num_q_heads, eps): validation and one launch of ``_rotary_kernel``."""
    _check_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    n, heads, dim = x.shape
    if dim == 0 or dim % 2:
        raise ValueError(f"x's head_dim must be even and non-zero, got {dim}")
    half = dim // 2
    _check_cos_sin("cos", cos, x, half)
    _check_cos_sin("sin", sin, x, half)
    num_q_heads, inv_q, inv_k, eps = heads, 1.0, 1.0, 0.0
    q_weight = k_weight = cos  # unused without the norm
    if norm is not None:
        q_weight, k_weight, num_q_heads, eps = norm
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            _check_like(name, w, x)
            if w.shape != (dim,):
                raise ValueError(f"{name} must have shape ({dim},) (x's head_dim), got {tuple(w.shape)}")
        if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or not 0 <= num_q_heads <= heads:
            raise ValueError(f"num_q_heads must be an int in 0..{heads} (x's heads), got {num_q_heads!r}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
        q_weight = q_weight if q_weight.stride(0) == 1 else q_weight.contiguous()
        k_weight = k_weight if k_weight.stride(0) == 1 else k_weight.contiguous()
        # The torch code normalises the query heads and the key heads as two tensors:
        # each has its own mean factor (rows / numel).
        inv_q = _mean_factor(max(n * num_q_heads, 1), dim)
        inv_k = _mean_factor(max(n * (heads - num_q_heads), 1), dim)
    _check_device(x)
    out = torch.empty((n, heads, dim), dtype=x.dtype, device=x.device)
    if n == 0 or heads == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    half_block = triton.next_power_of_2(half)
    heads_block = max(1, min(triton.next_power_of_2(heads), _ROTARY_TILE // half_block))
    _rotary_kernel[(n, triton.cdiv(heads, heads_block))](
        x, cos, sin, out, q_weight, k_weight,
        x.stride(0), x.stride(1), cos.stride(0), cos.stride(-1), sin.stride(0), sin.stride(-1),
        heads, num_q_heads, half, inv_q, inv_k, float(eps),
        NORM=norm is not None, DTYPE=_TL_DTYPES[x.dtype], HEADS_BLOCK=heads_block, HALF_BLOCK=half_block,
        INTERPRET=_INTERPRET, num_warps=4, **_LAUNCH_OPTS,
    )  # fmt: skip
    return out


def rotary_qk(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ("rotate half" layout, as HF) of ``x [N, heads, D]`` with per-token
    ``cos``/``sin`` ``[N, 1, D // 2]`` (or ``[N, D // 2]``) in x's dtype::

        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    ``x`` may be a strided view (e.g. query or key heads sliced out of a fused qkv
    projection); cos/sin may be strided too. Query and key heads can come in one tensor:
    they rotate the same way. Returns a new contiguous ``[N, heads, D]``, bit-identical to
    torch on CUDA for 16-bit dtypes.
    """
    return _rotary_impl(x, cos, sin, None)


def qk_norm_rotary(
    x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int, eps: float,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    """Qwen3-style attention input in one kernel: ``x [N, heads, D]`` holds the query heads
    (the first ``num_q_heads``) and then the key heads (e.g. a view of a fused qkv
    projection); each head is RMS-normalised over D (``q_weight`` or ``k_weight``, as
    :func:`rms_norm` would, row = head) and then rotated as :func:`rotary_qk`. Returns a
    new contiguous ``[N, heads, D]``. The norm matches torch's within two ulp (its squares
    are summed in another order); the rotation of the normalised values is torch's exactly.
    """
    return _rotary_impl(x, cos, sin, (q_weight, k_weight, num_q_heads, eps))
