"""The platform's layer kernels as opaque torch ops under torch.compile
(kvloom.compilation.opaque_ops) and which kernels the model loader activates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvloom.compilation.opaque_ops import as_opaque_ops
from kvloom.layers.layernorm import rms_norm_torch
from kvloom.loader.model_loader import _layer_ops


def test_compiled_graph_calls_the_kernel_as_one_node():
    calls: list[int] = []

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls.append(x.shape[0])
        # host arithmetic on the row count: what Dynamo must not trace
        assert isinstance(x.shape[0], int)
        return rms_norm_torch(x, weight, eps)

    ops = as_opaque_ops({"rms_norm": kernel})
    weight = torch.rand(8)
    compiled = torch.compile(lambda x: ops["rms_norm"](x * 2, weight, 1e-6) + 1, backend="eager",
                             fullgraph=True, dynamic=True)  # fmt: skip
    for rows in (3, 5):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(compiled(x), rms_norm_torch(x * 2, weight, 1e-6) + 1)
    assert calls == [3, 5]


def test_fake_shapes_match_the_kernels():
    ops = as_opaque_ops({"silu_and_mul": lambda x: x[..., :4] * x[..., 4:], "fused_moe": lambda h, *_: h.clone()})
    compiled = torch.compile(lambda x, w2: (ops["silu_and_mul"](x), ops["fused_moe"](x, x, w2, x, x)),
                             backend="eager", fullgraph=True)  # fmt: skip
    a, b = compiled(torch.randn(3, 8), torch.randn(2, 8, 4))
    assert a.shape == (3, 4) and b.shape == (3, 8)


def test_qk_norm_rotary_runs_as_one_node_with_its_int_and_float_arguments():
    from kvloom.layers.rotary import qk_norm_rotary_torch

    calls: list[tuple[int, float]] = []

    def kernel(x, q_weight, k_weight, num_q_heads, eps, cos, sin):  # type: ignore[no-untyped-def]
        calls.append((num_q_heads, eps))
        return qk_norm_rotary_torch(x, q_weight, k_weight, num_q_heads, eps, cos, sin)

    op = as_opaque_ops({"qk_norm_rotary": kernel})["qk_norm_rotary"]
    q_weight, k_weight = torch.rand(8), torch.rand(8)
    compiled = torch.compile(lambda x, cos, sin: op(x[:, :5], q_weight, k_weight, 3, 1e-6, cos, sin),
                             backend="eager", fullgraph=True, dynamic=True)  # fmt: skip
    for tokens in (2, 4):
        x, cos, sin = torch.randn(tokens, 6, 8), torch.rand(tokens, 1, 4), torch.rand(tokens, 1, 4)
        got = compiled(x, cos, sin)
        assert got.shape == (tokens, 5, 8)
        assert torch.equal(got, qk_norm_rotary_torch(x[:, :5], q_weight, k_weight, 3, 1e-6, cos, sin))
    assert calls == [(3, 1e-6), (3, 1e-6)]


def test_an_op_without_an_opaque_form_is_refused():
    with pytest.raises(ValueError, match="lora_delta"):
        as_opaque_ops({"lora_delta": lambda *a: None})


def _random_sample(logits, temperature, greedy):
    return logits.argmax(dim=1)


class _Platform:
    @staticmethod
    def custom_ops(config):
        return {"rms_norm": rms_norm_torch, "fused_moe": lambda *a: None, "random_sample": _random_sample,
                "qk_norm_rotary": lambda *a: None}


def _config(custom_ops: str, compile_model: bool):
    return SimpleNamespace(device=SimpleNamespace(platform=_Platform),
                           compilation=SimpleNamespace(custom_ops=custom_ops, compile_model=compile_model))  # fmt: skip


@pytest.mark.parametrize(
    ("custom_ops", "compile_model", "expected"),
    [
        ("all", False, {"rms_norm", "fused_moe", "random_sample", "qk_norm_rotary"}),
        ("none", False, set()),  # an uncompiled model under --custom-ops none: pure torch
        ("all", True, {"rms_norm", "fused_moe", "random_sample", "qk_norm_rotary"}),
        # A compiled model's default (Inductor fuses the layer math): the MoE kernels, the
        # sampler's op, which runs outside the compiled graph, and the q/k norm + rotation,
        # which Inductor compiles into four slow kernels, stay.
        ("none", True, {"fused_moe", "random_sample", "qk_norm_rotary"}),
    ],  # fmt: skip
)
def test_which_platform_kernels_the_loader_activates(custom_ops, compile_model, expected):
    ops = _layer_ops(_config(custom_ops, compile_model))
    assert set(ops) == expected
    for name, op in ops.items():
        if name == "random_sample":  # the sampler calls it outside the model: never wrapped
            assert op is _random_sample
        elif compile_model:  # through the opaque torch ops
            assert isinstance(op, torch._library.custom_ops.CustomOpDef)
