"""KV-cache blocks as connectors move them: one layer's cache seen by block, the key of a
block, and a folder of block files.

Every attention backend lays its KV cache out its own way (``get_kv_cache_shape``:
``(2, num_blocks, ...)`` for most, ``(num_blocks, 2, ...)`` for FlashInfer,
``(num_blocks, block_size, latent)`` for MLA). ``KVLayerCache`` hides that: it knows the
dimension its blocks are indexed on and gathers or scatters whole blocks, so a connector
copies blocks without knowing the layout. A block is identified across engines by its KV-cache
group and the chained hash of its tokens (``block_key``), which covers the whole prefix
before it; ``KVBlockFiles`` stores blocks as files named by that key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvloom.config import EngineConfig

#: The first bytes of a block file (format version 1).
_MAGIC = b"KVLOOMB1"
_HEADER_LEN = struct.Struct("<I")


def block_key(group: int, block_hash: bytes) -> str:
    """The name of a KV-cache block everywhere it is stored: its KV-cache group and the
    hex of its chained block hash (``g0-3fa1...``)."""
    return f"g{group}-{block_hash.hex()}"


def kv_layout_fingerprint(config: EngineConfig) -> str:
    """A short hex name of what a stored block's bytes mean: the served model, its
    architecture and attention dimensions, the KV-cache dtype, block size and attention
    backend. Engines that share stored blocks (a folder, a host) keep them under it, so
    that one never reads another model's KV; two engines serving the same weights under
    the same ``--served-model-name`` with the same cache settings share it."""
    model, cache = config.model, config.cache
    fields = [model.served_model_name, model.architecture, str(model.dtype), cache.cache_dtype, cache.block_size,
              model.num_layers, model.num_kv_heads, model.head_size, model.use_mla, config.attention.backend.NAME]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


def kv_cache_bytes_per_block(config: EngineConfig) -> int:
    """Bytes one KV-cache block takes over all attention layers, from the config alone (a
    connector's scheduler side sizes a store in blocks with it; the worker side checks it
    against the registered cache)."""
    model, cache = config.model, config.cache
    heads, size = (1, model.mla_dims.latent_size) if model.use_mla else (model.num_kv_heads, model.head_size)
    shape = config.attention.backend.get_kv_cache_shape(1, cache.block_size, heads, size)
    dtype = model.dtype if cache.cache_dtype == "auto" else getattr(torch, cache.cache_dtype)
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size() * model.num_layers


def device_label(device: torch.device) -> str:
    """``"GPU"`` for a CUDA device, else its type in capitals (``"CPU"``): the device's
    name in ``transfer_type`` labels (``"CPU_to_GPU"``), as vLLM writes them."""
    return "GPU" if device.type == "cuda" else device.type.upper()


def block_dim_of(shape_of: object, block_size: int, num_kv_heads: int, head_size: int) -> int:
    """The dimension of a backend's KV-cache tensor that indexes blocks: the one that
    changes with the block count (``shape_of`` is ``AttentionBackend.get_kv_cache_shape``)."""
    one = shape_of(1, block_size, num_kv_heads, head_size)  # type: ignore[operator]
    two = shape_of(2, block_size, num_kv_heads, head_size)  # type: ignore[operator]
    dims = [d for d, (a, b) in enumerate(zip(one, two)) if a != b]
    if len(dims) != 1:
        raise ValueError(f"cannot tell the block dimension of the KV-cache shape {tuple(one)}")
    return dims[0]


@dataclass
class KVLayerCache:
    """One attention layer's KV cache, by block: what a worker-side connector registers
    (``KVConnectorBase.register_kv_caches``)."""

    name: str
    """The layer's name (its ``Attention.prefix``, e.g. ``model.layers.0.self_attn.attn``),
    as ``wait_for_layer_load`` and ``save_kv_layer`` name it."""
    tensor: torch.Tensor
    """The layer's whole cache, in its backend's layout."""
    block_dim: int
    """The dimension of ``tensor`` that indexes blocks."""
    group: int = 0
    """The KV-cache group the layer belongs to (0 for a model of one group)."""

    @property
    def num_blocks(self) -> int:
        """Blocks the cache holds."""
        return self.tensor.shape[self.block_dim]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of one block (``gather`` returns ``[n, *block_shape]``)."""
        shape = list(self.tensor.shape)
        del shape[self.block_dim]
        return tuple(shape)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of this layer."""
        return self.tensor.numel() // self.num_blocks * self.tensor.element_size()

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The blocks ``block_ids`` (int64, on the cache's device) as a new tensor
        ``[len(block_ids), *block_shape]`` on the cache's device."""
        return self.tensor.index_select(self.block_dim, block_ids).movedim(self.block_dim, 0)

    def scatter(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write ``blocks`` (``[len(block_ids), *block_shape]``, any device, the cache's
        dtype) into the blocks ``block_ids`` (int64, on the cache's device)."""
        src = blocks.to(self.tensor.device, non_blocking=True).movedim(0, self.block_dim)
        self.tensor.index_copy_(self.block_dim, block_ids, src)


class KVBlockFileError(ValueError):
    """A block file that is missing, truncated or written for another KV layout."""


class KVBlockFiles:
    """A folder of KV-cache blocks, one file per block named by its ``block_key``, each
    holding the block of every layer. Written atomically (a temporary file renamed into
    place), so a reader sees a whole block or none; read back bit for bit. Files are raw
    bytes behind a JSON header (no pickle: a shared folder must not run code). The header
    records the ``layout`` (the layers' dtype and block shapes): a file written for
    another layout is a ``KVBlockFileError``, never garbage KV."""

    def __init__(self, root: str | Path, layout: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.layout = [(str(dtype), tuple(shape)) for dtype, shape in layout]
        self._header = json.dumps({"layout": self.layout}).encode()

    def path(self, key: str) -> Path:
        """Where the block ``key`` lives (fanned out over subfolders by its first hash bytes)."""
        digest = key.rsplit("-", 1)[-1]
        return self.root / digest[:2] / f"{key}.kvb"

    def exists(self, key: str) -> bool:
        """Whether the block ``key`` is stored."""
        return self.path(key).is_file()

    def write(self, key: str, layers: Sequence[torch.Tensor]) -> int:
        """Store one block: its tensor in every layer (host tensors of the ``layout``);
        returns the bytes written."""
        self._check(layers)
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + _HEADER_LEN.pack(len(self._header)) + self._header)
                for t in layers:
                    data = t.detach().contiguous().view(torch.uint8).numpy().tobytes()
                    f.write(data)
                    size += len(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size

    def read(self, key: str, into: Sequence[torch.Tensor]) -> int:
        """Read the block ``key`` into ``into`` (one host tensor per layer, of the
        ``layout``); returns the bytes read. ``KVBlockFileError`` if the file is missing,
        short or of another layout."""
        self._check(into)
        path = self.path(key)
        try:
            raw = bytearray(path.read_bytes())
        except OSError as exc:
            raise KVBlockFileError(f"block {key}: cannot read {path}: {exc}") from None
        prefix = len(_MAGIC) + _HEADER_LEN.size
        if len(raw) < prefix or raw[: len(_MAGIC)] != _MAGIC:
            raise KVBlockFileError(f"block {key}: {path} is not a kvloom block file")
        (header_len,) = _HEADER_LEN.unpack_from(raw, len(_MAGIC))
        header = raw[prefix : prefix + header_len]
        if header != self._header:
            raise KVBlockFileError(f"block {key}: {path} was written for another KV layout")
        offset = prefix + header_len
        for t in into:
            n = t.numel() * t.element_size()
            if offset + n > len(raw):
                raise KVBlockFileError(f"block {key}: {path} is truncated")
            t.view(-1).view(torch.uint8).copy_(torch.frombuffer(raw, dtype=torch.uint8, count=n, offset=offset))
            offset += n
        if offset != len(raw):
            raise KVBlockFileError(f"block {key}: {path} has {len(raw) - offset} bytes too many")
        return offset - prefix - header_len

    def _check(self, layers: Sequence[torch.Tensor]) -> None:
        got = [(str(t.dtype), tuple(t.shape)) for t in layers]
        if got != self.layout:
            raise ValueError(f"block tensors {got[:2]}... do not match the store's layout {self.layout[:2]}...")
