"""The CPU platform's custom layer ops for float32 models (``layer_ops.c``, built once per
machine by ``kvloom.interfaces.load_c_library``): ``rms_norm`` and ``fused_add_rms_norm``
(torch's own sum of the squares, then one C call for the division and the five ops after it) and
``rotary_qk`` (one call instead of seven), each bit-identical to its torch code.

``ops()`` is what ``CpuPlatform.custom_ops`` returns for a float32 model: these three where
the C file builds (none, logged once, where no compiler is found: the torch code runs).
The platform returns them for float32 models; an input of another dtype (a layer built
outside the engine, while a float32 engine's ops are active) runs the op's torch code
(``custom_op_reference``). Any row strides; an input whose last dimension is strided is copied.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from kvloom.interfaces import c_build_problem, custom_op_reference, try_load_c_library

SOURCE = Path(__file__).with_name("layer_ops.c")

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built ops, or None (logged once) where they cannot be built."""
    lib = try_load_c_library(SOURCE, "the CPU platform's layer ops run their torch code")
    if lib is None:
        return None
    lib.cpu_rms_norm_scale.argtypes = [_I64, _I64, _PTR, _I64, _PTR, _PTR, _F32, _PTR, _INT]
    lib.cpu_rotary.argtypes = [_I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT]
    lib.cpu_rms_norm_scale.restype = lib.cpu_rotary.restype = None
    return lib


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows ``[M, N]`` with a contiguous last dimension (a copy only if it is strided)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU platform's layer ops are not built: {c_build_problem(SOURCE)}")
    return lib


def _float32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _float32(x, weight):
        return custom_op_reference("rms_norm")(x, weight, eps)
    rows, weight = _rows(x), weight.contiguous()
    # torch's own sum of the squares (its summation order), then one call for the rest
    # (torch's mean divides that sum by N: the call does, saving an op of ~10 us a norm).
    sum_sq = rows.pow(2).sum(-1)
    out = torch.empty(x.shape)
    _lib().cpu_rms_norm_scale(rows.shape[0], rows.shape[1], rows.data_ptr(), rows.stride(0), sum_sq.data_ptr(),
                              weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _float32(x, residual, weight):
        return custom_op_reference("fused_add_rms_norm")(x, residual, weight, eps)
    total = x + residual
    return rms_norm(total, weight, eps), total


def rotary_qk(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if not _float32(x, cos, sin):
        return custom_op_reference("rotary_qk")(x, cos, sin)
    tokens, heads, size = x.shape
    if size % 2 or cos.shape != (tokens, 1, size // 2) or sin.shape != cos.shape:
        raise ValueError(f"rotary_qk: x {tuple(x.shape)} with cos {tuple(cos.shape)}, sin {tuple(sin.shape)} "
                         f"(expected [N, heads, D] with [N, 1, D/2] each, D even)")  # fmt: skip
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.reshape(tokens, -1).contiguous(), sin.reshape(tokens, -1).contiguous()
    out = torch.empty(tokens, heads, size)
    _lib().cpu_rotary(tokens, heads, size, x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                      cos.stride(0), out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


def ops() -> dict[str, Callable[..., object]]:
    """The ops for a float32 model (none where the C file cannot be built here)."""
    if library() is None:
        return {}
    return {"rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm, "rotary_qk": rotary_qk}
