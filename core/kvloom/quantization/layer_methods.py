"""What a quantization method does for one layer: its parameters, loading, repacking,
forward and dequantized reference.

A ``QuantizationMethod`` hands each layer it quantizes one of these (``layer_method``):

* ``LinearQuantMethod`` for ``Linear`` / ``MergedLinear`` / ``QKVLinear``;
* ``FusedMoEQuantMethod`` for ``FusedMoE`` (stacked experts);
* ``EmbeddingQuantMethod`` for ``VocabEmbedding`` and ``LMHead``.

The layer calls it at four points:

1. construction: ``create_weights(layer)`` registers the quantized parameters on the
   layer with ``add_quantized_parameter(layer, name, tensor, layout)`` instead of the
   layer's float ``weight``. A parameter's name is the checkpoint tensor's suffix
   (``weight``, ``weight_scale``, ``input_scale``, ``weight_scale_inv``, ``qweight``,
   ``scales``, ``qzeros``, ``g_idx``, ...): the model loader maps checkpoint names to
   parameters by name (a merged layer's ``q_proj.weight_scale`` goes to
   ``qkv_proj.weight_scale``, shard ``q``; an expert's ``experts.3.up_proj.weight_scale`` to
   ``w13_weight_scale``, shard ``3.up``). Its ``ParamLayout`` says how the parameter
   follows the weight's rows and columns, so the layer can place each shard and cut
   each tensor-parallel rank's part of it, reading only that part of a lazy checkpoint
   tensor;
2. loading: ``load_weight(layer, name, param, loaded, shard)``, by default the layer's
   own layout-driven loader (``layer.load_by_layout``); a method whose tensors need more
   (GGUF's per-tensor quant types) overrides it;
3. after every tensor is loaded: ``process_weights_after_loading(layer)``, once: repack
   into the kernel's layout (transpose, pad, interleave, cache on disk), or quantize a
   float checkpoint (online methods). It may replace the parameters;
4. every forward: ``apply``.

``dequantize`` gives the reference weight in float32 (this rank's part, as the layer
holds it) and ``reference_input`` the activation as the kernel computes with it (a W8A8
method quantizes it; weight-only methods return it as is): the conformance kit
(``kvloom.testing.quantization``) holds ``apply`` to a float64 product of the two.
``checkpoint_tensors`` is the method's format writer: the checkpoint tensors its format
stores for one float projection, with which the kit makes fresh random checkpoints.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvloom.loader.lazy_tensor import CheckpointTensor, materialize
from kvloom.utils import cdiv

if TYPE_CHECKING:
    from kvloom.layers.fused_moe import FusedMoE
    from kvloom.layers.linear import LinearBase
    from kvloom.layers.vocab_embedding import VocabEmbedding


@dataclass(frozen=True)
class ParamLayout:
    """How a quantized parameter follows its layer's weight ``[output, input]``.

    ``output_dim`` / ``input_dim``: the parameter dims that run along the weight's rows /
    columns (``None``: the parameter does not follow them); ``output_block`` /
    ``input_block``: weight rows / columns per entry along that dim (a packing factor, 8
    for int4 in int32; a scale's block, 128 for DeepSeek's fp8 blocks); a dim of ``n``
    weight rows has ``ceil(n / block)`` entries. ``per_shard``: one value per shard of a
    merged layer (per-tensor scales): the parameter's first dim indexes the shards
    (``[num_shards]``; an expert's: ``[2]`` for gate/up, ``[1]`` for down). A parameter of
    a ``FusedMoE`` has the experts first; its layout describes one expert's slice.

    Examples: an fp8 weight ``ParamLayout(0, 1)``; per-channel scales ``[out, 1]``
    ``ParamLayout(output_dim=0)``; 128x128 block scales ``ParamLayout(0, 1, 128, 128)``;
    GPTQ's ``qweight [in / 8, out]`` ``ParamLayout(output_dim=1, input_dim=0, input_block=8)``.
    """

    output_dim: int | None = None
    """The parameter dim along the weight's output rows, or ``None``."""
    input_dim: int | None = None
    """The parameter dim along the weight's input columns, or ``None``."""
    output_block: int = 1
    """Weight rows per entry along ``output_dim``."""
    input_block: int = 1
    """Weight columns per entry along ``input_dim``."""
    per_shard: bool = False
    """One value per shard (the first dim indexes the shards)."""


@dataclass(frozen=True)
class Span:
    """A run of weight rows or columns to copy: ``length`` of them from ``src_start`` of the
    checkpoint tensor (weight units) into the parameter from entry ``dst_start`` (parameter
    units: a merged layer's shards each start on a block)."""

    src_start: int
    length: int
    dst_start: int


def add_quantized_parameter(layer: nn.Module, name: str, tensor: torch.Tensor, layout: ParamLayout) -> nn.Parameter:
    """Register ``tensor`` as the (frozen) parameter ``name`` of ``layer`` with its layout
    (``layer.quant_layouts[name]``); returns the parameter. Replacing one (after loading)
    goes through here too."""
    param = nn.Parameter(tensor, requires_grad=False)
    if name in layer._parameters:
        del layer._parameters[name]
    elif hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, param)
    layouts: dict[str, ParamLayout] = layer.__dict__.setdefault("quant_layouts", {})
    layouts[name] = layout
    return param


