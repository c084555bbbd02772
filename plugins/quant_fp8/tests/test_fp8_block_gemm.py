"""The Triton block-scaled fp8 GEMM (``kvloom_quant_fp8.block_gemm``) against the float64
product of the same fp8 activation and weight with their scales.

CPU: the kernel runs in Triton's interpreter in one child process (this file with
``--worker``); each case is its own test. GPU (``gpu`` marker, skipped without CUDA): the
conformance kit's cases of every fp8 scheme with the layers on the GPU (``_scaled_mm`` for
per-tensor/per-channel weights, the block kernel for 128x128 blocks).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--worker" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch
from kvloom_quant_fp8.ops import quantize_per_token_group, quantize_weight

from kvloom.testing.interpreter import interpreter_results, print_results, record_case

# (rows, K, [shard sizes of N], block)
CASES = {
    "one-row": (1, 256, [128], (128, 128)),
    "ragged-shards": (5, 200, [96, 40], (32, 32)),
    "many-rows": (37, 128, [64, 64, 32], (64, 64)),
}


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, shards: list[int],
              block: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """float64: the activation as the kernel quantizes it times the dequantized weight."""
    from kvloom_quant_fp8.ops import dequantize_shards

    xq, xs = quantize_per_token_group(x, block[1])
    xd = xq.double() * xs.double().repeat_interleave(block[1], dim=-1)[:, : x.shape[1]]
    return xd @ dequantize_shards(weight, scale, "block", shards, block).double().t()


def run_case(name: str) -> dict:
    from kvloom_quant_fp8.block_gemm import fp8_block_linear, row_block_scales

    rows, k, shards, block = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    pairs = [quantize_weight(torch.randn(n, k, generator=gen) * k**-0.5, "block", block) for n in shards]
    weight, scale = torch.cat([q for q, _ in pairs]), torch.cat([s for _, s in pairs])
    x = torch.randn(rows, k, generator=gen)
    out = fp8_block_linear(x, weight, row_block_scales(scale, shards, block[0]), block[1])
    ref = reference(x, weight, scale, shards, block)
    return {"error": None, "rel": float((out.double() - ref).norm() / ref.norm())}


@pytest.fixture(scope="module")
def results() -> dict:
    pytest.importorskip("triton")
    return interpreter_results(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_block_gemm_in_the_interpreter(results: dict, name: str) -> None:
    result = results[name]
    assert result.get("error") is None, result["error"]
    assert result["rel"] < 1e-5, result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kit_cases_on_the_gpu(dtype: torch.dtype) -> None:
    from kvloom_quant_fp8 import Fp8Method
    from kvloom_quant_fp8.layers import gpu_kernel

    from kvloom.testing.quantization import check_quantization_case, quantization_cases

    configs = [None, {"quant_method": "fp8", "activation_scheme": "dynamic"},
               {"quant_method": "fp8", "activation_scheme": "static"},
               {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}]  # fmt: skip
    for config in configs:
        method = Fp8Method(config)
        assert gpu_kernel(method.scheme, torch.empty(128, 128, device="cuda")) is not None, config
        for case in quantization_cases(method, dtypes=(dtype,)):
            check_quantization_case(method, case, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_gemm_at_llama_shapes_on_the_gpu() -> None:
    from kvloom_quant_fp8.block_gemm import fp8_block_linear, row_block_scales

    k, n = 4096, 14336
    weight, scale = quantize_weight(torch.randn(n, k, device="cuda") * k**-0.5, "block", (128, 128))
    for rows in (1, 64, 256):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = fp8_block_linear(x, weight, row_block_scales(scale, [n], 128), 128)
        ref = reference(x.float(), weight, scale, [n], (128, 128))
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-2, rows


if __name__ == "__main__" and "--worker" in sys.argv:
    collected: dict = {}
    for case_name in CASES:
        record_case(collected, case_name, lambda case_name=case_name: run_case(case_name))
    print_results(collected)
