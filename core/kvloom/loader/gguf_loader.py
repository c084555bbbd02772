"""Weights from a GGUF file, renamed to HF names and dequantized.

* The file's header is read by ``gguf_header`` (milliseconds; gguf-py's ``GGUFReader``
  takes seconds over a vocabulary), its data memory-mapped; each tensor is dequantized
  with ``gguf.quants.dequantize`` (Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/F32 -> float32).
* Names: llama.cpp's (``blk.0.attn_q.weight``) are mapped to HF's
  (``model.layers.0.self_attn.q_proj.weight``) with gguf-py's own tensor-name table, for
  exactly the HF names the model asks for, as transformers' GGUF loader does.
* llama.cpp's converter permutes the rows of the Q and K projections of ``llama``
  GGUF files (Llama, Mistral, SmolLM2...) from HF's "rotate half" RoPE layout to its
  interleaved one; ``unpermute_qk`` undoes it (transformers does the same).
* Dequantizing a file takes seconds (the metadata parse alone ~3 s for SmolLM2's
  49k-token vocabulary), so the dequantized tensors of files up to
  ``GGUF_WEIGHT_CACHE_MAX_BYTES`` are cached once as safetensors next to the converted
  config (``model_source.gguf_cache_dir``); ``KVLOOM_GGUF_WEIGHT_CACHE=0`` turns the
  cache off. The cache is keyed by the file's content (``gguf_metadata.gguf_cache_dir``):
  one copy per file, whichever environment or path reads it.
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

from kvloom.loader.gguf_header import GGUFHeader, read_gguf_header, tensor_data
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


def _dequantized_tensors(
    path: Path, header: GGUFHeader, name_map: dict[str, str], unpermute_heads: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for tensor in header.tensors:
        hf_name = name_map.get(tensor.name)
        if hf_name is None:
            logger.debug("GGUF tensor %s is not used by the model", tensor.name)
            continue
        weights = dequantize(tensor_data(mapped, header, tensor), tensor.ggml_type)
        for marker, n_head in unpermute_heads.items():
            if marker in tensor.name:
                weights = unpermute_qk(weights, n_head)
        if not weights.flags.writeable or not weights.flags.c_contiguous:
            weights = np.array(weights, copy=True, order="C")  # F32 tensors are views of the mmap
        yield hf_name, torch.from_numpy(weights)


def gguf_weights(path: str | Path, hf_config: Any, hf_names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` for each tensor of the GGUF file the model uses."""
    path = Path(path)
    hf_names = list(hf_names)
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
    header = read_gguf_header(path)
    arch_name = header.architecture
    name_map = gguf_to_hf_names(arch_name, hf_config.num_hidden_layers, hf_names)
    unpermute_heads: dict[str, int] = {}
    if arch_name in PERMUTED_QK_ARCHITECTURES:
        num_heads = hf_config.num_attention_heads
        unpermute_heads = {
            ".attn_q.": num_heads,
            ".attn_k.": getattr(hf_config, "num_key_value_heads", None) or num_heads,
        }
    size = sum(prod(t.shape) * 4 for t in header.tensors if t.name in name_map)
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
    bar = tqdm(total=len(name_map), desc=f"Dequantizing {path.name}", unit="tensor", dynamic_ncols=True)
    with bar:
        for name, tensor in _dequantized_tensors(path, header, name_map, unpermute_heads):
            bar.update(1)
            if use_cache:
                collected[name] = tensor
            yield name, tensor
    logger.info("Dequantized %d GGUF tensors of %s in %.1f s", len(name_map), path.name, time.perf_counter() - start)
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
