"""The Triton W4A16 kernels (``kvloom_quant_int4.kernels``) against the float64 product
with the dequantized weight (``layout.dequantize``).

CPU: the kernels run in Triton's interpreter in one child process (this file with
``--worker``), on small shapes covering integer and e2m1 values, zero points or not,
act-order, a split K, sizes that are not multiples of the tiles and several dtypes; each
case is its own test here.

GPU (``gpu`` marker, skipped without CUDA): the conformance kit's cases of AWQ and GPTQ
with the layers on the GPU (the kernels' path), the GEMM at Llama-3-8B's shapes from 1 to
256 rows, the experts at Qwen3-30B-A3B's shape, and both captured in a CUDA graph and
replayed on new inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

if __name__ == "__main__" and "--worker" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch
from kvloom_quant_int4.layout import W4Tensors, dequantize, expert, stack_experts, to_kernel_layout
from kvloom_quant_int4.packing import Unpacked, quantize_int4, quantize_mxfp4

from kvloom.interfaces import fused_moe_torch
from kvloom.interfaces.models import select_experts
from kvloom.testing.interpreter import interpreter_results as run_worker
from kvloom.testing.interpreter import patch_bf16_rounding, print_results, record_case

TOLERANCE = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}
MOE_TOLERANCE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


def random_w4(n: int, k: int, group: int, zeros: bool, act_order: bool, e2m1: bool, seed: int,
              scale_dtype: torch.dtype = torch.float16) -> W4Tensors:  # fmt: skip
    """A projection ``[n, k]`` quantized in the kernels' layout."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * k**-0.5
    if e2m1:
        codes, exponents = quantize_mxfp4(weight)
        scales = torch.exp2(exponents.float() - 127).t().contiguous().to(scale_dtype)
        return to_kernel_layout(Unpacked(codes.t().contiguous(), scales, 32, e2m1=True))
    u = quantize_int4(weight, group, zeros)
    if act_order:
        u.g_idx = torch.randperm(k, generator=gen) // group
    return to_kernel_layout(u)


def on(w: W4Tensors, device: str) -> W4Tensors:
    moved = {name: t.to(device) for name, t in w.tensors().items()}
    return W4Tensors(**{f: moved.get(f) for f in ("qweight", "scales", "zeros", "perm", "gidx")},
                     group_size=w.group_size, n=w.n, e2m1=w.e2m1)  # fmt: skip


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


# (rows, K, N, group, zero points, act-order, e2m1)
LINEAR_CASES = {
    "one-row-g32": (1, 96, 40, 32, True, False, False),
    "symmetric-split-k": (3, 256, 64, 64, False, False, False),
    "act-order-ragged": (5, 200, 152, 64, True, True, False),
    "group-above-tile": (20, 256, 72, 256, True, False, False),
    "many-rows": (70, 64, 136, 32, True, False, False),
    "mxfp4": (2, 64, 48, 32, False, False, True),
}
# (tokens, experts, top_k, hidden, intermediate, group, zero points, act-order, e2m1)
MOE_CASES = {
    "few-tokens": (5, 4, 2, 64, 32, 32, True, False, False),
    "act-order": (9, 6, 2, 96, 48, 32, False, True, False),
    "one-token-idle-experts": (1, 8, 3, 64, 64, 64, True, False, False),
    "mxfp4": (7, 4, 2, 64, 32, 32, False, False, True),
}
DTYPES = ["float32", "bfloat16", "float16"]


def linear_case(kernels, name: str, dtype: torch.dtype, device: str = "cpu") -> dict:  # type: ignore[no-untyped-def]
    m, k, n, group, zeros, act, e2m1 = LINEAR_CASES[name]
    w = random_w4(n, k, group, zeros, act, e2m1, seed=len(name))
    x = torch.randn(m, k + 8, generator=torch.Generator().manual_seed(1))[:, :k].to(dtype)  # strided rows
    out = kernels.w4_linear(x.to(device), on(w, device))
    ref = x.double() @ dequantize(w).double().T
    return {"error": relative_error(out.cpu(), ref), "dtype_ok": out.dtype == dtype and out.shape == (m, n)}


