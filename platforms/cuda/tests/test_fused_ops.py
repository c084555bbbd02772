"""kvloom_platform_cuda.fused_ops against the native torch code it replaces.

CPU: the kernels run in Triton's interpreter. ``TRITON_INTERPRET=1`` must be set before
triton is imported and stays process-wide, so they run in one child process (this file
with ``--worker``), never in the pytest process; the child prints one JSON line of
comparisons and each case is its own test here. The interpreter's fp32 -> bf16 cast
truncates (compiled Triton rounds to nearest even), so the child first patches that cast
to round to nearest even; with it bf16 runs like float16 and float32. Thresholds: fp32
within 1e-5 (max |diff| / max |ref|); 16-bit at most one ulp apart and >= 99% identical.

GPU (``gpu`` marker, skipped without CUDA): bf16 and fp16 at model shapes against torch on
CUDA: silu_and_mul and rotary_qk bit-identical; the norms differ on at most 0.1% of the
elements, because the fp32 variance is summed in another order than torch's: the
normalised value (weight 1) by at most one ulp, the output after the multiplication by
the weight by at most two (one ulp of the normalised value times |weight| is under two
ulps of the product before it is rounded).
"""

from __future__ import annotations

import functools
import os
import sys

if __name__ == "__main__" and "--worker" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch
import torch.nn.functional as F

from kvloom.testing.interpreter import interpreter_results as run_worker
from kvloom.testing.interpreter import print_results, record_case

EPS = 1e-6
FP32_TOL = 1e-5
INTERP_MIN_EXACT = 0.99
GPU_NORM_MAX_MISMATCH = 1e-3

# --------------------------------------------------------------------------- references


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(var + eps)).to(x.dtype)


