"""Graph passes kvloom adds to Inductor's own, run on every compiled piece.

``UnfuseResidualAddmm`` (Inductor's ``post_grad_custom_post_pass``): Inductor rewrites
``mm(a, b) + r`` into ``addmm(r, a, b)`` whenever the sum has a user that is not
pointwise. In a decoder layer that is every residual add after the output and down
projections, whose sum feeds the next RMSNorm (a reduction). cuBLAS then needs ``r``
in the output buffer before the GEMM: one device-to-device copy of the residual per
projection (two per layer, a kernel each inside a CUDA graph), and a GEMM that reads it
back in its epilogue. Unfused, the add is pointwise again and Inductor folds it into the
norm's kernel, which reads the residual once and writes the new one: no copy, two
kernels fewer per layer, and the sum rounded as the eager model rounds it (the
projection's output to the model dtype first, then the add), not in the GEMM's float32
epilogue. Measured on the H100 in ``docs/benchmarks/compile_h100.md``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten


def _val(node: Any) -> torch.Tensor | None:
    """The fake tensor Inductor recorded for ``node`` (None for a constant or a missing one)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


class UnfuseResidualAddmm(CustomGraphPass):
    """``addmm(r, a, b)`` with a full ``[M, N]`` addend ``r`` -> ``mm(a, b) + r`` (see
    the module docstring). A bias (``r`` of one row or one dimension), or scaled terms
    (``alpha``/``beta`` other than 1), stay fused: there cuBLAS adds the bias without a copy."""

    def __call__(self, graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.addmm.default:
                continue
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                continue
            addend, mat1, mat2 = node.args[:3]
            r, out = _val(addend), _val(node)
            if r is None or out is None or r.dim() != 2 or r.dtype != out.dtype:
                continue
            if not all(statically_known_true(a == b) for a, b in zip(r.shape, out.shape)):
                continue  # a broadcast bias, not a residual of the output's own shape
            with graph.inserting_before(node):
                product = graph.call_function(aten.mm.default, (mat1, mat2))
                product.meta["val"] = aten.mm.default(_val(mat1), _val(mat2))
                total = graph.call_function(aten.add.Tensor, (product, addend))
                total.meta["val"] = aten.add.Tensor(product.meta["val"], r)
            node.replace_all_uses_with(total)
            graph.erase_node(node)

    def uuid(self) -> Any:
        # Inductor's FX-graph cache keys compiled code by the passes' uuids: this file's text.
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def inductor_config_patches() -> dict[str, Any]:
    """The Inductor settings kvloom compiles every piece with."""
    return {"post_grad_custom_post_pass": UnfuseResidualAddmm()}
