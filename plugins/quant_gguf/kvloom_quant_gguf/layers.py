"""The GGUF layers: linear layers and vocabulary tables whose weights run as stored.

One layer's checkpoint tensors (a merged layer's shards: ``q``, ``k``, ``v``) arrive as
``GGUFTensor``s (``load_weight`` keeps them; nothing is copied). After loading,
``process_weights_after_loading`` turns them into **segments**: runs of consecutive
output rows that one kernel computes, the shards of one kernel format together
(``formats``: U4, U8 or S8; a Q4_K_M file's Q4_K ``q``/``k`` and Q6_K ``v`` make two), or
float32 weights for float types (F32, F16, BF16) and for types without a kernel (IQ*,
TQ*, ...; dequantized at load, logged). Each segment's tensors are parameters of the layer
(``gguf_codes_<i>``, ``gguf_params_<i>`` or ``gguf_weight_<i>``), so a tied LM head shares
them with the embedding.

Repacking is cached per layer under ``KVLOOM_CACHE_DIR/gguf-repacked/<file content key>/``
(``GGUFTensor.content_key``, the file's SHA-256: the same file anywhere shares it), keyed again by the
layer's tensors and the layout version; a later load reads the segments from there
without touching the file's weights.

Forward (``apply``): one call of the C kernels (``kernels.LinearKernel``) quantizes the
input once and computes every kernel segment's columns of the output; float segments
compute with the input itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvloom.interfaces import (
    EmbeddingQuantMethod,
    GGUFTensor,
    LinearQuantMethod,
    ParamLayout,
    add_quantized_parameter,
    kvloom_cache_dir,
    prepare_c_library,
    remove_quantized_parameter,
)
from kvloom_quant_gguf import kernels
from kvloom_quant_gguf.formats import DECODERS, FLOAT_TYPES, FORMAT_NAMES, Decoded, decode
from kvloom_quant_gguf.layout import pack
from kvloom_quant_gguf.writer import quantize

logger = logging.getLogger(__name__)

#: The repacked layout's version: bump it when ``layout``, ``formats`` or ``kernels.c``
#: change what the cached tensors mean.
LAYOUT_VERSION = 1
FLOAT = -1
_NO_LAYOUT = ParamLayout()


@dataclass(frozen=True)
class Segment:
    """Output rows ``[start, start + rows)`` of a layer, computed by one kernel format (or ``FLOAT``)."""

    fmt: int
    start: int
    rows: int


def _kernel_format(ggml_type: int) -> int:
    return DECODERS[ggml_type][0] if ggml_type in DECODERS else FLOAT


def _float_weight(prefix: str, loaded: Any) -> torch.Tensor:
    """A shard without a kernel, as float32 (logged unless stored as a float type)."""
    if isinstance(loaded, GGUFTensor) and loaded.ggml_type not in FLOAT_TYPES:
        logger.warning("%s: GGUF type %s has no kvloom kernel; dequantized to float32 at load", prefix,
                       loaded.type_name)  # fmt: skip
    value = loaded.materialize() if hasattr(loaded, "materialize") else loaded  # a lazy handle, or a tensor
    return value.float().contiguous()


def _concat(parts: list[Decoded]) -> Decoded:
    if len(parts) == 1:
        return parts[0]
    mins = None if parts[0].min is None else np.concatenate([p.min for p in parts])  # type: ignore[misc]
    return Decoded(parts[0].fmt, np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                   mins)  # fmt: skip


class _GGUFWeights:
    """What the linear and table methods share: loading shards, segments, cache, forward."""

    def __init__(self, writer_type: int, activation_bits: int) -> None:
        self.writer_type = writer_type
        self.bits = activation_bits
        self.segments: list[Segment] = []
        self.kernel: kernels.LinearKernel | None = None  # the kernel segments, as the C entry takes them

    # ------------------------------------------------------------ construction, loading
    def create_weights(self, layer: Any) -> None:
        prepare_c_library(kernels.SOURCE)  # ~2-3 s of compiling, while the weights load
        # A placeholder, so that the model loader routes the checkpoint's "weight" here.
        add_quantized_parameter(layer, "weight", torch.empty(0, dtype=torch.uint8), _NO_LAYOUT)
        layer.__dict__["gguf_shards"] = {}

    def load_weight(self, layer: Any, name: str, param: Any, loaded: Any, shard: str | None) -> None:
        if name != "weight":
            raise ValueError(f"{layer.prefix}: GGUF layers load 'weight' tensors only, not {name!r}")
        if getattr(layer, "tp_size", 1) != 1:
            raise ValueError(f"{layer.prefix}: GGUF weights do not run tensor-parallel (tensor_parallel_size 1)")
        expected = (self.shard_rows(layer, shard), self.cols(layer))
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{layer.prefix}.weight{'' if shard is None else f' (shard {shard})'}: checkpoint "
                             f"tensor has shape {tuple(loaded.shape)}, expected {expected}")  # fmt: skip
        layer.gguf_shards[shard] = loaded

    def shard_names(self, layer: Any) -> list[str | None]:
        return [None]

    def shard_rows(self, layer: Any, shard: str | None) -> int:
        raise NotImplementedError

    def cols(self, layer: Any) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------ after loading
    def process_weights_after_loading(self, layer: Any) -> None:
        shards = [layer.gguf_shards[name] for name in self.shard_names(layer)]
        cache_file, key = self._cache_entry(layer, shards)
        tensors = _read_cache(cache_file, key) if cache_file is not None else None
        if tensors is None:
            tensors = self._repack(layer, shards)
            if cache_file is not None:
                _write_cache(cache_file, key, tensors)
        self.segments = [Segment(*map(int, row)) for row in tensors.pop("segments").tolist()]
        self.kernel = None
        remove_quantized_parameter(layer, "weight")
        for name, tensor in tensors.items():
            add_quantized_parameter(layer, name, tensor, _NO_LAYOUT)
        del layer.__dict__["gguf_shards"]  # the file's pages are not needed any more

    def _repack(self, layer: Any, shards: list[Any]) -> dict[str, torch.Tensor]:
        names, cols = self.shard_names(layer), self.cols(layer)
        types = [s.ggml_type if isinstance(s, GGUFTensor) else FLOAT for s in shards]
        # Consecutive shards of one kernel format run as one segment (one GEMM).
        runs: list[list[int]] = []
        for i, ggml_type in enumerate(types):
            fmt = _kernel_format(ggml_type)
            if runs and fmt != FLOAT and _kernel_format(types[runs[-1][0]]) == fmt:
                runs[-1].append(i)
            else:
                runs.append([i])
        tensors: dict[str, torch.Tensor] = {}
        segments, start = [], 0
        for index, run in enumerate(runs):
            fmt = _kernel_format(types[run[0]])
            if fmt == FLOAT:
                tensors[f"gguf_weight_{index}"] = _float_weight(layer.prefix, shards[run[0]])
            else:
                merged = _concat([decode(shards[i].raw, types[i], cols) for i in run])
                tensors[f"gguf_codes_{index}"], tensors[f"gguf_params_{index}"] = pack(merged)
            rows = sum(self.shard_rows(layer, names[i]) for i in run)
            segments.append([fmt, start, rows])
            start += rows
        tensors["segments"] = torch.tensor(segments, dtype=torch.int64)
        return tensors

    def _cache_entry(self, layer: Any, shards: list[Any]) -> tuple[Path | None, str]:
        if not all(isinstance(s, GGUFTensor) and s.content_key for s in shards):
            return None, ""
        what = [(s.gguf_name, s.ggml_type, tuple(s.shape)) for s in shards]
        key = hashlib.sha256(json.dumps([LAYOUT_VERSION, layer.prefix, what]).encode()).hexdigest()
        directory = kvloom_cache_dir() / "gguf-repacked" / f"{shards[0].content_key[:32]}-v{LAYOUT_VERSION}"
        return directory / f"{layer.prefix}.safetensors", key

    # ------------------------------------------------------------ forward, reference
    def matmul(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """``x [..., cols] @ W.T`` in float32 (``[..., rows]``). At batch 1 this wrapper costs as
        much as a small layer's GEMM, so it does only what every call needs: the kernel's
        arguments are built once (again only when the weights moved)."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        params = layer._parameters
        last = self.segments[-1]
        out = torch.empty(x2.shape[0], last.start + last.rows)
        for index, seg in enumerate(self.segments):
            if seg.fmt == FLOAT:
                out[:, seg.start : seg.start + seg.rows] = torch.mm(x2, params[f"gguf_weight_{index}"].t())
        kernel = self.kernel
        if kernel is None or not kernel.holds(params):
            kernel = self.kernel = self._build_kernel(params)
        if kernel.count:
            kernel(self.bits, x2, out)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[1])

    def _build_kernel(self, params: dict[str, torch.Tensor]) -> kernels.LinearKernel:
        return kernels.LinearKernel([(seg.fmt, seg.start, seg.rows, f"gguf_codes_{index}", f"gguf_params_{index}")
                                     for index, seg in enumerate(self.segments) if seg.fmt != FLOAT], params)  # fmt: skip

    def dequantize_rows(self, layer: Any, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ``ids`` of the weight."""
        params = layer._parameters
        ids = ids.reshape(-1)
        if len(self.segments) == 1:
            return self._segment_rows(params, 0, ids, self.cols(layer))
        out = torch.empty(ids.numel(), self.cols(layer))
        for index, seg in enumerate(self.segments):
            inside = (ids >= seg.start) & (ids < seg.start + seg.rows)
            if inside.any():
                out[inside] = self._segment_rows(params, index, ids[inside] - seg.start, self.cols(layer))
        return out

    def _segment_rows(self, params: dict, index: int, ids: torch.Tensor, cols: int) -> torch.Tensor:
        seg = self.segments[index]
        if seg.fmt == FLOAT:
            return params[f"gguf_weight_{index}"][ids].float()
        return kernels.rows(seg.fmt, ids, cols, params[f"gguf_codes_{index}"], params[f"gguf_params_{index}"])

    def quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        """The reference input: quantized per 32 features where any segment runs a kernel."""
        if all(seg.fmt == FLOAT for seg in self.segments):
            return x.float()
        return kernels.fake_quantize(x.float(), self.bits)

    def describe_segments(self) -> str:
        return ", ".join("float32" if s.fmt == FLOAT else FORMAT_NAMES[s.fmt] for s in self.segments)

    def checkpoint_tensors(self, weight: torch.Tensor, input_absmax: float = 8.0) -> dict[str, Any]:
        raw = quantize(weight.float().numpy(), self.writer_type)
        return {"weight": GGUFTensor("weight", raw, self.writer_type, tuple(weight.shape))}


def _read_cache(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
        return load_file(str(path))
    except (OSError, ValueError, RuntimeError):  # missing, partial or foreign: repack
        return None


def _write_cache(path: Path, key: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"key": key})
        os.replace(tmp, path)
    except OSError as e:  # a read-only or full cache directory only costs the repacking next time
        logger.warning("Could not cache repacked GGUF weights in %s: %s", path, e)
        tmp.unlink(missing_ok=True)


class GgufLinearMethod(_GGUFWeights, LinearQuantMethod):
    """GGUF weights of one ``Linear`` / ``MergedLinear`` / ``QKVLinear``."""

    def shard_names(self, layer: Any) -> list[str | None]:
        return [None] if len(layer.shard_names) == 1 else list(layer.shard_names)

    def shard_rows(self, layer: Any, shard: str | None) -> int:
        return layer.output_size if shard is None else layer.output_sizes[layer.shard_names.index(shard)]

    def cols(self, layer: Any) -> int:
        return layer.input_size

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.matmul(layer, x)
        if bias is not None:
            out += bias
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def dequantize(self, layer: Any) -> torch.Tensor:
        return self.dequantize_rows(layer, torch.arange(layer.output_size))

    def reference_input(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return self.quantized_input(x)


class GgufEmbeddingMethod(_GGUFWeights, EmbeddingQuantMethod):
    """A GGUF vocabulary table (``token_embd``; the LM head ``output``, or the embedding's
    when tied): lookups dequantize the rows asked for, logits run the GEMM."""

    def shard_rows(self, layer: Any, shard: str | None) -> int:
        return layer.rows

    def cols(self, layer: Any) -> int:
        return layer.embedding_dim

    def embedding(self, layer: Any, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize_rows(layer, ids).reshape(*ids.shape, -1).to(layer.params_dtype)

    def apply(self, layer: Any, hidden: torch.Tensor) -> torch.Tensor:
        out = self.matmul(layer, hidden)
        return out if hidden.dtype == torch.float32 else out.to(hidden.dtype)

    def dequantize(self, layer: Any) -> torch.Tensor:
        return self.dequantize_rows(layer, torch.arange(layer.rows))

    def reference_input(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return self.quantized_input(x)
