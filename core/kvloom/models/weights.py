"""Weight-name bookkeeping shared by the model classes.

kvloom models keep HF's module names except for the merged projections (``qkv_proj``,
``gate_up_proj``) and the stacked experts of a ``FusedMoE`` (``w13_weight``, ``w2_weight``,
which name their per-expert checkpoint tensors through ``checkpoint_shards``). ``checkpoint_names`` lists every HF checkpoint name a model needs and
where it goes; ``load_checkpoint_weights`` loads by that map and reports what is missing.
The GGUF loader uses the same map to translate llama.cpp tensor names.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvloom.layers.linear import LinearBase
from kvloom.loader.lazy_tensor import CheckpointTensor, accepts_lazy_weights, materialize

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

#: Checkpoint tensors every model may leave unused: the rotary ``inv_freq`` buffers old
#: checkpoints saved (kvloom computes them). ``fnmatch`` patterns over the full name.
DEFAULT_IGNORED_CHECKPOINT_TENSORS: tuple[str, ...] = ("*rotary_emb.inv_freq",)


class UnusedCheckpointTensorsError(ValueError):
    """The checkpoint holds tensors the model does not use (``names``, sorted).

    An error, not a warning: an unused tensor is most often part of a format kvloom does
    not read (fp8 ``weight_scale``, GPTQ ``qweight``/``scales``...), and loading the rest
    would generate wrong tokens in silence. A model that knows a tensor is harmless to drop
    lists it in its class attribute ``ignored_checkpoint_tensors``."""

    def __init__(self, model_name: str, names: Sequence[str], files: Sequence[str] = ()) -> None:
        self.names = sorted(names)
        self.files = sorted(set(files))
        shown = ", ".join(self.names[:10]) + (f" ... ({len(self.names)} in all)" if len(self.names) > 10 else "")
        where = f" in {', '.join(self.files)}" if self.files else ""
        super().__init__(
            f"checkpoint tensors{where} are not used by {model_name}: {shown}. They may belong to a weight format "
            f"kvloom does not support yet (quantization scales, ...); a model that may drop them lists name "
            f"patterns in its class attribute ignored_checkpoint_tensors"
        )


def ignored_checkpoint_tensors(model: nn.Module) -> tuple[str, ...]:
    """The ``fnmatch`` patterns of checkpoint tensors ``model`` may leave unused: its class
    attribute ``ignored_checkpoint_tensors``, else ``DEFAULT_IGNORED_CHECKPOINT_TENSORS``."""
    return tuple(getattr(model, "ignored_checkpoint_tensors", DEFAULT_IGNORED_CHECKPOINT_TENSORS))


#: The names of a layer's per-tensor fp8 KV-cache scales in checkpoints.
KV_SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")


def kv_scale_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The attention layers that take KV-cache scales (``load_kv_scale``), by the module
    names a checkpoint stores their scales under: the layer's own (``...self_attn.attn``)
    and its parent's (``...self_attn``, where llm-compressor and AutoFP8 put them)."""
    owners: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if callable(getattr(module, "load_kv_scale", None)):
            owners[name] = module
            owners.setdefault(name.rpartition(".")[0], module)
    return owners


def load_kv_scale(owners: dict[str, nn.Module], name: str, tensor: CheckpointTensor) -> bool:
    """Load checkpoint tensor ``name`` into its attention layer when it is a KV-cache
    scale (``<attention module>.k_scale`` / ``v_scale`` / ``kv_scale``); False otherwise."""
    parent, _, leaf = name.rpartition(".")
    owner = owners.get(parent) if leaf in KV_SCALE_NAMES else None
    if owner is None:
        return False
    owner.load_kv_scale(leaf, materialize(tensor))  # type: ignore[operator]
    return True


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, CheckpointTensor]],
    stacked: Sequence[tuple[str, str, str]],
    ignored: Sequence[str] | None = None,
    tied_names: Sequence[str] = (),
) -> set[str]:
    """Load HF-named ``weights`` into ``model``; returns the names loaded.

    Names matching one of the ``fnmatch`` patterns ``ignored`` (default: the model's
    ``ignored_checkpoint_tensors``, e.g. old checkpoints' rotary buffers) and
    ``tied_names`` (e.g. ``lm_head.weight`` of a tied model, a copy of the embedding)
    are skipped; any other tensor the model does not use is an
    ``UnusedCheckpointTensorsError`` naming them. A required weight that never arrived is
    an error naming it.

    ``weights`` may hold ``LazyTensor`` handles (``kvloom.loader.lazy_tensor``): a module
    whose ``weight_loader`` accepts them (``accepts_lazy_weights``) gets them as they are (the parallel
    layers read only their rank's slice), any other ``weight_loader`` and a parameter
    without one get the whole tensor; skipped tensors are never read.
    """
    patterns = ignored_checkpoint_tensors(model) if ignored is None else tuple(ignored)
    targets = checkpoint_names(model, stacked)
    kv_scale_owners = kv_scale_layers(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                if name in tied_names or any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    continue
                if load_kv_scale(kv_scale_owners, name, tensor):
                    loaded.add(name)
                    continue
                unexpected.append(name)
                continue
            loader = getattr(target.module, "weight_loader", None)
            if loader is not None:
                # A loader that does not declare it takes lazy handles gets the whole tensor.
                lazy_ok = accepts_lazy_weights(target.module, "weight_loader")
                loader(target.param, tensor if lazy_ok else materialize(tensor), target.shard)
            else:
                if tuple(target.param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{name}: checkpoint tensor has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(target.param.shape)}"
                    )
                target.param.data.copy_(materialize(tensor))
            loaded.add(name)
    if unexpected:
        raise UnusedCheckpointTensorsError(type(model).__name__, unexpected)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (f" ... ({len(missing)} in all)" if len(missing) > 10 else "")
        raise ValueError(f"checkpoint is missing weights required by {type(model).__name__}: {shown}")
    return loaded
