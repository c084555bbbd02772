"""The CPU platform's float32 layer ops (``layer_ops.c``) held to the custom-op contract by
``kvloom.testing.check_custom_op`` on fresh random data, and bit-identical to the torch code
(float32 parity with HF is exact on the CPU); row-strided inputs; what the platform returns
for float32 and half-precision models."""

from __future__ import annotations

import pytest
import torch
from kvloom_platform_cpu import layer_ops
from kvloom_platform_cpu.platform import CpuPlatform

from kvloom.testing import check_custom_op, custom_op_reference, resolve_engine_config
from tests.helpers.model_fixtures import tiny_model_dir

pytestmark = pytest.mark.skipif(layer_ops.library() is None, reason="no C compiler for the CPU layer ops")


@pytest.mark.parametrize("rows", [1, 7, 600])  # 600 x 576: the parallel path
def test_norms(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    hidden = 576
    x = torch.randn(rows, hidden + 8, generator=g)[:, :hidden]  # strided rows
    residual = torch.randn(rows, hidden, generator=g) * 3
    weight = torch.rand(hidden, generator=g) + 0.5
    assert check_custom_op("rms_norm", layer_ops.rms_norm, x, weight, 1e-5)["exact"] == 1.0
    report = check_custom_op("fused_add_rms_norm", layer_ops.fused_add_rms_norm, x, residual, weight, 1e-6)
    assert report["exact"] == 1.0
    big = torch.randn(2, 3, hidden, generator=g) * 1e4  # leading dimensions, large values
    assert check_custom_op("rms_norm", layer_ops.rms_norm, big, weight, 1e-6)["exact"] == 1.0


@pytest.mark.parametrize(("tokens", "heads", "size"), [(1, 12, 64), (5, 3, 128), (300, 16, 64)])
def test_rotary(tokens: int, heads: int, size: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2, size, generator=g)
    x = qkv[:, :heads]  # query and key heads of a fused projection: strided tokens
    angles = torch.rand(tokens, 1, size // 2, generator=g) * 100
    report = check_custom_op("rotary_qk", layer_ops.rotary_qk, x, angles.cos(), angles.sin())
    assert report["exact"] == 1.0


def test_other_dtypes_run_the_torch_code_and_wrong_shapes_are_errors() -> None:
    x, weight = torch.randn(2, 8, dtype=torch.bfloat16), torch.rand(8, dtype=torch.bfloat16)
    assert torch.equal(layer_ops.rms_norm(x, weight, 1e-6), custom_op_reference("rms_norm")(x, weight, 1e-6))
    with pytest.raises(ValueError, match="rotary_qk"):
        layer_ops.rotary_qk(torch.ones(2, 3, 8), torch.ones(2, 1, 3), torch.ones(2, 1, 3))


def test_the_platform_returns_them_for_float32_models_only() -> None:
    model = str(tiny_model_dir("llama"))
    ops = CpuPlatform.custom_ops(resolve_engine_config(model=model, dtype="float32"))
    assert sorted(ops) == ["fused_add_rms_norm", "rms_norm", "rotary_qk"]
    assert CpuPlatform.custom_ops(resolve_engine_config(model=model, dtype="bfloat16")) == {}
