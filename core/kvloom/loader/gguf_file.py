"""A GGUF file's tensors as stored, for a quantization method that reads GGML types.

* ``tensor_rows`` gives one tensor's bytes (located by ``gguf_header``'s tensor table) as
  rows of GGML blocks; ``dequantize_rows`` turns such rows into float32.
* ``GGUFTensor`` is one tensor as stored: its GGML type and raw bytes, row by row, for a
  quantization method that reads GGUF's quantized types (``QuantizationMethod.
  checkpoint_formats`` claiming ``"gguf"``); for everything else it is a lazy checkpoint
  tensor whose ``materialize`` dequantizes it to float32. Its ``content_key`` is the
  file's ``gguf_metadata.gguf_content_id`` (SHA-256 of its bytes), so caches a method
  derives from it are shared by every path and environment holding the same file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvloom.loader.gguf_header import GGUFHeader, GGUFTensorInfo, tensor_data
from kvloom.loader.lazy_tensor import LazyTensor


def tensor_rows(mapped: np.ndarray, header: GGUFHeader, info: GGUFTensorInfo) -> np.ndarray:
    """The bytes of ``info``'s tensor in ``mapped`` (the file as a ``uint8`` memory map) as
    rows: ``uint8 [rows, bytes per row]`` (a 1-D tensor is one row)."""
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    return tensor_data(mapped, header, info).view(np.uint8).reshape(rows, -1)


def dequantize_rows(raw: np.ndarray, ggml_type: int, cols: int) -> np.ndarray:
    """float32 ``[rows, cols]`` of raw GGUF rows (``gguf.quants.dequantize``)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(ggml_type)).reshape(raw.shape[0], cols)
    if not out.flags.writeable or out.dtype != np.float32:
        out = np.array(out, dtype=np.float32, copy=True)  # F32 rows are views of the mmap
    return out


class _DequantizingSource:
    """The ``SliceSource`` of a ``GGUFTensor``: regions read dequantized."""

    def __init__(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> None:
        self.raw, self.ggml_type, self.shape = raw, ggml_type, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = () if index is Ellipsis else tuple(index)
        if len(self.shape) == 2 and index:  # dequantize only the rows asked for
            rows = dequantize_rows(self.raw[index[0]], self.ggml_type, self.shape[1])
            return torch.from_numpy(np.ascontiguousarray(rows[:, index[1]]))
        full = dequantize_rows(self.raw, self.ggml_type, self.shape[-1]).reshape(self.shape)
        return torch.from_numpy(np.ascontiguousarray(full[index]))


class GGUFTensor(LazyTensor):
    """One tensor of a GGUF file as stored, handed to a quantization method that claims
    ``"gguf"`` (``kvloom.loader.gguf_loader``): ``ggml_type`` and ``raw`` (its bytes, one row
    of GGML blocks per output row, in HF's row order: llama.cpp's Q/K row permutation is
    already undone). ``shape`` is the float tensor's; ``materialize`` (and a narrowed
    handle's) dequantizes to float32, so any weight loader that does not read GGUF types
    gets floats."""

    ggml_type: int
    """The ``gguf.GGMLQuantizationType`` value the tensor is stored as."""
    raw: np.ndarray
    """``uint8 [rows, bytes per row]``, possibly a read-only view of the memory-mapped file."""
    content_key: str | None
    """``gguf_metadata.gguf_content_id`` of the file it comes from (``None``: not from a file); a method
    keys caches of what it derives from the tensor by it."""
    gguf_name: str
    """llama.cpp's name of the tensor (``blk.0.attn_q.weight``)."""

    def __init__(
        self, name: str, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...],
        content_key: str | None = None, gguf_name: str = "", origin: str = "",
    ) -> None:  # fmt: skip
        super().__init__(name, _DequantizingSource(raw, ggml_type, tuple(shape)), origin)
        self.raw, self.ggml_type, self.content_key, self.gguf_name = raw, ggml_type, content_key, gguf_name or name

    @property
    def type_name(self) -> str:
        """The GGML type's name (``Q4_1``)."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name

    def __repr__(self) -> str:
        return f"GGUFTensor({self.name!r}, {self.type_name}, {tuple(self.shape)})"
