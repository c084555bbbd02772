"""Weights from a GGUF file, renamed to HF names: dequantized, or as stored.

* The file's header is read by ``gguf_header`` (milliseconds; gguf-py's ``GGUFReader``
  takes seconds over a vocabulary), its data memory-mapped (``gguf_file.tensor_rows``).
* Names: llama.cpp's (``blk.0.attn_q.weight``) are mapped to HF's
  (``model.layers.0.self_attn.q_proj.weight``) with gguf-py's own tensor-name table, for
  exactly the HF names the model asks for, as transformers' GGUF loader does.
* llama.cpp's converter permutes the rows of the Q and K projections of ``llama``
  GGUF files (Llama, Mistral, SmolLM2...) from HF's "rotate half" RoPE layout to its
  interleaved one; ``unpermute_qk`` undoes it (transformers does the same). GGML blocks
  run along rows, so the permutation moves whole rows of blocks: it is undone on the
  stored bytes as exactly as on floats.
* ``raw=False`` (``--quantization none``, or no installed method reads GGUF): each tensor
  is dequantized with ``gguf.quants.dequantize`` (Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/F32 ->
  float32). Dequantizing takes seconds, so the dequantized tensors of files up to
  ``GGUF_WEIGHT_CACHE_MAX_BYTES`` are cached once as safetensors next to the converted
  config (``model_source.gguf_cache_dir``); ``KVLOOM_GGUF_WEIGHT_CACHE=0`` turns the
  cache off. The cache is keyed by the file's content (``gguf_metadata.gguf_cache_dir``):
  one copy per file, whichever environment or path reads it.
* ``raw=True`` (the model's quantization method claims ``"gguf"``): every 2-D tensor comes
  as a ``GGUFTensor`` (its GGML type and raw bytes; a lazy tensor that dequantizes when a
  plain weight loader materializes it), 1-D tensors (norms, biases) as float32 tensors.
  Nothing is dequantized or cached here: the method repacks and caches what it needs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from kvloom.loader.gguf_file import GGUFTensor, dequantize_rows, tensor_rows
from kvloom.loader.gguf_header import GGUFTensorInfo, read_gguf_header
from kvloom.loader.gguf_metadata import gguf_content_id
from kvloom.loader.lazy_tensor import CheckpointTensor
from kvloom.loader.model_source import gguf_cache_dir

logger = logging.getLogger(__name__)

#: GGUF architectures whose Q/K rows llama.cpp permuted (transformers' LlamaTensorProcessor).
PERMUTED_QK_ARCHITECTURES = ("llama",)
GGUF_WEIGHT_CACHE_MAX_BYTES = 4 * 2**30
_CACHE_FILE = "weights-v1.safetensors"


def unpermute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permutation of the rows of a Q or K projection (weight or bias):
    per head, rows were reordered from ``[x0..x(d/2-1), y0..]`` to pairs ``(x0, y0), ...``."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _architecture_enum(arch_name: str) -> Any:
    from gguf import MODEL_ARCH_NAMES

    for arch, name in MODEL_ARCH_NAMES.items():
        if name == arch_name:
            return arch
    raise NotImplementedError(f"GGUF architecture {arch_name!r} is unknown to the installed gguf package")


def gguf_to_hf_names(arch_name: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, str]:
    """``{gguf_name: hf_name}`` for the HF names a model needs (names gguf-py cannot map
    are left out; the model reports them as missing)."""
    from gguf import get_tensor_name_map

    name_map = get_tensor_name_map(_architecture_enum(arch_name), num_layers)
    mapping: dict[str, str] = {}
    for hf_name in hf_names:
        base, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            base, _, suffix = hf_name.rpartition(".")
            suffix = "." + suffix
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            mapping[gguf_name + suffix] = hf_name
    return mapping


class _GGUFWeights:
    """The tensors of one GGUF file that a model uses, by HF name."""

    def __init__(self, path: Path, hf_config: Any, hf_names: list[str]) -> None:
        self.header = header = read_gguf_header(path)
        arch_name = header.architecture
        self.path = path
        self.name_map = gguf_to_hf_names(arch_name, hf_config.num_hidden_layers, hf_names)
        self.tensors = [info for info in header.tensors if info.name in self.name_map]
        for info in header.tensors:
            if info.name not in self.name_map:
                logger.debug("GGUF tensor %s is not used by the model", info.name)
        self.unpermute_heads: dict[str, int] = {}
        if arch_name in PERMUTED_QK_ARCHITECTURES:
            num_heads = hf_config.num_attention_heads
            self.unpermute_heads = {
                ".attn_q.": num_heads,
                ".attn_k.": getattr(hf_config, "num_key_value_heads", None) or num_heads,
            }
        with open(path, "rb") as f:
            self.data = np.memmap(f, dtype=np.uint8, mode="r")

    def _in_hf_order(self, info: GGUFTensorInfo, rows: np.ndarray) -> np.ndarray:
        for marker, n_head in self.unpermute_heads.items():
            if marker in info.name:
                return unpermute_qk(rows, n_head)
        return rows

    def _stored_rows(self, info: GGUFTensorInfo) -> np.ndarray:
        try:
            return tensor_rows(self.data, self.header, info)
        except ValueError as e:  # a truncated file or an unknown type: name the file
            raise ValueError(f"model: {self.path}: {e}") from None

    def rows(self, info: GGUFTensorInfo) -> np.ndarray:
        """The stored rows of ``info``'s (2-D or larger) tensor, in HF's row order."""
        return self._in_hf_order(info, self._stored_rows(info))

    def dequantized(self, info: GGUFTensorInfo) -> torch.Tensor:
        weights = dequantize_rows(self._stored_rows(info), info.ggml_type, info.shape[-1]).reshape(info.shape)
        return torch.from_numpy(np.ascontiguousarray(self._in_hf_order(info, weights)))

    def raw(self, info: GGUFTensorInfo, content_key: str) -> GGUFTensor | torch.Tensor:
        hf_name = self.name_map[info.name]
        if len(info.shape) < 2:
            return self.dequantized(info)
        return GGUFTensor(hf_name, self.rows(info), info.ggml_type, info.shape, content_key, info.name, str(self.path))


def gguf_weights(
    path: str | Path, hf_config: Any, hf_names: Iterable[str], raw: bool = False
) -> Iterator[tuple[str, CheckpointTensor]]:
    """``(hf_name, tensor)`` for each tensor of the GGUF file the model uses: float32
    tensors, or with ``raw`` ``GGUFTensor``s as stored (see the module docstring)."""
    path = Path(path)
    hf_names = list(hf_names)
    if raw:
        file = _GGUFWeights(path, hf_config, hf_names)
        content_key = gguf_content_id(path)
        logger.info("Reading the GGUF weights of %s as stored (%d tensors)", path.name, len(file.tensors))
        for info in file.tensors:
            yield file.name_map[info.name], file.raw(info, content_key)
        return
    use_cache = os.environ.get("KVLOOM_GGUF_WEIGHT_CACHE", "1") != "0"
    cache_file = gguf_cache_dir(path) / _CACHE_FILE
    if use_cache and cache_file.is_file():
        from safetensors import safe_open

        logger.info("Loading dequantized GGUF weights of %s from %s", path.name, cache_file)
        wanted = set(hf_names)
        with safe_open(str(cache_file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in wanted:
                    yield name, f.get_tensor(name)
        return

    logger.info("Dequantizing GGUF weights of %s", path.name)
    file = _GGUFWeights(path, hf_config, hf_names)
    size = sum(prod(t.shape) * 4 for t in file.tensors)
    if use_cache and size > GGUF_WEIGHT_CACHE_MAX_BYTES:
        logger.info(
            "Not caching %.1f GiB of dequantized GGUF weights (limit %.1f GiB)",
            size / 2**30,
            GGUF_WEIGHT_CACHE_MAX_BYTES / 2**30,
        )
        use_cache = False
    collected: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    # The first load of a GGUF file dequantizes every tensor (tens of seconds for a small
    # model on a slow CPU): a progress bar says it is working, the log how long it took.
    bar = tqdm(total=len(file.tensors), desc=f"Dequantizing {path.name}", unit="tensor", dynamic_ncols=True)
    with bar:
        for info in file.tensors:
            name, tensor = file.name_map[info.name], file.dequantized(info)
            bar.update(1)
            if use_cache:
                collected[name] = tensor
            yield name, tensor
    logger.info(
        "Dequantized %d GGUF tensors of %s in %.1f s", len(file.tensors), path.name, time.perf_counter() - start
    )
    if use_cache and collected:
        _write_cache(cache_file, collected)


def _write_cache(cache_file: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    size = sum(t.numel() * t.element_size() for t in tensors.values())
    tmp = cache_file.with_name(cache_file.name + f".tmp{os.getpid()}")
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp))
        os.replace(tmp, cache_file)
        logger.info("Cached dequantized GGUF weights in %s (%.0f MiB)", cache_file, size / 2**20)
    except OSError as e:  # a read-only or full cache directory only costs speed
        logger.warning("Could not cache dequantized GGUF weights in %s: %s", cache_file, e)
        tmp.unlink(missing_ok=True)
