"""The ``random_sample`` custom op on CUDA: one token per row in one pass over the logits.

Why: the sampler's torch path for plain temperature sampling makes seven full passes
over the ``[B, V]`` logits (cast to float32, divide by the temperature, softmax, uniform
noise, log, negate, divide, argmax); for Qwen3-0.6B at batch 256 (V = 151,936) that is
~0.95 ms of a 10.9 ms decode step on an H100. Here the logits are read once, in the LM
head's dtype.

The draw is the Gumbel-max trick: ``argmax_i(logits_i / T + g_i)`` with ``g_i`` standard
Gumbel noise picks token ``i`` with probability ``softmax(logits / T)_i`` (the same
distribution as the torch path's exponential race ``argmax(p_i / e_i)``, in log space:
``g = -log(e)``). Greedy rows take ``argmax(logits)`` without noise.

Layout: grid ``(rows, num_chunks)``; each program scans ``chunk_size`` columns of one row
in steps of ``4 * block`` and writes its best score and that column to ``[rows,
num_chunks]`` buffers; torch then takes each row's best chunk (``argmax`` + ``gather``).
Ties: within a program a column replaces the best only with a strictly larger score and
the lowest column among equal lane maxima is kept; ``torch.argmax`` over the chunks
returns the first maximum. So the lowest index wins, as ``torch.argmax`` does (greedy
rows are exactly ``logits.float().argmax(1)`` for NaN-free rows).

NaN: a NaN score never compares larger, so NaN logits never win (the row is sampled
among its other tokens, where torch's argmax would return the NaN). A row whose scores
are all ``-inf`` or NaN gives token 0 (torch's path also returns 0 for such rows).

Randomness: each call draws one seed in ``[0, 2**62)`` on the device from torch's default
generator (``torch.randint``: no host synchronisation, replays fresh in a CUDA graph,
follows ``torch.manual_seed``); the kernel loads it and gives row ``r`` the Philox key
``seed + r * _ROW_STRIDE`` (no int64 overflow for any row count below 2**30), with the
column as counter, so offsets stay below V. One Philox call (``tl.randint4x``) yields
the 32 random bits of four columns.

Uniforms: ``tl.rand`` maps 31 bits to ``[0, 1)``: exactly 0 with probability 2**-31
(Gumbel noise ``-inf``: that token just loses), and only 2**24 distinct values near 1.
But the winner of a flat row of 150K tokens is the one with the smallest exponential
``e = -log(u)``, i.e. ``u`` nearest 1, where that grid makes ties (then the lowest index
wins) about 1% of the time. So the kernel builds ``w = (bits + 0.5) / 2**32`` from all 32
bits (fine near 0; clamped below 1, never 0) and ``e = -log1p(-w)``, a series where
``w < 1/64`` (there ``1 - w`` would lose ``w``'s digits): ``e`` lies in ``[2**-33,
16.6]``, the noise ``-log(e)`` in ``[-2.8, 22.9]``, always finite, so no ``inf - inf`` or
NaN arises from the noise.

Inputs: ``logits [B, V]`` float16/bfloat16/float32 (rows may be strided; a column stride
other than 1 is copied), ``temperature [B]`` float32 (greedy rows hold anything, e.g.
1.0; sampled rows must be > 0: not checked, it would read the device), ``greedy [B]``
bool or None (all rows sampled). Output: a new ``[B]`` int64 tensor. Inputs untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom_platform_cuda.fused_ops import _LAUNCH_OPTS, _check_device, _check_tensor, _rows

__all__ = ["random_sample"]

#: Columns per program: small batches split the row finer so the GPU has enough programs.
_CHUNK_LARGE = 16384
_CHUNK_SMALL = 4096
_SMALL_BATCH = 64
#: Columns per lane vector; a loop step covers four of them (one ``randint4x`` call).
_BLOCK = 1024
#: Odd constant that spreads row keys (2**32 / golden ratio squared): below 2**31, so that
#: Triton types it int32 and ``seed + row * _ROW_STRIDE`` stays below 2**63 for seeds
#: below 2**62 and rows below 2**30. (Philox streams of distinct keys are independent for practical purposes.)
_ROW_STRIDE = 0x61C88647
_SEED_BOUND = 2**62


@triton.jit
def _gumbel(bits):
    """Standard Gumbel noise ``-log(e)``, ``e = -log(1 - w)`` Exponential(1), from 32
    random bits; always finite (see the module docstring)."""
    w = bits.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10  # (bits + 0.5) / 2**32
    w = tl.minimum(w, 0.99999994)  # the largest float32 below 1
    # -log1p(-w): its Taylor series (error below w**5 / 5, under float32's epsilon
    # relative to w for w < 2**-6), else the log of 1 - w, which is exact enough there.
    small = w * (1.0 + w * (0.5 + w * (0.33333334 + w * 0.25)))
    e = tl.where(w < 0.015625, small, -tl.log(1.0 - w))
    return -tl.log(e)


@triton.jit
def _race_step(row_ptr, cols, V, bits, temp, greedy, best, best_col):
    """Fold the columns ``cols`` (one lane each) into the lanes' running best."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    score = tl.where(greedy, x, x / temp + _gumbel(bits))
    better = score > best  # strict: the earlier (lower) column keeps a tie; NaN never wins
    return tl.where(better, score, best), tl.where(better, cols, best_col)


