"""A GGUF file's tensors as stored: the tensor table, raw tensors, and the file's identity.

* ``read_tensor_table`` reads the header (the key/value section is stepped over, keeping
  only scalar values, so a 49k-token vocabulary costs milliseconds, not the seconds of
  ``gguf.GGUFReader``, which builds an array view per token) and returns each tensor's
  name, GGML type, shape and byte range.
* ``GGUFTensor`` is one tensor as stored: its GGML type and raw bytes, row by row, for a
  quantization method that reads GGUF's quantized types (``QuantizationMethod.
  checkpoint_formats`` claiming ``"gguf"``); for everything else it is a lazy checkpoint
  tensor whose ``materialize`` dequantizes it to float32.
* ``gguf_content_key`` names a file by its content (SHA-256 of its bytes), so caches derived
  from it are shared by every path and environment that holds the same file; it is hashed
  once per path, size and mtime (remembered under ``KVLOOM_CACHE_DIR``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvloom.loader.lazy_tensor import LazyTensor
from kvloom.utils import kvloom_cache_dir

logger = logging.getLogger(__name__)

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
#: GGUF value types with a fixed size: type id -> struct format.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of a GGUF file's tensor table."""

    name: str
    """llama.cpp's tensor name (``blk.0.attn_q.weight``)."""
    ggml_type: int
    """The ``gguf.GGMLQuantizationType`` value it is stored as."""
    shape: tuple[int, ...]
    """The shape in torch order (``[rows, cols]``; GGUF lists the dims innermost first)."""
    offset: int
    """Byte offset of its data in the file."""
    nbytes: int
    """Bytes of its data."""


@dataclass(frozen=True)
class GGUFTensorTable:
    """What ``read_tensor_table`` returns."""

    metadata: dict[str, Any]
    """The header's scalar and string values (arrays are stepped over)."""
    tensors: list[GGUFTensorInfo]
    """The tensors, in file order."""


class _Header:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"model: {self.path} is not a complete GGUF file (its header ends early)")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.take("Q")
        value = bytes(self.buf[self.pos : self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return value

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            self.skip_array(self.take("I"), self.take("Q"))
            return None
        raise ValueError(f"model: {self.path}: unknown GGUF value type {vtype}")

    def skip_array(self, etype: int, count: int) -> None:
        if etype in _SCALARS:
            self.pos += struct.calcsize("<" + _SCALARS[etype]) * count
        elif etype == _STRING:  # the vocabulary: ~100k strings, stepped over in a tight loop
            unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            self.pos = pos
        else:
            for _ in range(count):
                self.value(etype)


def read_tensor_table(path: str | Path) -> GGUFTensorTable:
    """The metadata scalars and the tensor table of the GGUF file ``path`` (version 2 or 3,
    little-endian); a file that is not one is a ``ValueError`` naming it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f:
        data = np.memmap(f, dtype=np.uint8, mode="r")
    header = _Header(memoryview(data), path)
    if bytes(data[:4]) != _MAGIC:
        raise ValueError(f"model: {path} is not a GGUF file (it does not start with 'GGUF')")
    header.pos = 4
    version = header.take("I")
    if version not in (2, 3):
        raise ValueError(f"model: {path} is GGUF version {version} (kvloom reads versions 2 and 3, little-endian)")
    n_tensors, n_kv = header.take("Q"), header.take("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = header.string()
        value = header.value(header.take("I"))
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = header.string()
        dims = [header.take("Q") for _ in range(header.take("I"))]
        ggml_type, offset = header.take("I"), header.take("Q")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"model: {path}: tensor {name} has GGML type {ggml_type}, unknown to the installed "
                             "gguf package") from None  # fmt: skip
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
        infos.append((name, ggml_type, tuple(reversed(dims)), offset, nbytes))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-header.pos // alignment) * alignment
    tensors = [GGUFTensorInfo(name, t, shape, start + off, n) for name, t, shape, off, n in infos]
    for info in tensors:
        if info.offset + info.nbytes > len(data):
            raise ValueError(f"model: {path} is truncated: tensor {info.name} ends past the end of the file")
    return GGUFTensorTable(metadata, tensors)


def tensor_rows(data: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The bytes of ``info``'s tensor in ``data`` (the file, memory-mapped) as rows:
    ``uint8 [rows, bytes per row]`` (a 1-D tensor is one row)."""
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    return data[info.offset : info.offset + info.nbytes].reshape(rows, -1)


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
    """``gguf_content_key`` of the file it comes from (``None``: not from a file); a method
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


# ---------------------------------------------------------------------- identity

_IDENTITY_FILE = "gguf-content-keys.json"


def gguf_content_key(path: str | Path) -> str:
    """The SHA-256 (hex) of the file's bytes: the same file under any path, in any
    environment, has the same key. Hashing reads the whole file once (~0.1 s per 100 MB);
    the key is remembered under ``KVLOOM_CACHE_DIR`` for the path, size and mtime."""
    path = Path(path).resolve()
    stat = path.stat()
    stamp = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    memo_file = kvloom_cache_dir() / "gguf" / _IDENTITY_FILE
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(stamp), str):
        return memo[stamp]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    key = digest.hexdigest()
    memo = memo if isinstance(memo, dict) else {}
    memo[stamp] = key
    tmp = memo_file.with_name(f"{memo_file.name}.tmp{os.getpid()}")
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_file)
    except OSError as e:  # a read-only cache only costs the hash next time
        logger.debug("Could not remember the content key of %s: %s", path, e)
        tmp.unlink(missing_ok=True)
    return key
