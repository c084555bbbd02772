"""A stand-in for the ``flash_attn`` module, for CPU tests of the FLASH_ATTN backend.

It exposes the two functions the backend calls, with flash-attn 2.8.3's public
signatures, and computes what the real kernels compute (paged causal attention, the
causal mask aligned bottom-right, GQA by head groups) in float64 from the arguments
alone: each request's keys come through ``block_table`` and the lengths through
``cu_seqlens_k`` / ``cache_seqlens``, exactly the data the real kernels read; with a window
(``window_size=(left, 0)``) the pages wholly before the first query's window are not read
(the real kernels start each query block at its window's first tile), and ``softcap``
caps the scaled scores as ``softcap * tanh(s / softcap)``. It also
enforces the library's documented argument rules (int32 index tensors, contiguous last
dimensions, head size a multiple of 8 up to 256, paged block size a multiple of 256,
``max_seqlen_*`` upper bounds, ``B + 1`` cumulative lengths), so a call the real library
would refuse fails here too. Every call is recorded in ``module.calls``.

``installed()`` puts it into ``sys.modules`` for a ``with`` block (and makes the backend's
impl module import afresh against it).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import math
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

BACKEND_SRC = Path(__file__).resolve().parents[1]


def ensure_backend_importable() -> None:
    """The venv script does not install kvloom-backend-flash-attn (flash-attn needs CUDA):
    import the package from the source tree."""
    try:
        import kvloom_backend_flash_attn  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(BACKEND_SRC))


def _check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "paged caches are (num_blocks, page, Hkv, D)"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "k_cache/v_cache must have contiguous last dimension"
    assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert block_table.dtype == torch.int32 and block_table.dim() == 2, "block_table must be int32 [B, W]"
    assert block_table.stride(-1) == 1, "block_table must have contiguous last dimension"


def _check_common(q: torch.Tensor, k_cache: torch.Tensor, softmax_scale: float | None) -> float:
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16 and bf16"
    assert q.dtype == k_cache.dtype, "query and key must have the same dtype"
    assert q.stride(-1) == 1, "Input tensor must have contiguous last dimension"
    head_size = q.shape[-1]
    assert head_size % 8 == 0 and head_size <= 256, "head size must be a multiple of 8, at most 256"
    assert q.shape[-2] % k_cache.shape[2] == 0, "Number of heads in key/value must divide number of heads in query"
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_size)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int,
            scale: float, causal: bool, window_left: int = -1, softcap: float = 0.0) -> torch.Tensor:
    """float64 attention of ``q [n, H, D]`` over the first ``seq_len`` paged positions (the
    last ``window_left + 1`` of each query's when ``window_left >= 0``)."""
    page = k_cache.shape[1]
    num_pages = -(-seq_len // page)
    assert num_pages <= blocks.shape[0], "sequence longer than its block-table row"
    n = q.shape[0]
    first_key = max(0, seq_len - n - window_left) if window_left >= 0 else 0
    first_page = first_key // page  # pages before it are never read
    pages = blocks[first_page:num_pages].long()
    start = first_page * page
    keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[: seq_len - start].double()
    values = v_cache[pages].reshape(-1, *v_cache.shape[2:])[: seq_len - start].double()
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    key_pos, query_pos = torch.arange(start, seq_len)[None, :], torch.arange(seq_len - n, seq_len)[:, None]
    visible = torch.ones(n, seq_len - start, dtype=torch.bool)
    if causal:
        visible &= key_pos <= query_pos
    if window_left >= 0:
        visible &= key_pos >= query_pos - window_left
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0, as flash-attn
    return torch.einsum("hqk,khd->qhd", probs, values)


def _check_window(window_size: tuple[int, int], causal: bool) -> int:
    """The left extent of a causal window (-1: none); the stand-in implements those only."""
    left, right = window_size
    assert (left, right) == (-1, -1) or (left >= 0 and right == 0 and causal), "causal left windows only"
    return left


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):
    assert block_table is not None, "the stand-in implements the paged path only"
    _check_paged_cache(k, v, block_table)
    scale = _check_common(q, k, softmax_scale)
    assert q.dim() == 3, "q must be (total_q, H, D)"
    assert dropout_p == 0.0 and alibi_slopes is None and not return_attn_probs
    window_left = _check_window(window_size, causal)
    batch = block_table.shape[0]
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        assert cu.dtype == torch.int32 and cu.is_contiguous(), f"{name} must be contiguous int32"
        assert cu.shape == (batch + 1,), f"{name} must have batch_size + 1 entries"
        assert int(cu[0]) == 0 and bool((cu[1:] >= cu[:-1]).all()), f"{name} must be cumulative from 0"
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int), "max_seqlen_* are host ints"
    assert max(q_lens) <= max_seqlen_q and max(k_lens) <= max_seqlen_k, "max_seqlen_* must bound the lengths"
    assert q.shape[0] == int(cu_seqlens_q[-1]), "q rows must match cu_seqlens_q"
    module = sys.modules[__name__]
    module.calls.append(dict(kernel="varlen", max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             softmax_scale=scale, causal=causal, block_table=block_table, batch=batch,
                             window_size=window_size, softcap=softcap))
    out = torch.empty(q.shape, dtype=q.dtype)
    for i in range(batch):
        rows = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
        out[rows] = _attend(q[rows].cpu(), k.cpu(), v.cpu(), block_table[i].cpu(), k_lens[i], scale, causal,
                            window_left, softcap).to(q.dtype)
    return out.to(q.device)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False,
):
    assert block_table is not None, "the stand-in implements the paged path only"
    _check_paged_cache(k_cache, v_cache, block_table)
    scale = _check_common(q, k_cache, softmax_scale)
    assert q.dim() == 4, "q must be (batch, seqlen_q, H, D)"
    assert k is None and v is None and rotary_cos is None and cache_batch_idx is None and cache_leftpad is None
    assert alibi_slopes is None and not return_softmax_lse
    window_left = _check_window(window_size, causal)
    batch = q.shape[0]
    assert isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
    assert cache_seqlens.shape == (batch,) and block_table.shape[0] == batch, "batch sizes must agree"
    module = sys.modules[__name__]
    module.calls.append(dict(kernel="kvcache", softmax_scale=scale, causal=causal, block_table=block_table,
                             batch=batch, num_splits=num_splits, window_size=window_size, softcap=softcap))
    out = torch.empty(q.shape, dtype=q.dtype)
    for i in range(batch):
        out[i] = _attend(q[i].cpu(), k_cache.cpu(), v_cache.cpu(), block_table[i].cpu(), int(cache_seqlens[i]),
                         scale, causal, window_left, softcap).to(q.dtype)
    return out.to(q.device)


calls: list[dict[str, Any]] = []


def make_module(with_kernels: bool = True) -> types.ModuleType:
    """A fresh ``flash_attn`` module object (``with_kernels=False``: like flash-attn whose
    CUDA extension failed to import, which its ``__init__`` hides)."""
    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", loader=None)
    module.__version__ = "2.8.3.post2"
    if with_kernels:
        module.flash_attn_varlen_func = flash_attn_varlen_func
        module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


IMPL_MODULE = "kvloom_backend_flash_attn.impl"


@contextlib.contextmanager
def installed(with_kernels: bool = True) -> Iterator[types.ModuleType]:
    """Install the stand-in as ``flash_attn`` while the block runs; the backend's impl
    module is imported afresh against it. Afterwards both ``sys.modules`` entries are as
    before, so no impl bound to the stand-in outlives the block (a real flash_attn
    imported later, e.g. by the GPU tests in the same session, gets a fresh impl)."""
    ensure_backend_importable()
    calls.clear()
    saved = {name: sys.modules.pop(name, None) for name in ("flash_attn", IMPL_MODULE)}
    sys.modules["flash_attn"] = make_module(with_kernels)
    try:
        yield sys.modules["flash_attn"]
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module
