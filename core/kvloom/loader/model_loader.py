"""Build the model of an ``EngineConfig`` on a device and load its weights.

The model class comes from ``ModelRegistry`` (architecture name). It is constructed
directly on the target device in the run dtype (no CPU copy, no random init: parameters
are ``torch.empty``), then filled from the model source:

* ``load.source_kind == "hf"``: safetensors or ``.bin`` files of the HF directory
  (``load_format`` "auto", "safetensors" or "pt"); safetensors tensors reach a model that
  accepts them as lazy handles, of which each tensor-parallel rank reads its slices only;
* ``"gguf"``: the GGUF file (``kvloom.loader.gguf_loader``): its tensors as stored
  (``GGUFTensor``) when the model's quantization method reads GGUF, else dequantized;
* ``load_format == "dummy"``: random weights made on the device from ``model.seed``
  (the parameters are this rank's shards already: nothing else is made).

A quantized model (``config.model.quantization``) is built inside the quantization's
build context, so that its layers create the method's parameters
(``kvloom.quantization.context``); checkpoint tensors such as ``weight_scale`` or
``qweight`` then load into them by name like any weight, and once every weight is in,
each quantized layer's method repacks its parameters (``process_weights_after_loading``).

``load_weights`` returns the names it loaded; every parameter must be among them (a
model that loads too little is an error naming the weights, as in vLLM), except with
dummy weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from kvloom.attention.kv_quant import log_kv_cache_scales
from kvloom.config import EngineConfig, LoadConfig, ModelConfig
from kvloom.layers.custom_ops import set_custom_ops
from kvloom.loader.gguf_loader import gguf_weights
from kvloom.loader.lazy_tensor import CheckpointTensor
from kvloom.loader.weight_utils import hf_dir_weights, initialize_dummy_weights
from kvloom.models.interface import (
    get_checkpoint_tensor_filter,
    get_stacked_params,
    supports_lazy_weights,
)
from kvloom.models.registry import ModelRegistry
from kvloom.models.weights import UnusedCheckpointTensorsError, checkpoint_names, weights_not_loaded
from kvloom.quantization.context import building_model, process_weights_after_loading
from kvloom.quantization.selection import reads_gguf

logger = logging.getLogger(__name__)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def checkpoint_weight_names(model: nn.Module) -> list[str]:
    """The HF names ``model.load_weights`` expects (merged projections expanded)."""
    return list(checkpoint_names(model, get_stacked_params(model)))


def model_weights(
    config: EngineConfig, model: nn.Module, origins: dict[str, Path] | None = None
) -> Iterable[tuple[str, CheckpointTensor]]:
    """The checkpoint tensors of ``config``'s model source, HF-named, on the CPU
    (``origins``: filled with the file of each name, for an HF directory).

    A model whose ``load_weights`` is declared lazy-ready (``accepts_lazy_weights = True``
    in the class that defines it) gets safetensors tensors as ``LazyTensor`` handles, so
    that each tensor-parallel rank reads only its slices (``kvloom.loader.lazy_tensor``);
    any other model gets whole tensors, as before. GGUF and ``.bin`` tensors are whole
    either way."""
    kind = config.load.source_kind
    if kind == "gguf":
        raw = reads_gguf(config.model.quantization)
        if raw and not supports_lazy_weights(model):
            logger.warning("%s does not take lazy checkpoint tensors: its GGUF weights are dequantized at load "
                           "instead of read by quantization %r", type(model).__name__,
                           config.model.quantization.NAME)  # fmt: skip
            raw = False
        return gguf_weights(config.model.model, config.model.hf_config, checkpoint_weight_names(model), raw=raw)
    if kind == "hf":
        # A pipeline stage reads only its own tensors (the model says which are elsewhere).
        skip = get_checkpoint_tensor_filter(model)
        lazy = supports_lazy_weights(model)
        return hf_dir_weights(config.model.model, config.load.load_format, origins, skip, lazy)
    raise ValueError(f"load.source_kind: {kind!r} is not a weight source (allowed: hf, gguf)")


#: How many missing weight names an error message lists.
MISSING_WEIGHTS_SHOWN = 10


def check_all_weights_loaded(model: nn.Module, loaded: Iterable[str] | None, source: str) -> None:
    """Raise unless ``loaded`` (what ``model.load_weights`` returned) covers every
    parameter of ``model`` (``kvloom.models.weights.weights_not_loaded``)."""
    name = type(model).__name__
    if loaded is None:
        raise TypeError(
            f"{name}.load_weights returned None; it must return the set of checkpoint weight names it "
            "loaded (kvloom's model contract), so that kvloom can check that every weight was loaded"
        )
    stacked = get_stacked_params(model)
    missing, total = weights_not_loaded(model, loaded, stacked)
    if missing:
        shown = ", ".join(missing[:MISSING_WEIGHTS_SHOWN])
        more = f" ... (first {MISSING_WEIGHTS_SHOWN} shown)" if len(missing) > MISSING_WEIGHTS_SHOWN else ""
        hint = ""
        unmapped = _merged_without_stacked_params(model, stacked)
        if unmapped:
            hint = (
                f". {name} has merged projections ({', '.join(unmapped)}) but no stacked_params: set the class "
                "attribute stacked_params to the (merged, HF name, shard) triples its load_weights passes to "
                "load_checkpoint_weights (e.g. LLAMA_STACKED_PARAMS), so that kvloom counts their HF shards"
            )
        raise ValueError(
            f"Following weights were not initialized from checkpoint {source} by {name}.load_weights "
            f"({len(missing)} of {total}): {shown}{more}{hint}"
        )


def _merged_without_stacked_params(model: nn.Module, stacked: Iterable[tuple[str, str, str]]) -> list[str]:
    """The names of ``model``'s merged projections (several shards) that ``stacked`` does not map."""
    mapped = {merged for merged, _, _ in stacked}
    found = {
        module_name.rpartition(".")[2]
        for module_name, module in model.named_modules()
        if len(getattr(module, "shard_names", ())) > 1
    }
    return sorted(found - mapped)