def ref_fused_add_rms_norm(x, residual, weight, eps):  # type: ignore[no-untyped-def]
    s = x + residual
    return ref_rms_norm(s, weight, eps), s


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def ref_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_tables(max_pos: int, dim: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_pos, dim // 2]`` as kvloom's RotaryEmbedding builds them (fp32, then cast)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype).to(device), freqs.sin().to(dtype).to(device)


# --------------------------------------------------------------------------- comparison


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers ordered like their values (adjacent floats differ by 1)."""
    i = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """``exact``: fraction of bit-identical elements; ``max_ulp`` (16-bit) or ``max_rel``
    (fp32: max |diff| / max |ref|)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    out, ref = out.detach().cpu(), ref.detach().cpu()
    result = {"numel": out.numel(), "dtype": str(out.dtype).removeprefix("torch.")}
    if out.dtype == torch.float32:
        result["exact"] = (out.view(torch.int32) == ref.view(torch.int32)).float().mean().item()
        scale = ref.abs().max().item() or 1.0
        result["max_rel"] = (out - ref).abs().max().item() / scale
    else:
        ulp = (_ordered_bits(out) - _ordered_bits(ref)).abs()
        result["exact"] = (ulp == 0).float().mean().item()
        result["max_ulp"] = int(ulp.max().item())
        result["mismatched"] = int((ulp != 0).sum().item())
    return result


def check_interp(result: dict) -> None:
    assert result["numel"] > 0
    if result["dtype"] == "float32":
        assert result["max_rel"] <= FP32_TOL, result
    else:
        assert result["max_ulp"] <= 1, result
        assert result["exact"] >= INTERP_MIN_EXACT, result


# --------------------------------------------------------------------------- CPU cases

# (op, variant); each runs for every dtype in INTERP_DTYPES.
INTERP_CASES = [
    ("rms_norm", "h64"),
    ("rms_norm", "h96_strided_rows"),
    ("rms_norm", "3d_not_viewable"),
    ("fused_add_rms_norm", "h64"),
    ("fused_add_rms_norm", "h96_strided_rows"),
    ("silu_and_mul", "d64"),
    ("silu_and_mul", "d96_strided_rows"),
    ("silu_and_mul", "3d_d40"),
    ("rotary_qk", "d64_q3_k1_from_qkv"),
    ("rotary_qk", "d80_qk4_from_qkv"),
    ("rotary_qk", "d64_strided_cos_sin"),
    ("qk_norm_rotary", "d64_q3_k1_from_qkv"),
    ("qk_norm_rotary", "d80_q2_k2_from_qkv"),
]
INTERP_DTYPES = ["float32", "bfloat16", "float16"]


def _interp_case(fo, op: str, variant: str, dtype: torch.dtype, seed: int) -> dict:  # type: ignore[no-untyped-def]
    """{label: comparison} for one case."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    n = 5
    if op in ("rms_norm", "fused_add_rms_norm"):
        if variant == "h64":
            x = randn(n, 64, scale=3.0)
        elif variant == "h96_strided_rows":
            x = randn(n, 128, scale=3.0)[:, :96]
        else:  # [5, 4, 64] whose rows cannot be one strided 2-D view (copied first)
            x = randn(4, n, 64, scale=3.0).transpose(0, 1)
        weight = (1.0 + 0.1 * torch.randn(x.shape[-1], generator=gen)).to(dtype)
        if op == "rms_norm":
            return {"out": compare(fo.rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS))}
        residual = randn(*x.shape, scale=3.0)
        x_before, res_before = x.clone(), residual.clone()
        out, summed = fo.fused_add_rms_norm(x, residual, weight, EPS)
        ref_out, ref_sum = ref_fused_add_rms_norm(x, residual, weight, EPS)
        intact = torch.equal(x, x_before) and torch.equal(residual, res_before)
        return {"out": compare(out, ref_out), "sum": compare(summed, ref_sum), "inputs_intact": intact}
    if op == "silu_and_mul":
        if variant == "d64":
            x = randn(n, 128, scale=3.0)
        elif variant == "d96_strided_rows":
            x = randn(n, 256, scale=3.0)[:, :192]
        else:
            x = randn(2, 3, 80, scale=3.0)
        return {"out": compare(fo.silu_and_mul(x), ref_silu_and_mul(x))}
    # rotary_qk: heads sliced out of a fused qkv projection output [N, (q + k + v) * D].
    dim = 80 if variant.startswith("d80") else 64
    q_heads, k_heads = (2, 2) if "q2_k2" in variant else (3, 1)
    qkv = randn(n, (q_heads + 2 * k_heads) * dim, scale=2.0).view(n, q_heads + 2 * k_heads, dim)
    positions = torch.randint(0, 64, (n,), generator=gen)
    if variant == "d64_strided_cos_sin":  # one [max_pos, D] cache: cos and sin are column slices
        cos_t, sin_t = rope_tables(64, dim, dtype)
        cache = torch.cat((cos_t, sin_t), dim=-1)[positions].unsqueeze(1)
        cos, sin = cache[..., : dim // 2], cache[..., dim // 2:]
    else:
        cos_t, sin_t = rope_tables(64, dim, dtype)
        cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
    if op == "qk_norm_rotary":  # kvloom's contract for it (kvloom.testing.check_custom_op)
        from kvloom.testing import check_custom_op

        weights = [(1.0 + 0.1 * torch.randn(dim, generator=gen)).to(dtype) for _ in range(2)]
        qk = qkv[:, : q_heads + k_heads]
        report = check_custom_op(op, fo.qk_norm_rotary, qk, *weights, q_heads, EPS, cos, sin)
        # 16-bit: only a norm's last bit may differ, rarely; float32 sums round differently often.
        return {"passed": bool(report["passed"]),
                "exact_99": dtype == torch.float32 or report["exact"] >= INTERP_MIN_EXACT}
    if variant == "d80_qk4_from_qkv":
        qk = qkv[:, : q_heads + k_heads]
        return {"qk": compare(fo.rotary_qk(qk, cos, sin), ref_rotary(qk, cos, sin))}
    q, k = qkv[:, :q_heads], qkv[:, q_heads: q_heads + k_heads]
    out_q = fo.rotary_qk(q, cos, sin)
    return {"q": compare(out_q, ref_rotary(q, cos, sin)), "k": compare(fo.rotary_qk(k, cos, sin), ref_rotary(k, cos, sin)),
            "contiguous": out_q.is_contiguous()}


def _run_worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from kvloom.testing.interpreter import patch_bf16_rounding

    patch_bf16_rounding()
    from kvloom_platform_cuda import fused_ops as fo

    assert fo._INTERPRET
    torch.set_num_threads(1)
    results: dict = {}
    for index, (op, variant) in enumerate(INTERP_CASES):
        for dtype in INTERP_DTYPES:
            case = functools.partial(_interp_case, fo, op, variant, getattr(torch, dtype), seed=100 + index)
            record_case(results, f"{op}-{variant}-{dtype}", case)
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_worker(__file__, timeout=600)


@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize(("op", "variant"), INTERP_CASES, ids=[f"{o}-{v}" for o, v in INTERP_CASES])
def test_interpreter_matches_torch(interpreter_results: dict, op: str, variant: str, dtype: str) -> None:
    result = interpreter_results[f"{op}-{variant}-{dtype}"]
    assert "error" not in result, result["error"]
    for label, value in result.items():
        if isinstance(value, bool):
            assert value, f"{label} is False"
        else:
            check_interp(value)


# --------------------------------------------------------------------------- validation (no launch)


def _fo():  # type: ignore[no-untyped-def]
    from kvloom_platform_cuda import fused_ops

    return fused_ops


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda fo: fo.rms_norm(torch.ones(2, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32), EPS), "x"),
        (lambda fo: fo.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8), EPS), "x"),
        (lambda fo: fo.rms_norm(torch.ones(2, 8), torch.ones(7), EPS), "weight"),
        (lambda fo: fo.rms_norm(torch.ones(2, 8), torch.ones(8, dtype=torch.bfloat16), EPS), "weight"),
        (lambda fo: fo.rms_norm(torch.ones(2, 8), torch.ones(8), -1.0), "eps"),
        (lambda fo: fo.rms_norm("x", torch.ones(8), EPS), "x"),
        (lambda fo: fo.fused_add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), EPS), "residual"),
        (lambda fo: fo.fused_add_rms_norm(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float16), torch.ones(8), EPS),
         "residual"),
        (lambda fo: fo.silu_and_mul(torch.ones(2, 7)), "x"),
        (lambda fo: fo.silu_and_mul(torch.ones(2, 8, dtype=torch.int64)), "x"),
        (lambda fo: fo.rotary_qk(torch.ones(2, 64), torch.ones(2, 1, 32), torch.ones(2, 1, 32)), "x"),
        (lambda fo: fo.rotary_qk(torch.ones(2, 3, 63), torch.ones(2, 1, 31), torch.ones(2, 1, 31)), "x"),
        (lambda fo: fo.rotary_qk(torch.ones(2, 3, 64), torch.ones(2, 1, 64), torch.ones(2, 1, 32)), "cos"),
        (lambda fo: fo.rotary_qk(torch.ones(2, 3, 64), torch.ones(3, 1, 32), torch.ones(2, 1, 32)), "cos"),
        (lambda fo: fo.rotary_qk(torch.ones(2, 3, 64), torch.ones(2, 1, 32), torch.ones(2, 1, 32, dtype=torch.half)),
         "sin"),
        (lambda fo: fo.qk_norm_rotary(torch.ones(2, 3, 64), torch.ones(32), torch.ones(64), 2, EPS,
                                      torch.ones(2, 1, 32), torch.ones(2, 1, 32)), "q_weight"),
        (lambda fo: fo.qk_norm_rotary(torch.ones(2, 3, 64), torch.ones(64), torch.ones(64, dtype=torch.half), 2, EPS,
                                      torch.ones(2, 1, 32), torch.ones(2, 1, 32)), "k_weight"),
        (lambda fo: fo.qk_norm_rotary(torch.ones(2, 3, 64), torch.ones(64), torch.ones(64), 4, EPS,
                                      torch.ones(2, 1, 32), torch.ones(2, 1, 32)), "num_q_heads"),
        (lambda fo: fo.qk_norm_rotary(torch.ones(2, 3, 64), torch.ones(64), torch.ones(64), 2, -1.0,
                                      torch.ones(2, 1, 32), torch.ones(2, 1, 32)), "eps"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, argument: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        call(_fo())


def test_cpu_tensors_rejected_outside_the_interpreter() -> None:
    fo = _fo()
    if fo._INTERPRET:
        pytest.skip("TRITON_INTERPRET is set in this process")
    with pytest.raises(ValueError, match=r"^x must be a CUDA tensor"):
        fo.rms_norm(torch.ones(2, 8), torch.ones(8), EPS)
    with pytest.raises(ValueError, match=r"^x must be a CUDA tensor"):
        fo.silu_and_mul(torch.ones(2, 8))


def test_mean_factor_is_torch_cuda_fp32_factor() -> None:
    """torch's CUDA mean multiplies the fp32 sum by float(rows) / float(numel)."""
    fo = _fo()
    for rows, hidden in [(1, 4096), (257, 4096), (5, 96), (3, 11008), (7, 80)]:
        expected = (torch.tensor(float(rows), dtype=torch.float32) / torch.tensor(float(rows * hidden))).item()
        assert fo._mean_factor(rows, hidden) == expected


# --------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_DTYPES = [torch.bfloat16, torch.float16]


def _cuda_randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


def _assert_norm_close(out: torch.Tensor, ref: torch.Tensor, max_ulp: int = 2) -> dict:
    result = compare(out, ref)
    assert result["max_ulp"] <= max_ulp, result
    assert result["mismatched"] <= GPU_NORM_MAX_MISMATCH * result["numel"], result
    return result


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (16, 4096), (257, 4096), (16, 32, 128)], ids=str)
def test_gpu_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    fo = _fo()
    x = _cuda_randn(*shape, dtype=dtype, seed=1, scale=2.0)
    weight = 1.0 + _cuda_randn(shape[-1], dtype=torch.float32, seed=2, scale=0.2)
    weight = weight.to(dtype)
    _assert_norm_close(fo.rms_norm(x, weight, 1e-5), ref_rms_norm(x, weight, 1e-5))
    # weight 1: the normalised value itself, at most one ulp off
    ones = torch.ones_like(weight)
    _assert_norm_close(fo.rms_norm(x, ones, 1e-5), ref_rms_norm(x, ones, 1e-5), max_ulp=1)
    # strided rows: the hidden slice of a wider buffer
    wide = _cuda_randn(shape[0], shape[-1] + 256, dtype=dtype, seed=3, scale=2.0)
    xs = wide[:, : shape[-1]]
    _assert_norm_close(fo.rms_norm(xs, weight, 1e-5), ref_rms_norm(xs, weight, 1e-5))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 16, 257])
