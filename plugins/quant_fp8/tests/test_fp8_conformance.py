"""The fp8 method's layers against their dequantized reference (kvloom's conformance kit),
for every scheme it reads: per-tensor weights with dynamic or static activations, 128x128
blocks with per-token-group activations, and online per-channel quantization; plus the
config's refusals."""

from __future__ import annotations

import pytest
import torch
from kvloom_quant_fp8 import Fp8Method
from kvloom_quant_fp8.ops import fake_quantize_activation, quantize_weight

from kvloom.interfaces import LayerInfo, LayerKind
from kvloom.testing.quantization import check_quantization_case, quantization_cases

CONFIGS = {
    "online": None,
    "tensor-dynamic": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "tensor-static": {"quant_method": "fp8", "activation_scheme": "static"},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}
CASES = [(name, case) for name, config in CONFIGS.items() for case in quantization_cases(Fp8Method(config))]


@pytest.mark.parametrize(("scheme", "case"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_conformance(scheme: str, case) -> None:
    check_quantization_case(Fp8Method(CONFIGS[scheme]), case)


def test_the_kit_catches_a_wrong_scale() -> None:
    """A method whose dequantization forgets a factor fails the kit (the kit can fail)."""
    method = Fp8Method(CONFIGS["tensor-dynamic"])
    case = quantization_cases(method)[1]  # qkv: three per-tensor scales

    class Wrong(Fp8Method):
        def layer_method(self, layer: LayerInfo):
            inner = super().layer_method(layer)
            dequantize = inner.dequantize
            inner.dequantize = lambda lay: dequantize(lay) * 1.5
            return inner

    with pytest.raises(AssertionError, match="dequantized weight relative error"):
        check_quantization_case(Wrong(CONFIGS["tensor-dynamic"]), case)


def test_activation_quantization_is_per_token_and_per_group() -> None:
    x = torch.randn(4, 300) * torch.tensor([1.0, 10.0, 100.0, 1000.0])[:, None]
    token = fake_quantize_activation(x, "token")
    # Each row keeps e4m3's ~6% relative precision whatever its magnitude.
    assert ((token - x).abs().amax(dim=1) / x.abs().amax(dim=1) < 0.07).all()
    x[:, 200:] *= 1e-3  # a quiet group keeps its own precision per 128 features
    group = fake_quantize_activation(x, "group", 128)
    assert ((group - x)[:, 256:].abs().amax(dim=1) / x[:, 256:].abs().amax(dim=1) < 0.07).all()
    assert not ((token - x)[:, 256:].abs().amax(dim=1) / x[:, 256:].abs().amax(dim=1) < 0.07).all()


def test_block_scales_cover_partial_blocks() -> None:
    w = torch.randn(200, 130)
    q, scale = quantize_weight(w, "block", (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 2)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "fp8", "activation_scheme": "per-row"}, "activation_scheme: 'per-row'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt: 'e5m2' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "'static' with"),
        ({"quant_method": "fp8", "weight_block_size": "128"}, "weight_block_size: '128'"),
        ({"quant_method": "fp8", "ignored_layers": "lm_head"}, "ignored_layers: 'lm_head'"),
    ],
)
def test_configs_it_does_not_run_are_refused_naming_the_field(config, message) -> None:
    with pytest.raises(ValueError, match=message):
        Fp8Method(config)


def test_ignored_modules_stay_unquantized_and_merged_layers_must_agree() -> None:
    method = Fp8Method({"quant_method": "fp8", "ignored_layers": ["model.layers.0.self_attn.q_proj"],
                        "modules_to_not_convert": ["lm_head", "down_proj"]})  # fmt: skip

    def info(*prefixes: str) -> LayerInfo:
        return LayerInfo(LayerKind.LINEAR, prefixes[0], prefixes, 64, (64,) * len(prefixes))

    assert method.layer_method(info("model.layers.1.mlp.down_proj")) is None
    assert method.layer_method(info("model.layers.1.mlp.up_proj")) is not None
    with pytest.raises(ValueError, match="quantizes others"):
        method.layer_method(info("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"))
