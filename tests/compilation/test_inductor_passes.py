"""kvloom's Inductor pass: residual ``addmm`` back to ``mm`` + add (kvloom.compilation.inductor_passes)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kvloom.compilation.inductor_passes import UnfuseResidualAddmm, inductor_config_patches

aten = torch.ops.aten


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _traced(fn, *args: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="symbolic")(*args)


def test_residual_addmm_becomes_mm_and_add_rounded_as_eager() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(7, 32, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    residual = torch.randn(7, 16, dtype=torch.bfloat16)
    gm = _traced(lambda r, x, w: aten.addmm(r, x, w), residual, a, b)
    assert aten.addmm.default in _targets(gm)
    UnfuseResidualAddmm()(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    assert aten.addmm.default not in targets and aten.mm.default in targets and aten.add.Tensor in targets
    for node in gm.graph.nodes:  # Inductor lowers from the recorded fake values
        if node.op == "call_function":
            assert isinstance(node.meta.get("val"), torch.Tensor), node
    # The eager model's rounding: the projection in bf16, then the add in bf16.
    assert torch.equal(gm(residual, a, b), (a @ b) + residual)
    a2, r2 = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(gm(r2, a2, b), (a2 @ b) + r2)  # the token count stays symbolic


def test_bias_and_scaled_addmm_stay_fused() -> None:
    a, b = torch.randn(5, 8), torch.randn(8, 4)
    for addend in (torch.randn(4), torch.randn(1, 4)):  # a bias: cuBLAS adds it without a copy
        gm = _traced(lambda r, x, w: aten.addmm(r, x, w), addend, a, b)
        UnfuseResidualAddmm()(gm.graph)
        assert aten.addmm.default in _targets(gm)
    gm = _traced(lambda r, x, w: aten.addmm(r, x, w, beta=2.0), torch.randn(5, 4), a, b)
    UnfuseResidualAddmm()(gm.graph)
    assert aten.addmm.default in _targets(gm)


def test_the_pass_is_in_the_config_and_keyed_by_its_source() -> None:
    patches = inductor_config_patches()
    unfuse = patches["post_grad_custom_post_pass"]
    assert isinstance(unfuse, UnfuseResidualAddmm)
    assert unfuse.uuid() == UnfuseResidualAddmm().uuid() and len(unfuse.uuid()) == 64