@triton.jit
def _random_sample_kernel(
    logits_ptr, temp_ptr, greedy_ptr, seed_ptr, best_ptr, col_ptr,
    row_stride, V, num_chunks,
    ROW_STRIDE: tl.constexpr, HAS_GREEDY: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (rows, num_chunks): the best score of columns [chunk * CHUNK, +CHUNK) of one
    row and its column, into best_ptr / col_ptr [rows, num_chunks]."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    start = chunk * CHUNK
    row_ptr = logits_ptr + row * row_stride
    temp = tl.load(temp_ptr + row)
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + row) != 0
    else:
        greedy = False
    key = tl.load(seed_ptr) + row * ROW_STRIDE
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = start + lanes  # a chunk with no finite score reports its first column
    for step in tl.range(0, CHUNK, 4 * BLOCK):
        base = start + step
        # Counters base / 4 + lane: distinct across steps and chunks (base is a multiple
        # of 4 * BLOCK), below V.
        b0, b1, b2, b3 = tl.randint4x(key, base // 4 + lanes)
        best, best_col = _race_step(row_ptr, base + lanes, V, b0, temp, greedy, best, best_col)
        best, best_col = _race_step(row_ptr, base + BLOCK + lanes, V, b1, temp, greedy, best, best_col)
        best, best_col = _race_step(row_ptr, base + 2 * BLOCK + lanes, V, b2, temp, greedy, best, best_col)
        best, best_col = _race_step(row_ptr, base + 3 * BLOCK + lanes, V, b3, temp, greedy, best, best_col)
    top = tl.max(best, axis=0)
    # The lowest column among the lanes holding the maximum.
    col = tl.min(tl.where(best == top, best_col, V), axis=0)
    out = row * num_chunks + chunk
    tl.store(best_ptr + out, top)
    tl.store(col_ptr + out, col.to(tl.int64))


def _check_row_vector(name: str, t: object, dtype: torch.dtype, logits: torch.Tensor) -> torch.Tensor:
    """``t`` is a ``[B]`` tensor of ``dtype`` on the logits' device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {str(dtype).removeprefix('torch.')}, got {t.dtype}")
    if t.shape != (logits.shape[0],):
        raise ValueError(f"{name} must have shape ({logits.shape[0]},) (one entry per row of logits), "
                         f"got {tuple(t.shape)}")  # fmt: skip
    if t.device != logits.device:
        raise ValueError(f"{name} must be on the device of logits ({logits.device}), got {t.device}")
    return t if t.stride(0) == 1 else t.contiguous()


def random_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor | None,
    *,
    chunk_size: int | None = None,
    block: int = _BLOCK,
) -> torch.Tensor:
    """One token per row of ``logits [B, V]``: ``argmax(logits)`` where ``greedy``, else
    a draw from ``softmax(logits / temperature)``. Returns a new ``[B]`` int64 tensor
    (see the module docstring for ties, NaN and the randomness).

    ``chunk_size`` (columns per program, a multiple of ``4 * block``; default by batch
    size) and ``block`` (a power of two) only change the work split (and which random
    bits a column gets), not the distribution; tests use small ones."""
    _check_tensor("logits", logits)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [batch, vocab] with vocab >= 1, got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if vocab >= 2**31 - 8 * block:
        raise ValueError(f"logits: vocab {vocab} is too large (allowed: below {2**31 - 8 * block})")
    if rows >= 2**30:
        raise ValueError(f"logits: {rows} rows is too many (allowed: below {2**30})")
    temperature = _check_row_vector("temperature", temperature, torch.float32, logits)
    if greedy is not None:
        greedy = _check_row_vector("greedy", greedy, torch.bool, logits)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if chunk_size is None:
        chunk_size = _CHUNK_SMALL if rows < _SMALL_BATCH else _CHUNK_LARGE
        chunk_size = max(chunk_size, 4 * block)
    if chunk_size < 4 * block or chunk_size % (4 * block):
        raise ValueError(f"chunk_size must be a positive multiple of 4 * block ({4 * block}), got {chunk_size}")
    num_chunks = triton.cdiv(vocab, chunk_size)
    if num_chunks > 65535:  # CUDA's limit on the grid's second dimension
        raise ValueError(f"chunk_size {chunk_size} splits vocab {vocab} into {num_chunks} chunks "
                         "(allowed: at most 65535)")  # fmt: skip
    _check_device(logits, "logits")

    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    logits = _rows(logits)  # unit column stride; strided rows are read in place
    seed = torch.randint(0, _SEED_BOUND, (1,), dtype=torch.int64, device=logits.device)
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    cols = torch.empty((rows, num_chunks), dtype=torch.int64, device=logits.device)
    _random_sample_kernel[(rows, num_chunks)](
        logits, temperature, greedy if greedy is not None else temperature, seed, best, cols,
        logits.stride(0), vocab, num_chunks,
        ROW_STRIDE=_ROW_STRIDE, HAS_GREEDY=greedy is not None, CHUNK=chunk_size, BLOCK=block,
        num_warps=4 if block <= 1024 else 8, **_LAUNCH_OPTS,
    )  # fmt: skip
    if num_chunks == 1:
        return cols.view(rows)
    return cols.gather(1, best.argmax(dim=1, keepdim=True)).view(rows)
