"""Weight iterators for HF model directories, and dummy (random) weights.

An HF directory holds safetensors files (one, or shards listed in
``model.safetensors.index.json``) or PyTorch ``.bin`` files (likewise, with
``pytorch_model.bin.index.json``). Iterators yield ``(hf_name, cpu_tensor)`` one tensor
at a time, memory-mapped where the format allows, so peak memory stays near the model's
own size. With ``lazy=True`` the safetensors iterator yields ``LazyTensor`` handles
instead (``kvloom.loader.lazy_tensor``): a tensor-parallel rank then reads only the
slices its layers keep. ``.bin`` files always yield whole (memory-mapped) tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from kvloom.layers.layernorm import RMSNorm
from kvloom.loader.lazy_tensor import CheckpointTensor, LazyTensor

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"


def _files_from_index(model_dir: Path, index_name: str) -> list[Path]:
    with open(model_dir / index_name) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted({model_dir / name for name in weight_map.values()})
    missing = [str(p.name) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"model: {model_dir} is missing shards listed in {index_name}: {', '.join(missing)}")
    return files


def find_weight_files(model_dir: str | Path, load_format: str = "auto") -> tuple[str, list[Path]]:
    """``("safetensors" | "pt", files)`` for an HF directory.

    ``load_format`` "auto" prefers safetensors and falls back to ``.bin`` only when the
    directory has no safetensors; "safetensors" and "pt" accept only that format. Without
    an index, every ``*.safetensors`` file is a shard, except Mistral's
    ``consolidated*.safetensors`` (the same weights in Mistral's own naming) when
    HF-named files sit next to it.
    """
    model_dir = Path(model_dir)
    if load_format not in ("auto", "safetensors", "pt"):
        raise ValueError(f"load_format: {load_format!r} does not read an HF directory (allowed: auto, safetensors, pt)")
    if load_format in ("auto", "safetensors"):
        if (model_dir / SAFETENSORS_INDEX).is_file():
            return "safetensors", _files_from_index(model_dir, SAFETENSORS_INDEX)
        files = sorted(model_dir.glob("*.safetensors"))
        hf_named = [p for p in files if not p.name.startswith("consolidated")]
        if hf_named:
            return "safetensors", hf_named
        if files:
            return "safetensors", files
    if load_format in ("auto", "pt"):
        if (model_dir / PT_INDEX).is_file():
            return "pt", _files_from_index(model_dir, PT_INDEX)
        files = sorted(p for p in model_dir.glob("*.bin") if p.name != "training_args.bin")
        if files:
            return "pt", files
    wanted = {"auto": "*.safetensors or *.bin", "safetensors": "*.safetensors", "pt": "*.bin"}[load_format]
    raise FileNotFoundError(f"model: no weight files ({wanted}) in {model_dir}")


def safetensors_weights(
    files: list[Path],
    origins: dict[str, Path] | None = None,
    skip: Callable[[str], bool] | None = None,
    lazy: bool = False,
) -> Iterator[tuple[str, CheckpointTensor]]:
    """The tensors of ``files``; ``origins``, when given, records each name's file. Names
    for which ``skip`` is true are never read (another pipeline stage's tensors). With
    ``lazy``, ``LazyTensor`` handles: nothing is read until a loader materialises (a
    region of) one; a handle stays readable after the iterator moved on."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as exc:
            raise _unreadable(path, exc) from exc
        with f:
            for name in f.keys():
                if skip is not None and skip(name):
                    continue
                try:
                    # A slice keeps its own reference to the mapped file: it outlives ``f``.
                    tensor: CheckpointTensor = (
                        LazyTensor(name, f.get_slice(name), str(path)) if lazy else f.get_tensor(name)
                    )
                except SafetensorError as exc:
                    raise _unreadable(path, exc) from exc
                if origins is not None:
                    origins[name] = path
                yield name, tensor


def _unreadable(path: Path, exc: BaseException) -> ValueError:
    size = path.stat().st_size if path.is_file() else 0
    return ValueError(
        f"weights: cannot read {path} ({size} bytes): {exc}. The file may be truncated or corrupt "
        "(an interrupted download?); download it again."
    )


def pt_weights(
    files: list[Path], origins: dict[str, Path] | None = None, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``files``; ``origins``, when given, records each name's file. Names
    for which ``skip`` is true are left out (memory-mapped: their bytes are not read)."""
    for path in files:
        # weights_only: a checkpoint must not run code; mmap: no full copy in memory.
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, EOFError) as exc:  # torch's errors for a truncated zip or pickle
            raise _unreadable(path, exc) from exc
        for name, tensor in state.items():
            if skip is not None and skip(name):
                continue
            if origins is not None:
                origins[name] = path
            yield name, tensor
        del state


def hf_dir_weights(
    model_dir: str | Path,
    load_format: str = "auto",
    origins: dict[str, Path] | None = None,
    skip: Callable[[str], bool] | None = None,
    lazy: bool = False,
) -> Iterator[tuple[str, CheckpointTensor]]:
    """All tensors of an HF model directory as ``(name, tensor)``, but those ``skip``
    names; ``origins``, when given, records the file of each name read (for errors that
    name the file). ``lazy``: safetensors tensors come as ``LazyTensor`` handles (``.bin``
    tensors are whole either way)."""
    kind, files = find_weight_files(model_dir, load_format)
    logger.info("Loading %s weights from %d file(s) in %s", kind, len(files), model_dir)
    if kind == "safetensors":
        return safetensors_weights(files, origins, skip, lazy)
    return pt_weights(files, origins, skip)


#: Half-width of the uniform distribution of dummy weights: small enough that
#: activations of deep models stay finite in fp16/bf16.
DUMMY_WEIGHT_RANGE = 1e-3


@torch.no_grad()
def initialize_dummy_weights(
    model: nn.Module, seed: int = 0, low: float = -DUMMY_WEIGHT_RANGE, high: float = DUMMY_WEIGHT_RANGE
) -> None:
    """Fill every parameter with reproducible random values, generated on its device.

    Norm weights are 1 (the identity scale); everything else is uniform in
    ``[low, high]``. The same seed gives the same weights on the same device type.
    """
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in model.named_parameters():
        if id(param) in norm_params:
            param.data.fill_(1.0)
            continue
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        if param.dtype.itemsize == 1 and param.is_floating_point():
            # 8-bit floats (fp8 quantized weights) have no uniform_: draw in float32.
            values = torch.empty(param.shape, device=device).uniform_(low, high, generator=generators[device])
            param.data.copy_(values)
        elif param.is_floating_point():
            param.data.uniform_(low, high, generator=generators[device])
