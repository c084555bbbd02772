"""The quantization of the model being built, as its layers see it.

Model classes do not pass quantization to their layers: the model loader builds the model
inside ``building_model(method, stacked_params)``, and each quantizable layer asks
``layer_quant_method`` for its ``LayerQuantMethod`` when it is constructed, as it reads
the tensor-parallel rank from ``kvloom.distributed.parallel_state``. Outside the block (a
test building a layer, an unquantized model) every layer is unquantized. After loading,
``process_weights_after_loading(model)`` gives every quantized layer its one repacking pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from torch import nn

from kvloom.quantization.layer_methods import (
    EmbeddingQuantMethod,
    FusedMoEQuantMethod,
    LayerQuantMethod,
    LinearQuantMethod,
)
from kvloom.quantization.method import LayerInfo, LayerKind, QuantizationMethod

#: The base class a method's answer for each layer kind must subclass.
LAYER_METHOD_BASES: dict[LayerKind, type[LayerQuantMethod]] = {
    LayerKind.LINEAR: LinearQuantMethod,
    LayerKind.FUSED_MOE: FusedMoEQuantMethod,
    LayerKind.EMBEDDING: EmbeddingQuantMethod,
    LayerKind.LM_HEAD: EmbeddingQuantMethod,
}


@dataclass(frozen=True)
class _Building:
    method: QuantizationMethod
    #: (merged module leaf, shard) -> checkpoint module leaf: ("qkv_proj", "q") -> "q_proj".
    shard_names: dict[tuple[str, str], str]


_BUILDING: ContextVar[_Building | None] = ContextVar("kvloom_quantization_building", default=None)


@contextmanager
def building_model(
    method: QuantizationMethod | None, stacked_params: Sequence[tuple[str, str, str]] = ()
) -> Iterator[None]:
    """Layers constructed inside the block are quantized by ``method`` (``None``: not at
    all). ``stacked_params`` are the model's ``(merged, checkpoint name, shard)`` triples,
    so that a merged layer's shards are named as in the checkpoint (``LayerInfo.checkpoint_prefixes``)."""
    shard_names = {(merged, shard): original for merged, original, shard in stacked_params}
    token = _BUILDING.set(None if method is None else _Building(method, shard_names))
    try:
        yield
    finally:
        _BUILDING.reset(token)


def layer_quant_method(
    kind: LayerKind,
    prefix: str,
    *,
    input_size: int,
    output_sizes: Sequence[int],
    shard_names: Sequence[str] = (),
    tp_size: int = 1,
    num_experts: int = 0,
) -> LayerQuantMethod | None:
    """The ``LayerQuantMethod`` of the layer being constructed (``None``: unquantized,
    outside ``building_model`` or when the method keeps it so). ``shard_names``: a merged
    layer's shards, named in the checkpoint through the model's stacked params."""
    building = _BUILDING.get()
    if building is None or kind not in building.method.layer_kinds:
        return None
    parent, _, leaf = prefix.rpartition(".")
    if len(shard_names) > 1:
        originals = [building.shard_names.get((leaf, shard), f"{leaf}.{shard}") for shard in shard_names]
        checkpoint_prefixes = tuple(f"{parent}.{name}" if parent else name for name in originals)
    else:
        checkpoint_prefixes = (prefix,)
    info = LayerInfo(kind, prefix, checkpoint_prefixes, input_size, tuple(output_sizes), tp_size, num_experts)
    method = building.method.layer_method(info)
    base = LAYER_METHOD_BASES[kind]
    if method is not None and not isinstance(method, base):
        raise TypeError(f"quantization {building.method.NAME!r}: layer_method for {prefix} ({kind.value}) returned "
                        f"{type(method).__name__}, which is not a {base.__name__}")  # fmt: skip
    return method


def process_weights_after_loading(model: nn.Module) -> None:
    """Run every quantized layer's ``process_weights_after_loading`` once (after all
    checkpoint tensors are in), then let tied layers share the processed parameters."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and getattr(module, "tied_to", None) is None:
            method.process_weights_after_loading(module)
    for module in model.modules():
        if getattr(module, "tied_to", None) is not None and getattr(module, "quant_method", None) is not None:
            module.tie_to(module.tied_to)