def remove_quantized_parameter(layer: nn.Module, name: str) -> None:
    """Drop parameter ``name`` (e.g. a float weight an online method has quantized)."""
    del layer._parameters[name]
    layer.__dict__.get("quant_layouts", {}).pop(name, None)


def load_region(
    target: torch.Tensor, loaded: CheckpointTensor, layout: ParamLayout, out: Span | None, inp: Span | None, what: str
) -> None:
    """Copy the ``out`` rows and ``inp`` columns (weight units; ``None``: all) of ``loaded``
    into ``target`` at the spans' parameter offsets, reading only that part of a lazy
    handle. A span that does not start on a block or a shape that does not fit is a
    ``ValueError`` naming ``what``."""
    src, dst = loaded, target
    dims = ((layout.output_dim, out, layout.output_block), (layout.input_dim, inp, layout.input_block))
    for dim, span, block in dims:
        if dim is None or span is None:
            continue
        if span.src_start % block:
            raise ValueError(f"{what}: this rank's part starts at row/column {span.src_start}, inside a quantization "
                             f"block of {block}; choose a tensor-parallel size that splits on blocks")  # fmt: skip
        start, count = span.src_start // block, cdiv(span.length, block)
        if dim >= src.dim() or start + count > src.shape[dim]:
            raise ValueError(f"{what}: checkpoint tensor has shape {tuple(src.shape)}, too small for entries "
                             f"[{start}, {start + count}) along dim {dim}")  # fmt: skip
        src = src.narrow(dim, start, count)
        dst = dst.narrow(dim, span.dst_start, count)
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(materialize(src))


def load_per_shard(target: torch.Tensor, index: int, loaded: CheckpointTensor, what: str) -> None:
    """Copy a one-value-per-shard checkpoint tensor (a per-tensor scale: shape ``()`` or
    ``(1,)``) into entry ``index`` of ``target``."""
    value = materialize(loaded)
    if value.numel() != target[index].numel():
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(value.shape)}, expected one value per shard")
    target[index].copy_(value.reshape(target[index].shape))


