"""The header of a GGUF file (its metadata and tensor table), read in milliseconds.

gguf-py's ``GGUFReader`` turns every element of every metadata array into a numpy view of
the memory-mapped file: some 150,000 of them for SmolLM2's vocabulary, merges and token
types, which took seconds (tens of seconds on a busy machine) before anything else could
start. This reader walks the same bytes with ``struct`` and leaves the string arrays
(vocabulary, merges) unread: only their length is kept, which is all a model config
needs. The tokenizer is built from the file by transformers (``gguf_metadata``).

The layout (GGUF v2 and v3, little-endian): magic ``GGUF``, version (u32), tensor count
(u64), metadata count (u64); each metadata entry is a key (u64 length + UTF-8), a value
type (u32) and the value; each tensor entry is a name, the number of dimensions (u32),
the dimensions (u64 each, fastest-moving first), the ggml type (u32) and the offset of
its data (u64) from the start of the data section, which begins at the next multiple of
``general.alignment`` (default 32) after the tensor table.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

#: Fixed-size metadata value types: type id -> struct format.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING = 8
_ARRAY = 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings (a vocabulary, merges) left unread: its length only."""

    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table. ``shape`` is in torch order (slowest-moving first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata (``{key: value}``; string arrays as ``StringArray``) and
    tensor table."""

    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset: int  # where the tensor data section begins in the file

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise ValueError(f"{self.path} is not a valid GGUF file: its header ends early") from None
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        end = self.pos + length
        if end > len(self.buf):
            raise ValueError(f"{self.path} is not a valid GGUF file: a string runs past its end")
        text = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def skip_strings(self, count: int) -> None:
        read_length, buf, pos = _U64.unpack_from, self.buf, self.pos
        try:
            for _ in range(count):
                pos += 8 + read_length(buf, pos)[0]
        except struct.error:
            raise ValueError(f"{self.path} is not a valid GGUF file: its header ends early") from None
        self.pos = pos

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])[0]
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type, count = self.unpack("IQ")
            if element_type in _SCALAR_FORMATS:
                return list(self.unpack(f"{count}{_SCALAR_FORMATS[element_type]}"))
            if element_type == _STRING:
                self.skip_strings(count)
                return StringArray(count)
            return [self.value(element_type) for _ in range(count)]  # arrays of arrays
        raise ValueError(f"{self.path} is not a valid GGUF file: unknown metadata value type {value_type}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of the GGUF file ``path``, without its tensor data."""
    path = Path(path)
    with open(path, "rb") as f:
        if path.stat().st_size < 24 or f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cursor = _Cursor(buf, path)
            cursor.pos = 4
            version, tensor_count, metadata_count = cursor.unpack("IQQ")
            if version not in SUPPORTED_VERSIONS:
                raise ValueError(f"{path} is GGUF version {version}; kvloom reads versions "
                                 f"{', '.join(map(str, SUPPORTED_VERSIONS))}")  # fmt: skip
            metadata: dict[str, Any] = {}
            for _ in range(metadata_count):
                key = cursor.string()
                (value_type,) = cursor.unpack("I")
                metadata[key] = cursor.value(value_type)
            tensors = []
            for _ in range(tensor_count):
                name = cursor.string()
                (ndim,) = cursor.unpack("I")
                dims = cursor.unpack(f"{ndim}Q")
                ggml_type, offset = cursor.unpack("IQ")
                tensors.append(GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, offset))
            table_end = cursor.pos
    if "general.architecture" not in metadata:
        raise ValueError(f"{path} has no general.architecture in its GGUF metadata")
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = (table_end + alignment - 1) // alignment * alignment
    return GGUFHeader(metadata, tuple(tensors), data_offset)


def tensor_data(mapped: np.ndarray, header: GGUFHeader, info: GGUFTensorInfo) -> np.ndarray:
    """The stored data of one tensor, a view of ``mapped`` (the file as a ``uint8`` memory
    map), shaped as gguf-py's reader shapes it for ``gguf.quants.dequantize``: plain types
    as their values (torch order), block-quantized ones as bytes, ``[..., bytes per row]``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

    ggml_type = GGMLQuantizationType(info.ggml_type)
    start = header.data_offset + info.offset
    plain = _PLAIN_DTYPES.get(ggml_type.name)
    if plain is not None:
        return mapped[start : start + prod(info.shape) * plain.itemsize].view(plain).reshape(info.shape)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    nbytes = prod(info.shape) * type_size // block_size
    return mapped[start : start + nbytes].reshape(quant_shape_to_byte_shape(info.shape, ggml_type))


#: ggml types stored as plain numpy values (the others are blocks of bytes).
_PLAIN_DTYPES = {name: np.dtype(dtype) for name, dtype in (("F32", np.float32), ("F16", np.float16),
                 ("F64", np.float64), ("I8", np.int8), ("I16", np.int16), ("I32", np.int32), ("I64", np.int64))}  # fmt: skip