def test_gpu_fused_add_rms_norm(dtype: torch.dtype, tokens: int) -> None:
    fo = _fo()
    x = _cuda_randn(tokens, 4096, dtype=dtype, seed=4, scale=2.0)
    residual = _cuda_randn(tokens, 4096, dtype=dtype, seed=5, scale=8.0)
    weight = (1.0 + _cuda_randn(4096, dtype=torch.float32, seed=6, scale=0.2)).to(dtype)
    x_before, res_before = x.clone(), residual.clone()
    out, summed = fo.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_sum = ref_fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, ref_sum)
    _assert_norm_close(out, ref_out)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


def _edge_values(dtype: torch.dtype) -> list[float]:
    tiny = 1e-39 if dtype == torch.bfloat16 else 1e-7  # denormal in the dtype
    big = 1e4 if dtype == torch.float16 else 1e30
    return [0.0, -0.0, 100.0, -100.0, 90.0, -90.0, 20.0, -20.0, tiny, -tiny, big, -big, 1e-3, -1e-3, 6.0, -6.0]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 16, 257])
@pytest.mark.parametrize("d", [14336, 11008, 96])
def test_gpu_silu_and_mul_bit_identical(dtype: torch.dtype, tokens: int, d: int) -> None:
    fo = _fo()
    x = _cuda_randn(tokens, 2 * d, dtype=dtype, seed=7, scale=3.0)
    edges = torch.tensor(_edge_values(dtype), dtype=dtype, device="cuda")
    x[0, : len(edges)] = edges  # gate edge cases (exp overflow/underflow, denormals)
    x[-1, d: d + len(edges)] = edges  # up edge cases
    out, ref = fo.silu_and_mul(x), ref_silu_and_mul(x)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), compare(out, ref)
    # strided rows
    xs = _cuda_randn(tokens, 2 * d + 64, dtype=dtype, seed=8, scale=3.0)[:, : 2 * d]
    out, ref = fo.silu_and_mul(xs), ref_silu_and_mul(xs)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), compare(out, ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 16, 257])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(32, 8, 128), (14, 2, 64), (8, 2, 80), (4, 1, 256)])
