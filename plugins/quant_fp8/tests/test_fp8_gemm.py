"""The fp8 GEMM of CUDA runs (``kvloom_quant_fp8.gemm``): its activation quantizer against
``ops``' arithmetic (bit for bit), its Triton GEMM against the float64 product of the same
fp8 activation and weight with their scales (per row and per 128x128-style block, split K
or not), and the opaque op's dispatch by the row count of each call under
``torch.compile``.

CPU: the kernels run in Triton's interpreter in one child process (this file with
``--worker``); each case is its own test. GPU (``gpu`` marker, skipped without CUDA): the
conformance kit's cases of every fp8 scheme with the layers on the GPU, and the GEMM at
Llama-3-8B shapes from 1 to 256 rows.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--worker" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch
from kvloom_quant_fp8.ops import dequantize_shards, quantize_per_token, quantize_per_token_group, quantize_weight

from kvloom.testing.interpreter import interpreter_results, patch_fp8_rounding, print_results, record_case

# (rows, K, [shard sizes of N], weight strategy, group of the activation: 0 = per token, None = static)
CASES = {
    "block-one-row": (1, 256, [128], "block", 128),
    "block-ragged-shards": (5, 200, [96, 40], "block", 32),
    "block-many-rows": (70, 128, [64, 64, 32], "block", 64),
    "channel-one-row-split-k": (1, 1024, [96], "channel", 0),
    "channel-ragged": (19, 200, [48, 40], "channel", 0),
    "tensor-static": (3, 256, [64, 32], "tensor", None),
    "channel-eight-rows-split-k": (8, 2048, [64], "channel", 0),
}


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, shards: list[int], strategy: str,
              group: int | None, static: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """float64: the activation as the kernel quantizes it times the dequantized weight."""
    if group is None:
        assert static is not None
        xd = (x.float() / static).clamp(-448, 448).to(torch.float8_e4m3fn).double() * static.double()
    elif group == 0:
        xq, xs = quantize_per_token(x)
        xd = xq.double() * xs.double()
    else:
        xq, xs = quantize_per_token_group(x, group)
        xd = xq.double() * xs.double().repeat_interleave(group, dim=-1)[:, : x.shape[1]]
    block = (group, group) if strategy == "block" else None
    return xd @ dequantize_shards(weight, scale, strategy, shards, block).double().t()


def weights(k: int, shards: list[int], strategy: str, group: int | None, gen: torch.Generator):
    from kvloom_quant_fp8.gemm import row_block_scales

    block = (group, group) if strategy == "block" else None
    pairs = [quantize_weight(torch.randn(n, k, generator=gen) * k**-0.5, strategy, block) for n in shards]
    weight = torch.cat([q for q, _ in pairs])
    if strategy == "tensor":
        scale = torch.stack([s for _, s in pairs])
        rows = scale.repeat_interleave(torch.tensor(shards))
    else:
        scale = torch.cat([s for _, s in pairs])
        rows = row_block_scales(scale, shards, group) if strategy == "block" else scale.reshape(-1)
    return weight, scale, rows


def run_case(name: str) -> dict:
    from kvloom_quant_fp8.gemm import fp8_linear

    rows, k, shards, strategy, group = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    weight, scale, row_scales = weights(k, shards, strategy, group, gen)
    x = torch.randn(rows, k, generator=gen)
    static = torch.tensor([x.abs().max().item() / 448 * 0.8]) if group is None else None  # some values clip
    out = fp8_linear(x, weight, row_scales, group or 0, static)
    ref = reference(x, weight, scale, shards, strategy, group, static)
    # Again: the split-K arrival counters were left at zero, so the second launch adds its
    # partials too (and the same way).
    again = fp8_linear(x, weight, row_scales, group or 0, static)
    return {"error": None, "rel": float((out.double() - ref).norm() / ref.norm()), "same": torch.equal(out, again)}


def quantizer_case() -> dict:
    """The Triton quantizer gives ops' codes and scales exactly, per token and per group."""
    from kvloom_quant_fp8.gemm import quantize_activation

    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(3)) * 5
    x[2] = 0.0  # an all-zero row: the smallest amax
    q, s = quantize_activation(x, 0)
    q_ref, s_ref = quantize_per_token(x)
    qg, sg = quantize_activation(x, 64)
    qg_ref, sg_ref = quantize_per_token_group(x, 64)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))

    return {"error": None, "token": same(q, q_ref) and torch.equal(s, s_ref),
            "group": same(qg, qg_ref) and torch.equal(sg, sg_ref)}  # fmt: skip


def compiled_dispatch_case() -> dict:
    """Under torch.compile (dynamic sizes) the op is one opaque node: every call picks its
    launch from its own row count, not the first trace's."""
    from kvloom_quant_fp8 import gemm

    seen: list[int] = []
    original = gemm.gemm_config

    def spy(m: int, grouped: bool, group: int) -> gemm.Config:
        seen.append(m)
        return original(m, grouped, group)

    gemm.gemm_config = spy
    weight, _, row_scales = weights(256, [64], "block", 128, torch.Generator().manual_seed(0))
    fn = torch.compile(lambda x: torch.ops.kvloom_quant_fp8.linear(x, weight, row_scales, 128, None), dynamic=True,
                       fullgraph=True)  # fmt: skip
    for m in (40, 1, 3):
        fn(torch.randn(m, 256))
    gemm.gemm_config = original
    return {"error": None, "seen": seen}


@pytest.fixture(scope="module")
def results() -> dict:
    pytest.importorskip("triton")
    return interpreter_results(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_gemm_in_the_interpreter(results: dict, name: str) -> None:
    result = results[name]
    assert result.get("error") is None, result["error"]
    assert result["rel"] < 1e-5, result
    assert result["same"], result


def test_the_quantizer_gives_the_reference_codes(results: dict) -> None:
    result = results["quantizer"]
    assert result.get("error") is None, result["error"]
    assert result["token"] and result["group"], result


def test_a_compiled_model_dispatches_by_each_calls_rows(results: dict) -> None:
    result = results["compiled-dispatch"]
    assert result.get("error") is None, result["error"]
    assert result["seen"] == [40, 1, 3], result


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
        assert gpu_kernel(method.scheme, torch.empty(128, 128, device="cuda")), config
        for case in quantization_cases(method, dtypes=(dtype,)):
            check_quantization_case(method, case, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["block", "channel"])
def test_gemm_at_llama_shapes_on_the_gpu(strategy: str) -> None:
    from kvloom_quant_fp8.gemm import fp8_linear, row_block_scales

    k, n = 4096, 14336
    block = (128, 128) if strategy == "block" else None
    weight, scale = quantize_weight(torch.randn(n, k, device="cuda") * k**-0.5, strategy, block)
    rows_scales = row_block_scales(scale, [n], 128) if block else scale.reshape(-1)
    group = 128 if block else 0
    for rows in (1, 16, 64, 256):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = fp8_linear(x, weight, rows_scales, group)
        ref = reference(x.float(), weight, scale, [n], strategy, group, None)
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-2, rows


if __name__ == "__main__" and "--worker" in sys.argv:
    patch_fp8_rounding()
    collected: dict = {}
    for case_name in CASES:
        record_case(collected, case_name, lambda case_name=case_name: run_case(case_name))
    record_case(collected, "quantizer", quantizer_case)
    record_case(collected, "compiled-dispatch", compiled_dispatch_case)
    print_results(collected)
