"""PEFT-format LoRA adapters: reading, validating and loading them on the CPU.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``). PEFT names each weight after the module it adapts, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (``[rank, in]``) and
``...q_proj.lora_B.weight`` (``[out, rank]``). kvloom applies adapters to the attention and
MLP projections of its models, so only those may be targeted.

``validate_adapter_config`` is shared by the engine (``LoRAManager``) and the resolver
plugins, so both report the same errors for the same bad adapter.

The base model: kvloom does not hold an adapter to the base model its config records
(``base_model_name_or_path``), as vLLM's server does not: the engine loads any adapter
whose matrices fit the model's projections (a module the model lacks, or a wrong shape, is
an error). ``validate_adapter_config(..., base_model_name=...)`` is an opt-in check for
resolvers that want one (``_same_model`` says what matches).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvloom.utils import read_json_object

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

#: The HF projection names kvloom can adapt (attention and MLP of the Llama family).
SUPPORTED_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_WEIGHT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[\w-]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that kvloom cannot use; the message names the adapter and the problem.
    Raised by ``read_adapter_config``, ``validate_adapter_config`` and kvloom's adapter
    loading; a ``ValueError``, so a resolver that lets it through refuses the adapter (the
    client gets a 400)."""


def read_adapter_config(path: str | Path, name: str | None = None) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of the adapter directory ``path``; a
    ``LoRAAdapterError`` naming ``name`` (default: the path) when the directory or the file
    is missing or the file is not a JSON object."""
    path = Path(path)
    label = name or str(path)
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {label}: {path} is not a directory")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {label}: {config_file} does not exist")
    try:
        return read_json_object(config_file)
    except ValueError as exc:
        raise LoRAAdapterError(f"LoRA adapter {label}: {exc}") from None


def _target_names(target_modules: Any) -> list[str] | None:
    """The projection names a config targets; None when it gives a regex (checked
    against the weights instead)."""
    if target_modules is None:
        return []
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return list(SUPPORTED_TARGET_MODULES)
        return None
    return [str(t).rsplit(".", 1)[-1] for t in target_modules]


def validate_adapter_config(
    config: dict[str, Any],
    max_lora_rank: int | None = None,
    base_model_name: str | Sequence[str] | None = None,
    name: str = "adapter",
) -> None:
    """Raise ``LoRAAdapterError`` (a ``ValueError``) if kvloom cannot run this adapter; its
    message names the adapter (``name``) and the problem.

    Checks: ``peft_type`` is LORA; the rank ``r`` is a positive int no larger than
    ``max_lora_rank`` (when given); every target module is one of
    ``SUPPORTED_TARGET_MODULES``; no feature kvloom lacks (DoRA, trained biases,
    per-module ranks, extra trained modules).

    The base model is checked only when ``base_model_name`` is given: one name of the
    served model, or several (the served name and the model's path, say). The adapter's
    ``base_model_name_or_path`` (what peft recorded: the HF repo id or the path the base
    model was loaded from) then must match one of them: the same string, the same
    existing path, or the same final path component (``meta-llama/Llama-3.2-1B``,
    ``/srv/models/Llama-3.2-1B`` and ``Llama-3.2-1B`` all match one another; case
    counts). An adapter that records no base model passes. kvloom itself never passes
    ``base_model_name``: the server does not enforce the base model.
    """
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name}: peft_type is {peft_type!r}; only 'LORA' is supported")
    if base_model_name is not None:
        names = [base_model_name] if isinstance(base_model_name, str) else list(base_model_name)
        base = config.get("base_model_name_or_path")
        if base is not None and not any(_same_model(str(base), n) for n in names):
            served = " or ".join(repr(n) for n in names)
            raise LoRAAdapterError(
                f"LoRA adapter {name}: base_model_name_or_path is {base!r}, but this server runs {served} "
                "(accepted: the same name or path, or the same final path component)"
            )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"LoRA adapter {name}: r must be a positive integer, got {rank!r}")
    if max_lora_rank is not None and rank > max_lora_rank:
        raise LoRAAdapterError(
            f"LoRA adapter {name}: LoRA rank {rank} exceeds max_lora_rank {max_lora_rank} "
            f"(start the engine with --max-lora-rank {rank} or more)"
        )
    targets = _target_names(config.get("target_modules"))
    if targets is not None:
        bad = sorted(set(targets) - set(SUPPORTED_TARGET_MODULES))
        if bad:
            raise LoRAAdapterError(
                f"LoRA adapter {name}: target_modules {bad} are not supported "
                f"(allowed: {', '.join(SUPPORTED_TARGET_MODULES)})"
            )
    if config.get("use_dora"):
        raise LoRAAdapterError(f"LoRA adapter {name}: use_dora is not supported")
    if config.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"LoRA adapter {name}: bias={config.get('bias')!r} is not supported (allowed: 'none')")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(
            f"LoRA adapter {name}: modules_to_save {config['modules_to_save']} is not supported "
            "(kvloom adapts projections only)"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name}: {key} is not supported (one rank and alpha per adapter)")


def _final_component(name: str) -> str:
    """``Llama-3.2-1B`` of ``meta-llama/Llama-3.2-1B``, ``/srv/models/Llama-3.2-1B/`` and itself."""
    return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _same_model(recorded: str, name: str) -> bool:
    """Whether an adapter recorded for ``recorded`` belongs to the model called ``name``:
    the same string, the same existing path, or the same (non-empty) final path component."""
    if recorded == name:
        return True
    pa, pb = Path(recorded).expanduser(), Path(name).expanduser()
    if pa.exists() and pb.exists() and pa.resolve() == pb.resolve():
        return True
    last = _final_component(recorded)
    return bool(last) and last == _final_component(name)


def adapter_scaling(config: dict[str, Any]) -> float:
    """PEFT's scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    rank = config["r"]
    alpha = config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _read_weights(path: Path, name: str) -> dict[str, torch.Tensor]:
    for filename in WEIGHT_FILES:
        file = path / filename
        if not file.is_file():
            continue
        if filename.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        state = torch.load(str(file), map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise LoRAAdapterError(f"LoRA adapter {name}: {file} does not hold a state dict")
        return state
    raise LoRAAdapterError(f"LoRA adapter {name}: {path} has no weights ({' or '.join(WEIGHT_FILES)})")


@dataclass
class LoRAAdapter:
    """One adapter's weights on the CPU, keyed by the HF module name they adapt
    (``model.layers.0.self_attn.q_proj``): ``(A [rank, in], B [out, rank] * scaling)``."""

    lora_int_id: int
    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(
    lora_int_id: int, name: str, path: str | Path, max_lora_rank: int, base_model_name: str | None = None
) -> LoRAAdapter:
    """Read and validate the PEFT adapter at ``path`` (float32 weights, scaling folded
    into B)."""
    path = Path(path)
    config = read_adapter_config(path, name)
    validate_adapter_config(config, max_lora_rank, base_model_name, name)
    scaling = adapter_scaling(config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_weights(path, name).items():
        match = _WEIGHT_KEY.match(key)
        if match is None:
            raise LoRAAdapterError(
                f"LoRA adapter {name}: weight {key!r} is not a lora_A/lora_B matrix of a projection "
                f"(supported modules: {', '.join(SUPPORTED_TARGET_MODULES)})"
            )
        module = match.group("module")
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in SUPPORTED_TARGET_MODULES:
            raise LoRAAdapterError(
                f"LoRA adapter {name}: weight {key!r} adapts {leaf!r}, which is not supported "
                f"(allowed: {', '.join(SUPPORTED_TARGET_MODULES)})"
            )
        pairs.setdefault(module, {})[match.group("which")] = tensor
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name}: the weights file holds no LoRA matrices")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    rank = config["r"]
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name}: {module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(
                f"LoRA adapter {name}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"expected [r, in] and [out, r] with r={rank}"
            )
        weights[module] = (a.contiguous(), (b * scaling).contiguous())
    logger.info("Loaded LoRA adapter %s (id %d, rank %d, %d modules) from %s",
                name, lora_int_id, rank, len(weights), path)  # fmt: skip
    return LoRAAdapter(lora_int_id, name, str(path), rank, scaling, weights)
