"""The quantization-method contract in kvloom's layers, with a toy method written here
(int8 weights, one scale per output row, weight-only) so that the core is tested without
the first-party method plugins: every layer kind passes the conformance kit (shards,
tensor-parallel slices, experts, embedding and a tied LM head), the kit fails a method
that misplaces a shard, layers outside a quantized build stay plain, and a tied model
built quantized serves the same logits as its dequantized weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvloom.interfaces import (
    EmbeddingQuantMethod,
    FusedMoEQuantMethod,
    LayerInfo,
    LayerKind,
    LinearQuantMethod,
    ParamLayout,
    QuantizationMethod,
    add_quantized_parameter,
    fused_moe_torch,
)
from kvloom.layers.linear import MergedLinear
from kvloom.testing.quantization import check_quantization_case, quantization_cases


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(w / scale).to(torch.int8), scale.float()


class Int8Rows:
    """The parameters and writer every toy layer method shares: ``weight`` int8, ``weight_scale [rows, 1]``."""

    experts_prefix = ""

    def _add(self, layer: Any, prefix: str, shape: tuple[int, ...]) -> None:
        add_quantized_parameter(layer, f"{prefix}weight", torch.empty(shape, dtype=torch.int8), ParamLayout(0, 1))
        add_quantized_parameter(layer, f"{prefix}weight_scale", torch.empty(*shape[:-1], 1), ParamLayout(0))

    def checkpoint_tensors(self, weight: torch.Tensor, input_absmax: float = 8.0) -> dict[str, torch.Tensor]:
        q, scale = quantize_rows(weight)
        return {"weight": q, "weight_scale": scale}


class ToyLinear(Int8Rows, LinearQuantMethod):
    def create_weights(self, layer: Any) -> None:
        self._add(layer, "", (layer.output_size, layer.input_size))

    def dequantize(self, layer: Any) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(layer).to(x.dtype), bias)


class ToyMoE(Int8Rows, FusedMoEQuantMethod):
    def create_weights(self, layer: Any) -> None:
        e, i, h = layer.num_experts, layer.intermediate_size, layer.hidden_size
        self._add(layer, "w13_", (e, 2 * i, h))
        self._add(layer, "w2_", (e, h, i))

    def dequantize(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.w13_weight.float() * layer.w13_weight_scale, layer.w2_weight.float() * layer.w2_weight_scale

    def apply(self, layer: Any, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Any:
        w13, w2 = self.dequantize(layer)
        return fused_moe_torch(hidden, w13.to(hidden.dtype), w2.to(hidden.dtype), topk_weights, topk_ids)


class ToyTable(Int8Rows, EmbeddingQuantMethod):
    def create_weights(self, layer: Any) -> None:
        self._add(layer, "", (layer.rows, layer.embedding_dim))

    def dequantize(self, layer: Any) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale

    def embedding(self, layer: Any, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize(layer)[ids].to(layer.params_dtype)

    def apply(self, layer: Any, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.dequantize(layer).to(hidden.dtype))


class ToyInt8(QuantizationMethod):
    NAME = "toy-int8"
    online = False
    checkpoint_formats = {"toy-int8": ()}
    layer_kinds = tuple(LayerKind)

    def layer_method(self, layer: LayerInfo) -> Any:
        return {LayerKind.LINEAR: ToyLinear, LayerKind.FUSED_MOE: ToyMoE}.get(layer.kind, ToyTable)()


METHOD = ToyInt8({"quant_method": "toy-int8"})


@pytest.mark.parametrize("case", quantization_cases(METHOD), ids=str)
def test_every_layer_kind_passes_the_kit(case) -> None:
    check_quantization_case(METHOD, case)


def test_the_kit_fails_a_method_that_swaps_shards() -> None:
    class Swapped(ToyLinear):
        def dequantize(self, layer: Any) -> torch.Tensor:
            w = super().dequantize(layer)
            return torch.cat([w[layer.shard_slice("k")], w[layer.shard_slice("q")], w[layer.shard_slice("v")]])

    class SwappingMethod(ToyInt8):
        def layer_method(self, layer: LayerInfo) -> Any:
            return Swapped() if layer.kind is LayerKind.LINEAR else super().layer_method(layer)

    method = SwappingMethod({"quant_method": "toy-int8"})
    case = next(c for c in quantization_cases(method) if c.name == "qkv" and c.dtype == torch.float32)
    with pytest.raises(AssertionError, match="qkv-float32: dequantized weight relative error"):
        check_quantization_case(method, case)


def test_layers_built_outside_a_quantized_model_are_plain() -> None:
    layer = MergedLinear(16, [8, 8])
    assert layer.quant_method is None and layer.weight.dtype == torch.get_default_dtype()
    assert "quant" not in repr(layer)


def test_a_tied_model_runs_its_quantized_table_for_lookups_and_logits(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from kvloom.testing import load_model, resolve_engine_config
    from kvloom.testing.models import make_tiny_model
    from kvloom.testing.plugins import installed_quantization_methods
    from kvloom.testing.quantization import write_quantized_checkpoint

    src = make_tiny_model("qwen2", tmp_path / "float")  # qwen2 ties its LM head to the embedding
    dst = write_quantized_checkpoint(src, tmp_path / "int8", METHOD, {"quant_method": "toy-int8"})
    tensors = load_file(dst / "model.safetensors")
    q, scale = quantize_rows(tensors["model.embed_tokens.weight"])
    tensors.update({"model.embed_tokens.weight": q, "model.embed_tokens.weight_scale": scale})
    save_file(tensors, dst / "model.safetensors")
    with installed_quantization_methods(ToyInt8):
        config = resolve_engine_config(model=str(dst), dtype="float32")
    from kvloom.models.qwen2 import Qwen2ForCausalLM

    model = load_model(Qwen2ForCausalLM, config)
    embed, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embed.quant_method, ToyTable) and head.quant_method is embed.quant_method
    assert head.weight is embed.weight and head.weight.dtype == torch.int8
    hidden = torch.randn(3, embed.embedding_dim)
    expected = hidden.double() @ (q.double() * scale.double()).T
    torch.testing.assert_close(model.compute_logits(hidden).double(), expected, rtol=1e-5, atol=1e-5)
