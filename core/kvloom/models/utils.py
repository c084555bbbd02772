"""Weight-name bookkeeping shared by the model classes.

kvloom models keep HF's module names except for the merged projections (``qkv_proj``,
``gate_up_proj``) and the stacked experts of a ``FusedMoE`` (``w13_weight``, ``w2_weight``,
which name their per-expert checkpoint tensors through ``checkpoint_shards``). ``checkpoint_names`` lists every HF checkpoint name a model needs and
where it goes; ``load_checkpoint_weights`` loads by that map and reports what is missing.
The GGUF loader uses the same map to translate llama.cpp tensor names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvloom.layers.linear import LinearBase

logger = logging.getLogger(__name__)

#: (merged module name, checkpoint module name, shard) of the Llama family.
LLAMA_STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "0"),
    ("gate_up_proj", "up_proj", "1"),
)


def packed_modules_mapping(stacked: Sequence[tuple[str, str, str]]) -> dict[str, list[str]]:
    """``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}`` (vLLM's attribute, used by LoRA)."""
    mapping: dict[str, list[str]] = {}
    for merged, original, _ in stacked:
        mapping.setdefault(merged, []).append(original)
    return mapping


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter of a module, and its shard if merged."""

    param_name: str
    module: nn.Module
    param: nn.Parameter
    shard: str | None


def param_checkpoint_names(
    modules: dict[str, nn.Module], param_name: str, shard_to_original: dict[tuple[str, str], str]
) -> list[tuple[str, str | None]]:
    """The checkpoint tensors of one parameter: ``(HF name, shard for weight_loader)``.

    * a module with a ``checkpoint_shards(leaf)`` method names them itself, relative to
      its own name (``FusedMoE``: one tensor per expert and projection);
    * a merged projection (``LinearBase`` with several shards) has one per shard, named by
      the model's ``stacked_params`` (``shard_to_original``);
    * any other parameter is its own checkpoint name.
    """
    module_name, _, leaf = param_name.rpartition(".")
    module = modules.get(module_name)  # None for a module path that named_modules() deduplicated
    shards_of = getattr(module, "checkpoint_shards", None)
    if callable(shards_of):
        return [(f"{module_name}.{rel}" if module_name else rel, shard) for rel, shard in shards_of(leaf)]
    if isinstance(module, LinearBase) and len(module.shard_names) > 1:
        parent, _, merged = module_name.rpartition(".")
        names: list[tuple[str, str | None]] = []
        for shard in module.shard_names:
            original = shard_to_original.get((merged, shard))
            if original is None:
                raise ValueError(f"{module_name}: no checkpoint name for shard {shard!r} of {merged!r}")
            names.append((f"{parent}.{original}.{leaf}" if parent else f"{original}.{leaf}", shard))
        return names
    return [(param_name, None)]


def checkpoint_names(model: nn.Module, stacked: Sequence[tuple[str, str, str]]) -> dict[str, WeightTarget]:
    """Every HF checkpoint name ``model`` needs, mapped to its target
    (``param_checkpoint_names`` for each parameter).

    Shared (tied) parameters appear once, under the name of their first owner.
    """
    modules = dict(model.named_modules())
    shard_to_original = {(merged, shard): original for merged, original, shard in stacked}
    names: dict[str, WeightTarget] = {}
    for param_name, param in model.named_parameters():
        module = modules[param_name.rpartition(".")[0]]
        for hf_name, shard in param_checkpoint_names(modules, param_name, shard_to_original):
            names[hf_name] = WeightTarget(param_name, module, param, shard)
    return names


def weights_not_loaded(
    model: nn.Module, loaded: Iterable[str], stacked: Sequence[tuple[str, str, str]] = ()
) -> tuple[list[str], int]:
    """The checkpoint names of ``model``'s parameters that ``loaded`` (what
    ``load_weights`` returned) leaves out, and how many checkpoint weights the model has.

    A parameter counts as loaded when ``loaded`` holds its own name or every checkpoint
    name of its shards (a merged projection's, ``qkv_proj``, ``gate_up_proj``, mapped by
    ``stacked``; the experts of a ``FusedMoE``, named by the module); a shared (tied)
    parameter counts under any of its names. Missing weights are named as in the
    checkpoint (only the missing shards of a merged one).
    """
    loaded = set(loaded)
    modules = dict(model.named_modules())
    shard_to_original = {(merged, shard): original for merged, original, shard in stacked}

    def hf_names(param_name: str) -> list[str]:
        try:
            return [name for name, _ in param_checkpoint_names(modules, param_name, shard_to_original)]
        except ValueError:  # a merged projection that stacked does not map: count it by its own name
            return [param_name]

    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    missing: list[str] = []
    total = 0
    for names in aliases.values():
        expected = hf_names(names[0])
        total += len(expected)
        if any(name in loaded or set(hf_names(name)) <= loaded for name in names):
            continue
        missing.extend(n for n in expected if n not in loaded)
    return missing, total

def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Sequence[tuple[str, str, str]],
    ignored: Sequence[str] = ("rotary_emb.inv_freq",),
    tied_names: Sequence[str] = (),
) -> set[str]:
    """Load HF-named ``weights`` into ``model``; returns the names loaded.

    Names containing one of ``ignored`` (e.g. old checkpoints' rotary buffers) and
    ``tied_names`` (e.g. ``lm_head.weight`` of a tied model, a copy of the embedding)
    are skipped; other unknown names are logged and skipped. A required weight that
    never arrived is an error naming it.
    """
    targets = checkpoint_names(model, stacked)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                if name in tied_names or any(part in name for part in ignored):
                    continue
                unexpected.append(name)
                continue
            loader = getattr(target.module, "weight_loader", None)
            if loader is not None:
                loader(target.param, tensor, target.shard)
            else:
                if tuple(target.param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{name}: checkpoint tensor has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(target.param.shape)}"
                    )
                target.param.data.copy_(tensor)
            loaded.add(name)
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:10])
        logger.warning("Ignored %d checkpoint tensors the model does not use: %s", len(unexpected), shown)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (f" ... ({len(missing)} in all)" if len(missing) > 10 else "")
        raise ValueError(f"checkpoint is missing weights required by {type(model).__name__}: {shown}")
    return loaded
