"""The AWQ and GPTQ methods' layers against their dequantized reference (kvloom's
conformance kit) for each variant they read (AWQ group 32; GPTQ symmetric, act-order
asymmetric, per channel in the v2 format), the formats' tensors read back against the
published dequantization written out here independently (each word's nibbles picked by
hand), and the configs' refusals."""

from __future__ import annotations

import pytest
import torch
from kvloom_quant_int4 import AwqMethod, GptqMethod
from kvloom_quant_int4.formats import AwqFormat, Geometry, GptqFormat
from kvloom_quant_int4.layers import W4LinearMethod

from kvloom.interfaces import LayerInfo, LayerKind
from kvloom.testing.quantization import check_quantization_case, quantization_cases

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
METHODS = {
    "awq-g32": AwqMethod(AWQ),
    "gptq-sym-g32": GptqMethod(GPTQ),
    "gptq-actorder-asym-g64": GptqMethod({**GPTQ, "group_size": 64, "desc_act": True, "sym": False}),
    "gptq_v2-channel": GptqMethod({**GPTQ, "group_size": -1, "checkpoint_format": "gptq_v2"}),
}
#: bfloat16 for two variants (the dtype changes only the GEMM, not the format).
DTYPES = {"awq-g32": (torch.float32, torch.bfloat16), "gptq-actorder-asym-g64": (torch.float32, torch.bfloat16)}
CASES = [(name, case) for name, method in METHODS.items()
         for case in quantization_cases(method, DTYPES.get(name, (torch.float32,)))]  # fmt: skip


@pytest.mark.parametrize(("variant", "case"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_conformance(variant: str, case) -> None:
    check_quantization_case(METHODS[variant], case)


def nibble(word: int, position: int) -> int:
    return (word >> (4 * position)) & 0xF


def awq_reference(tensors: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """AutoAWQ's GEMM format read by hand: output feature 8c + order[j] of word c sits in
    nibble j, order (0, 2, 4, 6, 1, 3, 5, 7); w = (q - zero) * scale."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    qweight, qzeros, scales = (tensors[n].tolist() for n in ("qweight", "qzeros", "scales"))
    k, n = len(qweight), len(scales[0])
    out = torch.empty(n, k)
    for row in range(k):
        for col in range(n):
            j = order.index(col % 8)
            q = nibble(qweight[row][col // 8], j)
            zero = nibble(qzeros[row // group][col // 8], j)
            out[col, row] = (q - zero) * scales[row // group][col]
    return out


def gptq_reference(tensors: dict[str, torch.Tensor], v2: bool) -> torch.Tensor:
    """GPTQ read by hand: input feature 8r + i of word r in nibble i; zeros packed along the
    output features, stored minus one before v2; groups from g_idx."""
    qweight, qzeros, scales, g_idx = (tensors[n].tolist() for n in ("qweight", "qzeros", "scales", "g_idx"))
    n, k = len(scales[0]), len(g_idx)
    out = torch.empty(n, k)
    for row in range(k):
        g = g_idx[row]
        for col in range(n):
            q = nibble(qweight[row // 8][col], row % 8)
            zero = nibble(qzeros[g][col // 8], col % 8) + (0 if v2 else 1)
            out[col, row] = (q - zero) * scales[g][col]
    return out


@pytest.mark.parametrize("act_order", [False, True])
def test_the_formats_read_as_published(act_order: bool) -> None:
    weight = torch.randn(24, 64) * 0.1
    geo = Geometry((24,), 64, 64)
    awq = AwqFormat(32, zero_point=True, act_order=False)
    tensors = awq.write(weight)
    assert torch.equal(awq.read(tensors, geo).dequantize(), awq_reference(tensors, 32))
    for v2 in (False, True):
        gptq = GptqFormat(16, zero_point=True, act_order=act_order, v2=v2)
        tensors = gptq.write(weight)
        assert not act_order or not torch.equal(tensors["g_idx"], torch.arange(64) // 16)
        assert torch.allclose(gptq.read(tensors, geo).dequantize(), gptq_reference(tensors, v2))
        # The quantized weight is the float weight within int4's rounding.
        assert (gptq.read(tensors, geo).dequantize() - weight).norm() / weight.norm() < 0.1


@pytest.mark.parametrize(
    ("cls", "change", "message"),
    [
        (AwqMethod, {"bits": 8}, "bits: 8 is not supported"),
        (AwqMethod, {"version": "gemv"}, "version: 'gemv' is not supported"),
        (AwqMethod, {"zero_point": False}, "zero_point: False"),
        (AwqMethod, {"group_size": 7}, "group_size: 7"),
        (AwqMethod, {"modules_to_not_convert": "lm_head"}, "modules_to_not_convert: 'lm_head'"),
        (GptqMethod, {"bits": 3}, "bits: 3 is not supported"),
        (GptqMethod, {"checkpoint_format": "marlin"}, "checkpoint_format: 'marlin'"),
        (GptqMethod, {"lm_head": True}, "lm_head: true is not supported"),
        (GptqMethod, {"dynamic": {"-:.*mlp": {}}}, "dynamic: "),
        (GptqMethod, {"desc_act": "yes"}, "desc_act: 'yes'"),
    ],
)
def test_configs_it_does_not_run_are_refused_naming_the_field(cls, change, message) -> None:
    base = AWQ if cls is AwqMethod else GPTQ
    with pytest.raises(ValueError, match=message):
        cls({**base, **change})


def test_ignored_modules_stay_unquantized() -> None:
    method = AwqMethod({**AWQ, "modules_to_not_convert": ["down_proj"]})
    info = LayerInfo(LayerKind.LINEAR, "model.layers.0.mlp.down_proj", ("model.layers.0.mlp.down_proj",), 64, (64,))
    assert method.layer_method(info) is None
    assert "unquantized: down_proj" in method.describe()


def test_merged_shards_with_different_act_orders_are_refused() -> None:
    """q, k and v share their input, hence GPTQ's order of it; a checkpoint whose shards
    disagree cannot run as one GEMM."""

    class Layer:
        prefix = "model.layers.0.self_attn.qkv_proj"
        g_idx = torch.zeros(64, dtype=torch.int32)

        def load_by_layout(self, name: str, param, loaded: torch.Tensor, shard: str | None) -> None:
            param.data.copy_(loaded)

    layer, method = Layer(), W4LinearMethod(GptqFormat(16, zero_point=True, act_order=True))
    order = GptqFormat(16, True, True).write(torch.randn(8, 64))["g_idx"]
    method.load_weight(layer, "g_idx", torch.nn.Parameter(layer.g_idx, requires_grad=False), order, "q")
    method.load_weight(layer, "g_idx", torch.nn.Parameter(layer.g_idx, requires_grad=False), order, "k")
    with pytest.raises(ValueError, match="different act-order g_idx"):
        method.load_weight(layer, "g_idx", torch.nn.Parameter(layer.g_idx, requires_grad=False), order.flip(0), "v")
