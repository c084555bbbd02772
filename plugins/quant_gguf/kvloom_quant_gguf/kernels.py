"""The C kernels (``kernels.c``), built once per machine, and their torch reference.

``kernels.c`` is plain C with OpenMP (AVX2 intrinsics where the CPU has AVX2, portable C
otherwise), built on first use into ``KVLOOM_CACHE_DIR`` and loaded with ``ctypes`` by
``kvloom.interfaces.load_c_library`` (about two seconds, once per machine); the kernels
and torch share one OpenMP thread pool and run on ``torch.get_num_threads()`` threads.

``fake_quantize`` is the activation quantization the kernels apply (per row and 32
features: ``d = max|x| / 127``, ``q = round(x / d)``), in torch: the method's
``reference_input``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvloom.interfaces import c_build_problem, load_c_library

SOURCE = Path(__file__).with_name("kernels.c")
#: Activation quantization block (features per int8 scale).
ACT_BLOCK = 32
#: Kernel segments one layer may have (kernels.c's MAX_SEGMENTS).
MAX_SEGMENTS = 8

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def problem() -> str | None:
    """Why the kernels cannot be built here (no C compiler and no built library), or None."""
    reason = c_build_problem(SOURCE)
    return None if reason is None else f"{reason}, or run with --quantization none"


@functools.cache
def library() -> ctypes.CDLL:
    """The kernels, built on first use (``kvloom.interfaces.load_c_library``)."""
    lib = load_c_library(SOURCE)
    lib.kvq_linear.argtypes = [_INT, _I64, _I64, _PTR, _I64, _INT, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _INT]
    lib.kvq_linear.restype = _INT
    lib.kvq_rows.argtypes = [_INT, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _INT]
    lib.kvq_rows.restype = None
    return lib


class LinearKernel:
    """A layer's kernel segments as ``kvq_linear`` takes them: ctypes arrays of their formats,
    output columns and weight pointers, built once; ``holds`` says whether the layer's
    parameters are still where they were (``matmul`` builds a new one when a weight moved)."""

    __slots__ = ("codes", "count", "entry", "fmts", "params", "pointers", "rows", "starts")

    def __init__(self, segments: list[tuple[int, int, int, str, str]], tensors: dict[str, torch.Tensor]) -> None:
        """``segments``: ``(fmt, start column, rows, codes name, params name)`` of each kernel
        segment (none: a layer of float segments only), the names keys of ``tensors``."""
        if len(segments) > MAX_SEGMENTS:
            raise ValueError(f"a GGUF layer has at most {MAX_SEGMENTS} kernel segments, not {len(segments)}")
        self.count = len(segments)
        self.pointers = tuple((name, tensors[name].data_ptr()) for *_, codes, params in segments
                              for name in (codes, params))  # fmt: skip
        self.fmts = (_INT * self.count)(*(seg[0] for seg in segments))
        self.starts = (_I64 * self.count)(*(seg[1] for seg in segments))
        self.rows = (_I64 * self.count)(*(seg[2] for seg in segments))
        self.codes = (_PTR * self.count)(*(tensors[seg[3]].data_ptr() for seg in segments))
        self.params = (_PTR * self.count)(*(tensors[seg[4]].data_ptr() for seg in segments))
        self.entry = library().kvq_linear if segments else None

    def holds(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` (the layer's parameters) are the memory this kernel reads."""
        for name, pointer in self.pointers:
            if tensors[name].data_ptr() != pointer:
                return False
        return True

    def __call__(self, bits: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[:, seg columns] = x @ w_seg.T`` for every segment: ``x`` float32 ``[M, K]`` with
        contiguous rows, quantized to ``bits`` once; ``out`` float32 ``[M, n]`` (rows may be strided)."""
        done = self.entry(bits, x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), self.count, self.fmts, self.starts,
                          self.rows, self.codes, self.params, out.data_ptr(), out.stride(0), torch.get_num_threads())  # fmt: skip
        if done != 0:
            raise MemoryError(f"GGUF kernels: no memory for the int{bits} activations of a {tuple(x.shape)} input")


def rows(fmt: int, ids: torch.Tensor, cols: int, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """float32 ``[len(ids), cols]``: the weight rows ``ids`` (int64), dequantized."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), cols)
    library().kvq_rows(fmt, ids.numel(), ids.data_ptr(), cols, codes.data_ptr(), params.data_ptr(), out.data_ptr(),
                       torch.get_num_threads())  # fmt: skip
    return out


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (float32) as the kernels see it: quantized to ``bits`` (8 or 16) per row and 32
    features, and back."""
    qmax = 127.0 if bits == 8 else 32767.0
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // ACT_BLOCK, ACT_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / qmax
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse).clamp(-qmax, qmax)
    return (q * d).reshape(x.shape)
