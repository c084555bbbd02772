"""CPU_ATTN's C kernels (``attention_kernels.c``) for float32 layers (``covers``): the KV
write, and decode attention (one query token per request) read straight from the paged
cache; the others (half-precision or fp8 caches, soft caps, sinks) write with
``index_copy_`` and attend through torch's SDPA.

The C file is built once per machine (``kvloom.interfaces.load_c_library``); without a C
compiler the backend says so once and every layer takes the SDPA path. A call takes two
prepared structs (``LayerArgs`` per layer and cache, ``BatchArgs`` per step's decode
group), so that a layer's call converts seven arguments, not twenty-two (ctypes converts
each argument of every call, about 0.3 us apiece).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvloom.interfaces import try_load_c_library

SOURCE = Path(__file__).with_name("attention_kernels.c")
#: attention_kernels.c's limits: query heads per KV head, head size.
MAX_GROUP, MAX_HEAD = 64, 256

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class LayerArgs(ctypes.Structure):
    """attention_kernels.c's ``layer_args``: a layer's heads and its K/V caches."""

    _fields_ = [("num_heads", _I64), ("num_kv_heads", _I64), ("head_size", _I64), ("scale", _F32),
                ("key_cache", _PTR), ("value_cache", _PTR), ("block_stride", _I64), ("pos_stride", _I64),
                ("head_stride", _I64), ("block_size", _I64)]  # fmt: skip


class BatchArgs(ctypes.Structure):
    """attention_kernels.c's ``batch_args``: a step's decode requests (pointers into the
    ``DecodeBatch``'s tensors, which must outlive it)."""

    _fields_ = [("num_reqs", _I64), ("first_row", _I64), ("rows", _PTR), ("block_table", _PTR), ("width", _I64), ("first_pos", _PTR),
                ("key_start", _PTR), ("seq_len", _PTR)]  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (logged once) where it cannot be built."""
    lib = try_load_c_library(SOURCE, "CPU_ATTN's decode attention runs through torch's SDPA")
    if lib is None:
        return None
    lib.cpu_decode_attention.argtypes = [ctypes.POINTER(LayerArgs), ctypes.POINTER(BatchArgs), _PTR, _I64, _PTR,
                                         _I64, _INT]  # fmt: skip
    lib.cpu_decode_attention.restype = _INT
    lib.cpu_write_kv.argtypes = [ctypes.POINTER(LayerArgs), _I64, _PTR, _PTR, _I64, _PTR, _I64]
    lib.cpu_write_kv.restype = None
    return lib


def covers(num_heads: int, num_kv_heads: int, head_size: int, cache: torch.Tensor) -> bool:
    """Whether the kernels compute a layer of these heads over ``cache`` (one of K/V:
    ``[blocks, block_size, kv_heads, head_size]``, float32); the inputs' dtype, soft caps
    and sinks are the caller's to rule out."""
    return (cache.dtype == torch.float32 and cache.stride(-1) == 1
            and num_heads // num_kv_heads <= MAX_GROUP and head_size <= MAX_HEAD
            and library() is not None)  # fmt: skip


def rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each token row of ``t`` (``[tokens, heads * head_size]`` or ``[tokens, heads,
    head_size]``) is one contiguous run, as the kernel reads and writes them."""
    return t.stride(-1) == 1 and (t.dim() == 2 or (t.dim() == 3 and t.stride(1) == t.shape[2]))


def layer_args(num_heads: int, scale: float, key_cache: torch.Tensor, value_cache: torch.Tensor) -> LayerArgs:
    """A layer's struct for its caches (``[blocks, block_size, kv_heads, head_size]`` each,
    one layout)."""
    if value_cache.stride() != key_cache.stride():
        raise ValueError("CPU_ATTN decode kernel: the K and V caches must share one layout")
    _, block_size, kv_heads, head_size = key_cache.shape
    if num_heads % kv_heads or num_heads // kv_heads > MAX_GROUP or head_size > MAX_HEAD:
        raise ValueError(f"CPU_ATTN decode kernel: {num_heads} heads over {kv_heads} KV heads of size {head_size} "
                         f"(allowed: up to {MAX_GROUP} query heads per KV head, head size up to {MAX_HEAD})")  # fmt: skip
    return LayerArgs(num_heads, kv_heads, head_size, scale, key_cache.data_ptr(), value_cache.data_ptr(),
                     key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_size)  # fmt: skip


def batch_args(first_row: int, rows: torch.Tensor | None, block_table: torch.Tensor, first_pos: torch.Tensor,
               key_start: torch.Tensor, seq_lens: torch.Tensor) -> BatchArgs:  # fmt: skip
    """A decode group's struct: its token ``rows`` (None: ``first_row .. first_row + n - 1``),
    block tables, first block positions, window starts and sequence lengths (int64,
    contiguous; the caller keeps them alive)."""
    tensors = [t for t in (rows, block_table, first_pos, key_start, seq_lens) if t is not None]
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
        raise ValueError("CPU_ATTN decode kernel: request tensors must be contiguous int64")
    return BatchArgs(block_table.shape[0], first_row, 0 if rows is None else rows.data_ptr(), block_table.data_ptr(),
                     block_table.shape[1], first_pos.data_ptr(), key_start.data_ptr(), seq_lens.data_ptr())  # fmt: skip


def decode_attention(layer: LayerArgs, batch: BatchArgs, query: torch.Tensor, out: torch.Tensor) -> None:
    """``out[row] = attention of query[row]`` for every decode request of ``batch`` (token rows
    of ``num_heads * head_size`` floats, ``rows_contiguous``)."""
    lib = library()
    assert lib is not None, "decode_attention called where covers() is False"
    done = lib.cpu_decode_attention(ctypes.byref(layer), ctypes.byref(batch), query.data_ptr(), query.stride(0),
                                    out.data_ptr(), out.stride(0), torch.get_num_threads())  # fmt: skip
    if done != 0:
        raise MemoryError("CPU_ATTN decode kernel: no memory for the attention scores")


def write_kv(layer: LayerArgs, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Key and value row ``i`` (``rows_contiguous``, float32) to cache slot ``slots[i]``
    (int64, contiguous, every slot valid) of the layer's caches."""
    lib = library()
    assert lib is not None, "write_kv called where covers() is False"
    lib.cpu_write_kv(ctypes.byref(layer), slots.numel(), slots.data_ptr(), key.data_ptr(), key.stride(0),
                     value.data_ptr(), value.stride(0))  # fmt: skip