def test_gpu_rotary_bit_identical(dtype: torch.dtype, tokens: int, q_heads: int, kv_heads: int, dim: int) -> None:
    fo = _fo()
    qkv = _cuda_randn(tokens, (q_heads + 2 * kv_heads) * dim, dtype=dtype, seed=9, scale=2.0)
    heads = qkv.view(tokens, q_heads + 2 * kv_heads, dim)
    q, k, qk = heads[:, :q_heads], heads[:, q_heads: q_heads + kv_heads], heads[:, : q_heads + kv_heads]
    cos_t, sin_t = rope_tables(8192, dim, dtype, device="cuda")
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=torch.Generator("cuda").manual_seed(10))
    cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
    for x in (q, k, qk):
        out, ref = fo.rotary_qk(x, cos, sin), ref_rotary(x, cos, sin)
        assert out.is_contiguous() and out.shape == x.shape
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), compare(out, ref)
    # cos/sin as column slices of one [max_pos, D] cache
    cache = torch.cat((cos_t, sin_t), dim=-1)[positions].unsqueeze(1)
    cos_s, sin_s = cache[..., : dim // 2], cache[..., dim // 2:]
    out, ref = fo.rotary_qk(qk, cos_s, sin_s), ref_rotary(qk, cos_s, sin_s)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), compare(out, ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 16, 257, 4096])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(16, 8, 128), (32, 8, 128), (14, 2, 64)])