class LayerQuantMethod(ABC):
    """One layer's quantized weights (see the module docstring for when each hook runs)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Register the layer's quantized parameters (``add_quantized_parameter``), sized
        from the layer's (this rank's) sizes, with ``torch.empty`` in the default device."""

    def load_weight(
        self, layer: nn.Module, name: str, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None
    ) -> None:
        """Copy the checkpoint tensor ``loaded`` into ``param`` (the layer's parameter
        ``name``), shard ``shard``. Default: the layer's loader, driven by the layout."""
        layer.load_by_layout(name, param, loaded, shard)  # type: ignore[operator]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor is loaded: repack, quantize. Default: nothing."""

    def checkpoint_tensors(self, weight: torch.Tensor, input_absmax: float = 8.0) -> dict[str, torch.Tensor]:
        """The format writer: the checkpoint tensors this format stores for one float
        projection ``weight`` (``[out, in]``: one shard of a merged layer, one expert's
        gate, up or down, an embedding), by parameter name (``{"weight": ..., "weight_scale":
        ...}``). ``input_absmax`` is the activation range a format with static activation
        scales records. The conformance kit makes fresh checkpoints with it; methods
        without a writer raise ``NotImplementedError`` (test them on files the format's
        own tools wrote)."""
        raise NotImplementedError(f"{type(self).__name__} has no checkpoint writer")


class LinearQuantMethod(LayerQuantMethod):
    """The quantized weights of a ``LinearBase`` (``Linear``, ``MergedLinear``, ``QKVLinear``)."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [N, input_size] -> [N, output_size]`` in ``x``'s dtype, ``+ bias`` when
        given (a row-parallel layer adds it after the all-reduce and passes ``None``)."""

    @abstractmethod
    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The reference weight: float32 ``[output_size, input_size]`` (this rank's rows
        and columns; a merged layer's shards in output order)."""

    def reference_input(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the kernel computes with it (float32): quantized and dequantized by a
        method that quantizes activations; ``x`` itself for weight-only methods."""
        return x.float()


class FusedMoEQuantMethod(LayerQuantMethod):
    """The quantized experts of a ``FusedMoE`` (``w13``: gate and up, ``w2``: down)."""

    @abstractmethod
    def apply(
        self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """What the ``fused_moe`` op computes (``kvloom.layers.fused_moe.fused_moe_torch``),
        with this method's weights: ``[T, H]``, this rank's partial sum under tensor
        parallelism (the layer all-reduces it)."""

    @abstractmethod
    def dequantize(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference weights: float32 ``(w13 [E, 2 * I, H], w2 [E, H, I])``, this rank's ``I``."""

    def reference_input(self, layer: FusedMoE, x: torch.Tensor, projection: str) -> torch.Tensor:
        """The input of the ``projection`` (``"w13"`` or ``"w2"``) GEMMs as the kernel
        computes with it (float32); ``x`` itself for weight-only methods."""
        return x.float()

    def checkpoint_shards(self, layer: FusedMoE, param_name: str) -> list[tuple[str, str | None]] | None:
        """The checkpoint tensors of the quantized parameter ``param_name``: ``(name relative
        to the layer, shard)``, or ``None`` (the default): one per expert and projection,
        ``<expert>.<gate|up|down name>.<suffix>`` with shard ``"<expert>.<gate|up|down>"``.
        A format that stores the experts stacked (gpt-oss's ``gate_up_proj_blocks``) names
        its tensors here (shard ``None``) and loads each whole in ``load_weight``."""
        return None


class EmbeddingQuantMethod(LayerQuantMethod):
    """The quantized table of a ``VocabEmbedding`` or ``LMHead`` (``[rows, dim]``)."""

    @abstractmethod
    def embedding(self, layer: VocabEmbedding, ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's table: ``ids [N]`` (local, in range) -> ``[N, dim]`` in the model dtype."""

    @abstractmethod
    def apply(self, layer: VocabEmbedding, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's rows: ``hidden [M, dim] -> [M, rows]`` in ``hidden``'s dtype."""

    @abstractmethod
    def dequantize(self, layer: VocabEmbedding) -> torch.Tensor:
        """The reference table: float32 ``[rows, dim]`` (this rank's rows)."""

    def reference_input(self, layer: VocabEmbedding, x: torch.Tensor) -> torch.Tensor:
        """The LM head's input as the kernel computes with it (float32)."""
        return x.float()