def moe_case(kernels, name: str, dtype: torch.dtype, device: str = "cpu") -> dict:  # type: ignore[no-untyped-def]
    t, e, top_k, h, i, group, zeros, act, e2m1 = MOE_CASES[name]
    w13 = stack_experts([random_w4(2 * i, h, group, zeros, act, e2m1, seed=10 + j) for j in range(e)])
    w2 = stack_experts([random_w4(h, i, group, zeros, act, e2m1, seed=50 + j) for j in range(e)])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weights, ids = select_experts(torch.randn(t, e, generator=gen), top_k, renormalize=True)
    out = kernels.w4_fused_moe(x.to(device), on(w13, device), on(w2, device), weights.to(device), ids.to(device))
    d13 = torch.stack([dequantize(expert(w13, j)) for j in range(e)]).double()
    d2 = torch.stack([dequantize(expert(w2, j)) for j in range(e)]).double()
    ref = fused_moe_torch(x.double(), d13, d2, weights.double(), ids)
    return {"error": relative_error(out.cpu(), ref), "dtype_ok": out.dtype == dtype}


def compiled_ops_case(kernels) -> dict:  # type: ignore[no-untyped-def]
    """Under torch.compile (dynamic sizes) the layers' ops are opaque nodes: each call picks
    its launch from its own row count (the K tile: 64 above 16 rows, 128 at or below), and
    the experts' op gives the kernel's result."""
    seen: list[int] = []
    original = kernels._block_k

    def spy(w: W4Tensors, preferred: int) -> tuple[int, bool]:
        seen.append(preferred)
        return original(w, preferred)

    kernels._block_k = spy
    w = random_w4(64, 256, 128, True, False, False, seed=4)
    linear = torch.compile(lambda x: torch.ops.kvloom_quant_int4.linear(x, *kernels.op_args(w)), dynamic=True,
                           fullgraph=True)  # fmt: skip
    for m in (40, 1):
        linear(torch.randn(m, 256))
    kernels._block_k = original
    t, e, top_k, h, i = 9, 4, 2, 64, 32
    w13 = stack_experts([random_w4(2 * i, h, 32, True, False, False, seed=10 + j) for j in range(e)])
    w2 = stack_experts([random_w4(h, i, 32, True, False, False, seed=50 + j) for j in range(e)])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(t, h, generator=gen)
    weights, ids = select_experts(torch.randn(t, e, generator=gen), top_k, renormalize=True)
    moe = torch.compile(lambda x, wt, i: torch.ops.kvloom_quant_int4.fused_moe(x, wt, i, *kernels.op_args(w13),
                                                                              *kernels.op_args(w2)),
                        dynamic=True, fullgraph=True)  # fmt: skip
    same = bool(torch.equal(moe(x, weights, ids), kernels.w4_fused_moe(x, w13, w2, weights, ids)))
    return {"error": None, "seen": seen, "moe_same": same}


def split_tail_case(kernels) -> dict:  # type: ignore[no-untyped-def]
    """17 K tiles over 16 splits: the last split's second tile starts past K. The scales are
    followed in memory by NaN: a kernel reading that tile's scale row gives NaN."""
    w = random_w4(64, 17 * 64, 64, True, False, False, seed=5)
    padded = torch.full((w.scales.shape[0] + 2, w.scales.shape[1]), float("nan"), dtype=w.scales.dtype)
    padded[: w.scales.shape[0]] = w.scales
    tailed = dataclasses.replace(w, scales=padded[: w.scales.shape[0]])
    x = torch.randn(1, 17 * 64, generator=torch.Generator().manual_seed(3))
    ref = x.double() @ dequantize(w).double().T
    return {"error": relative_error(kernels.w4_linear(x, tailed), ref), "dtype_ok": True}


def _run_worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_bf16_rounding()
    from kvloom_quant_int4 import kernels

    assert kernels._INTERPRET
    torch.set_num_threads(1)
    results: dict = {}
    for dtype in DTYPES:
        for name in LINEAR_CASES:
            case = functools.partial(linear_case, kernels, name, getattr(torch, dtype))
            record_case(results, f"linear-{name}-{dtype}", case)
        for name in MOE_CASES:
            record_case(
                results, f"moe-{name}-{dtype}", functools.partial(moe_case, kernels, name, getattr(torch, dtype))
            )
    record_case(results, "compiled-ops", functools.partial(compiled_ops_case, kernels))
    record_case(results, "split-tail", functools.partial(split_tail_case, kernels))
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_worker(__file__, timeout=600)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LINEAR_CASES)
def test_linear_kernel_in_the_interpreter(interpreter_results: dict, name: str, dtype: str) -> None:
    result = interpreter_results[f"linear-{name}-{dtype}"]
    assert "error" in result and isinstance(result["error"], float), result
    assert result["dtype_ok"] and result["error"] <= TOLERANCE[dtype], result