#: Platform ops a compiled model keeps under ``--custom-ops none``. ``custom_ops`` is
#: "none" by default when Inductor compiles the model (arg_utils: ``args.custom_ops or
#: ("none" if compile_model and use_inductor else "all")``) because Inductor fuses the
#: layer math itself; these ops are not such math:
#: - ``fused_moe``: its torch code reads routing sizes on the host, which neither a traced
#:   graph nor a CUDA graph can hold;
#: - ``random_sample``: the sampler runs outside the compiled graph, on the logits the
#:   model returns, so Inductor never sees (or fuses) its torch code;
#: - ``qk_norm_rotary``: Inductor splits Qwen3's per-head q/k norms and the rotation into
#:   four kernels (two looped reductions; in the model on an H200 8.6 us a layer at
#:   batch-256 decode, 283 us at a 16,384-token prefill); the platform's one kernel reads
#:   the heads once (H100, benchmarks/bench_qk_norm_rotary.py: 2.6 against 15.3 us at
#:   256 tokens, 76 against 579 at 16,384; docs/benchmarks/compile_h100.md).
#: An uncompiled model under ``--custom-ops none`` keeps none of them: the pure torch path.
_KEPT_WHEN_COMPILED = ("fused_moe", "random_sample", "qk_norm_rotary")
#: Platform ops called outside the model's forward: never traced, so never wrapped as
#: opaque torch ops (they have none).
_OUTSIDE_THE_MODEL = ("random_sample",)


