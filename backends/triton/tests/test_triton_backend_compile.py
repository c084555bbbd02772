"""TRITON_ATTN kernels compile for Hopper (sm_90) without a GPU, within its resources.

The CPU interpreter accepts programs the GPU compiler rejects and says nothing about
registers or shared memory; this compiles the kernels the heuristic table picks, exactly
as a launch would, and checks for spills, the shared-memory limit and 16-byte K/V loads.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from kvloom_backend_triton.aot_check import SMEM_LIMITS, check_configuration  # noqa: E402
from kvloom_backend_triton.ops import NO_FEATURES, LayerFeatures  # noqa: E402

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.exists(_PTXAS), reason="Triton's bundled ptxas is not installed")


@pytest.mark.parametrize(
    ("dtype", "head_size", "num_heads", "num_kv_heads"),
    [
        (torch.bfloat16, 128, 32, 8),  # Llama-3-8B, the benchmark shape
        (torch.float32, 256, 8, 1),  # the heaviest fp32 tiles, MQA
    ],
    ids=["bf16-d128-gqa4", "fp32-d256-mqa8"],
)
# The features are launch-time constexprs: each specialization is its own program to compile.
@pytest.mark.parametrize("all_features", [False, True], ids=["plain", "window-softcap-sinks"])
def test_kernels_compile_for_sm90_without_spills(
    dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int, all_features: bool
) -> None:
    features = NO_FEATURES
    if all_features:
        features = LayerFeatures(sliding_window=128, logits_soft_cap=30.0, sinks=torch.zeros(num_heads))
    reports = check_configuration(
        dtype, head_size, num_heads, num_kv_heads, block_size=16, arch=90, features=features
    )
    assert {r.kernel for r in reports} == {"decode", "decode_reduce", "mixed_batch", "write_kv"}
    for rep in reports:
        assert rep.spill_bytes == 0, rep.row()
        assert rep.shared_bytes <= SMEM_LIMITS[90], rep.row()
        if rep.kernel in ("decode", "mixed_batch"):
            assert rep.vector_loads > 0, f"K/V loads are not 16 bytes wide: {rep.row()}"