def test_a_split_past_k_reads_no_scale_row_past_the_end(interpreter_results: dict) -> None:
    result = interpreter_results["split-tail"]
    assert isinstance(result["error"], float) and result["error"] <= TOLERANCE["float32"], result


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_kernel_in_the_interpreter(interpreter_results: dict, name: str, dtype: str) -> None:
    result = interpreter_results[f"moe-{name}-{dtype}"]
    assert "error" in result and isinstance(result["error"], float), result
    assert result["dtype_ok"] and result["error"] <= MOE_TOLERANCE[dtype], result


def test_compiled_models_dispatch_by_each_calls_rows(interpreter_results: dict) -> None:
    result = interpreter_results["compiled-ops"]
    assert result.get("error") is None, result["error"]
    assert result["seen"] == [64, 128] and result["moe_same"], result


def test_cpu_tensors_are_refused_outside_the_interpreter() -> None:
    from kvloom_quant_int4 import kernels

    w = random_w4(16, 32, 32, True, False, False, seed=0)
    with pytest.raises(ValueError, match="run on CUDA tensors"):
        kernels.w4_linear(torch.randn(2, 32), w)


# --------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kit_cases_on_the_gpu(dtype: str) -> None:
    from kvloom_quant_int4 import AwqMethod, GptqMethod

    from kvloom.testing.quantization import check_quantization_case, quantization_cases

    methods = [AwqMethod({"quant_method": "awq", "group_size": 32}),
               GptqMethod({"quant_method": "gptq", "group_size": 64, "desc_act": True, "sym": False})]  # fmt: skip
    for method in methods:
        for case in quantization_cases(method, (getattr(torch, dtype),)):
            check_quantization_case(method, case, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 256])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_linear_kernel_at_llama_shapes(rows: int, k: int, n: int) -> None:
    from kvloom_quant_int4 import kernels

    w = on(random_w4(n, k, 128, True, False, False, seed=rows), "cuda")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ dequantize(w).double().T
    assert relative_error(kernels.w4_linear(x, w), ref) <= 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 16, 64, 256])
def test_moe_kernel_at_qwen3_moe_shape(tokens: int) -> None:
    """Qwen3-30B-A3B's experts: hidden 2048, intermediate 768, 128 experts, top-8."""
    from kvloom_quant_int4 import kernels

    e, h, i = 128, 2048, 768
    w13 = on(stack_experts([random_w4(2 * i, h, 128, True, False, False, seed=j) for j in range(e)]), "cuda")
    w2 = on(stack_experts([random_w4(h, i, 128, True, False, False, seed=500 + j) for j in range(e)]), "cuda")
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, e, device="cuda"), 8, renormalize=True)
    out = kernels.w4_fused_moe(x, w13, w2, weights, ids)
    d13 = torch.stack([dequantize(expert(w13, j)) for j in range(e)]).to(torch.bfloat16)
    d2 = torch.stack([dequantize(expert(w2, j)) for j in range(e)]).to(torch.bfloat16)
    ref = fused_moe_torch(x.double(), d13.double(), d2.double(), weights.double(), ids)
    assert relative_error(out, ref) <= 3e-2


@pytest.mark.gpu
@gpu
def test_kernels_replay_in_a_cuda_graph() -> None:
    from kvloom_quant_int4 import kernels

    w = on(random_w4(1024, 2048, 128, True, True, False, seed=3), "cuda")
    w13 = on(stack_experts([random_w4(256, 512, 64, False, False, False, seed=j) for j in range(8)]), "cuda")
    w2 = on(stack_experts([random_w4(512, 128, 64, False, False, False, seed=9 + j) for j in range(8)]), "cuda")
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(4, 8, device="cuda")
    weights, ids = select_experts(logits, 2, renormalize=True)
    kernels.w4_linear(x, w), kernels.w4_fused_moe(h, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.w4_linear(x, w)
        moe = kernels.w4_fused_moe(h, w13, w2, weights, ids)
    x.copy_(torch.randn_like(x))
    h.copy_(torch.randn_like(h))
    new_weights, new_ids = select_experts(torch.randn(4, 8, device="cuda"), 2, renormalize=True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out, kernels.w4_linear(x, w))
    torch.testing.assert_close(moe, kernels.w4_fused_moe(h, w13, w2, weights, ids))


if __name__ == "__main__" and "--worker" in sys.argv:
    _run_worker()