def _layer_ops(config: EngineConfig) -> dict[str, Callable[..., object]]:
    """The platform's kernels to activate: all of them, unless ``--custom-ops none`` (then
    only ``_KEPT_WHEN_COMPILED``, and only for a compiled model); a compiled model calls
    the ones inside its forward through opaque torch ops."""
    comp = config.compilation
    ops = config.device.platform.custom_ops(config)
    if comp.custom_ops != "all":
        ops = {name: op for name, op in ops.items() if comp.compile_model and name in _KEPT_WHEN_COMPILED}
    if comp.compile_model:
        traced = {name: op for name, op in ops.items() if name not in _OUTSIDE_THE_MODEL}
        if traced:
            from kvloom.compilation.opaque_ops import as_opaque_ops

            ops = {**ops, **as_opaque_ops(traced)}
    return ops


def construct_model(model_cls: type[nn.Module], config: EngineConfig, device: torch.device, **kwargs: object) -> nn.Module:
    """``model_cls(config, **kwargs)`` on ``device`` in the model dtype, its layers quantized by
    ``config.model.quantization`` (parameters uninitialised)."""
    stacked = getattr(model_cls, "stacked_params", ())
    with default_dtype(config.model.dtype), device, building_model(config.model.quantization, stacked):
        model = model_cls(config, **kwargs)
    # Layers that allocate in their own way (or out-of-tree models) end up here too.
    return model.to(device=device)


def get_model(config: EngineConfig, device: torch.device | str) -> nn.Module:
    """The model of ``config`` on ``device`` in ``config.model.dtype``, weights loaded, in eval mode."""
    device = torch.device(device)
    architecture = config.model.architecture
    if config.model.runner == "pooling":
        architecture = ModelRegistry.pooling_architecture(architecture)
    model_cls = ModelRegistry.load_model_cls(architecture)
    start = time.perf_counter()
    set_custom_ops(_layer_ops(config))
    model = construct_model(model_cls, config, device)
    if config.load.load_format == "dummy":
        initialize_dummy_weights(model, seed=config.model.seed)
        source = "dummy weights"
    else:
        source = config.model.model
        origins: dict[str, Path] = {}
        try:
            loaded = model.load_weights(model_weights(config, model, origins))
        except UnusedCheckpointTensorsError as exc:
            # The model saw names only; the files they came from make the error actionable.
            files = [str(origins[name]) for name in exc.names if name in origins] or [source]
            raise UnusedCheckpointTensorsError(type(model).__name__, exc.names, files) from None
        check_all_weights_loaded(model, loaded, source)
    process_weights_after_loading(model)
    log_kv_cache_scales(model, config.cache.cache_dtype)
    model.eval()
    model.requires_grad_(False)
    logger.info(
        "Loaded %s (%s, %s) from %s in %.2f s",
        config.model.architecture,
        str(config.model.dtype).removeprefix("torch."),
        device,
        source,
        time.perf_counter() - start,
    )
    return model


def load_draft_model(
    config: EngineConfig, device: torch.device, model_cls: type[nn.Module], model_config: ModelConfig, **kwargs: object
) -> nn.Module:
    """A speculative draft model: ``model_cls(draft config, **kwargs)`` built for
    ``model_config`` (the draft's section) with the engine's attention backend, KV-cache
    dtype and parallelism, and its checkpoint's weights loaded (random ones under
    ``--load-format dummy``). A draft that shares the target's embedding or LM head reports
    those weights loaded itself."""
    dummy = config.load.load_format == "dummy"
    kind = "gguf" if model_config.model.endswith(".gguf") else "hf"
    load = LoadConfig(load_format="dummy" if dummy else "auto", source_kind=kind)
    draft_config = config.model_copy(update={"model": model_config, "load": load})
    model = construct_model(model_cls, draft_config, device, **kwargs)
    if dummy:
        initialize_dummy_weights(model, seed=model_config.seed + 1)
    else:
        check_all_weights_loaded(model, model.load_weights(model_weights(draft_config, model)), model_config.model)
    process_weights_after_loading(model)
    model.eval()
    model.requires_grad_(False)
    logger.info("Loaded the draft model %s (%s) from %s", type(model).__name__, model_config.architecture,
                "dummy weights" if dummy else model_config.model)  # fmt: skip
    return model