def test_gpu_qk_norm_rotary_holds_the_contract(dtype: torch.dtype, tokens: int, q_heads: int, kv_heads: int,
                                               dim: int) -> None:  # fmt: skip
    """Qwen3's q/k norms and rotation in one kernel, against the torch code on CUDA: within
    the contract's tolerance, and nearly all elements bit-identical (only a norm's last
    bit may differ)."""
    from kvloom.testing import check_custom_op

    fo = _fo()
    qkv = _cuda_randn(tokens, (q_heads + 2 * kv_heads) * dim, dtype=dtype, seed=16, scale=3.0)
    heads = qkv.view(tokens, q_heads + 2 * kv_heads, dim)[:, : q_heads + kv_heads]
    q_weight, k_weight = ((1.0 + _cuda_randn(dim, dtype=torch.float32, seed=s, scale=0.2)).to(dtype) for s in (17, 18))
    cos_t, sin_t = rope_tables(8192, dim, dtype, device="cuda")
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=torch.Generator("cuda").manual_seed(19))
    cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
    report = check_custom_op("qk_norm_rotary", fo.qk_norm_rotary, heads, q_weight, k_weight, q_heads, 1e-6, cos, sin)
    assert report["passed"] and report["exact"] >= 0.99, report


@gpu
@needs_cuda
def test_gpu_ops_replay_in_a_cuda_graph() -> None:
    """Captured once, replayed on new inputs copied in place: same results as eager."""
    fo = _fo()
    dtype, tokens = torch.bfloat16, 4
    x = _cuda_randn(tokens, 512, dtype=dtype, seed=11)
    residual = _cuda_randn(tokens, 512, dtype=dtype, seed=12)
    weight = _cuda_randn(512, dtype=dtype, seed=13)
    gate_up = _cuda_randn(tokens, 2 * 256, dtype=dtype, seed=14)
    qkv = _cuda_randn(tokens, 6 * 64, dtype=dtype, seed=15).view(tokens, 6, 64)
    cos_t, sin_t = rope_tables(128, 64, dtype, device="cuda")
    positions = torch.arange(tokens, device="cuda")

    def step():  # type: ignore[no-untyped-def]
        cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
        return (*fo.fused_add_rms_norm(x, residual, weight, EPS), fo.silu_and_mul(gate_up),
                fo.rotary_qk(qkv[:, :5], cos, sin))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (20, 21):
        x.copy_(_cuda_randn(tokens, 512, dtype=dtype, seed=seed))
        gate_up.copy_(_cuda_randn(tokens, 512, dtype=dtype, seed=seed + 10))
        qkv.copy_(_cuda_randn(tokens, 6 * 64, dtype=dtype, seed=seed + 20).view(tokens, 6, 64))
        positions.copy_(torch.arange(tokens, device="cuda") + seed)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, step(), strict=True):
            assert torch.equal(got, want)


if __name__ == "__main__" and "--worker" in sys.argv:
    _run_worker()
