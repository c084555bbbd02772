"""The GGUF method's pieces on fresh random data: ``formats.decode`` against gguf-py's own
dequantizer (bit for bit, every type with a kernel), and the C kernels (GEMM and row
gather, each kernel format, int8 and int16 activations, row counts off the tile size)
against a float64 reference computed from the decoded weight and the activations as the
kernels quantize them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from kvloom_quant_gguf import kernels
from kvloom_quant_gguf.formats import DECODERS, FORMAT_NAMES, decode
from kvloom_quant_gguf.layout import pack
from kvloom_quant_gguf.writer import WRITABLE, quantize

Q = GGMLQuantizationType
#: Where the float16 super-block scales sit in the types without a writer (bytes).
_F16_FIELDS = {Q.Q2_K: (80, 84), Q.Q3_K: (108, 110)}


def _random_raw(ggml_type: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw rows of ``ggml_type``: random weights through the writer, or random blocks with
    finite float16 scales for the types without one."""
    if ggml_type in WRITABLE:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, ggml_type)
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
    start, end = _F16_FIELDS[ggml_type]
    scales = (rng.random((blocks.shape[0], (end - start) // 2)) * 0.01).astype(np.float16)
    blocks[:, start:end] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", list(DECODERS), ids=lambda t: Q(t).name)
def test_decode_is_exactly_gguf_dequantize(ggml_type: int) -> None:
    rng = np.random.default_rng(ggml_type)
    raw = _random_raw(Q(ggml_type), 9, 512, rng)
    expected = dequantize(raw, Q(ggml_type)).reshape(9, 512)
    np.testing.assert_array_equal(decode(raw, ggml_type, 512).dequantize(), expected)


#: One type per kernel format (U4, U8 with groups of 16, S8) and one with a min per group.
KERNEL_TYPES = (Q.Q4_K, Q.Q4_0, Q.Q6_K, Q.Q5_1, Q.Q3_K, Q.Q8_0)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_kernels_match_a_float64_reference(ggml_type: Q, bits: int) -> None:
    problem = kernels.problem()
    if problem:
        pytest.skip(problem)
    rng = np.random.default_rng(1000 * bits + ggml_type)
    rows, cols = 37, 512  # 37: the last tile of 8 rows is partly padding
    decoded = decode(_random_raw(ggml_type, rows, cols, rng), ggml_type, cols)
    codes, params = pack(decoded)
    weight64 = torch.from_numpy(decoded.dequantize()).double()

    ids = torch.tensor([36, 0, 8, 7, 36])
    gathered = kernels.rows(decoded.fmt, ids, cols, codes, params)
    torch.testing.assert_close(gathered.double(), weight64[ids], rtol=1e-6, atol=0)

    for m in (1, 5, 16):
        x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
        x[0, :32] = 0.0  # an all-zero activation block (scale 0)
        full = torch.full((m, rows + 3), float("nan"))
        out = full[:, 1 : rows + 1]  # a segment's columns of a merged output (from column 1)
        kernels.LinearKernel([(decoded.fmt, 1, rows, "codes", "params")], {"codes": codes, "params": params})(
            bits, x, full)
        assert full[:, 0].isnan().all() and full[:, rows + 1 :].isnan().all()  # nothing written past the shard
        expected = kernels.fake_quantize(x, bits).double() @ weight64.T
        error = (out.double() - expected).norm() / expected.norm()
        assert error < 2e-6, f"{ggml_type.name} ({FORMAT_NAMES[decoded.fmt]}) int{bits} M={m}: {error:.2e}"


@pytest.mark.parametrize("bits", [16, 8])
def test_one_call_computes_every_segment(bits: int) -> None:
    """A merged layer's segments of three formats in one ``kvq_linear`` call, each written to
    its own columns (a gap between two, as a float segment leaves), against float64."""
    problem = kernels.problem()
    if problem:
        pytest.skip(problem)
    rng = np.random.default_rng(7 + bits)
    cols, parts = 256, [(Q.Q4_K, 24), (Q.Q6_K, 13), (Q.Q8_0, 16)]
    segments, tensors, weights, start = [], {}, [], 0
    for index, (ggml_type, rows) in enumerate(parts):
        decoded = decode(_random_raw(ggml_type, rows, cols, rng), ggml_type, cols)
        tensors[f"codes{index}"], tensors[f"params{index}"] = pack(decoded)
        segments.append((decoded.fmt, start, rows, f"codes{index}", f"params{index}"))
        weights.append((start, torch.from_numpy(decoded.dequantize()).double()))
        start += rows + 5  # five columns no segment writes
    for m in (1, 3, 40):  # 40: two chunks of activation rows
        x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
        out = torch.full((m, start), float("nan"))
        kernels.LinearKernel(segments, tensors)(bits, x, out)
        x64 = kernels.fake_quantize(x, bits).double()
        for begin, weight in weights:
            expected = x64 @ weight.T
            got = out[:, begin : begin + weight.shape[0]].double()
            assert ((got - expected).norm() / expected.norm()) < 2e-6
            assert out[:, begin + weight.shape[0] : begin + weight.shape[0] + 5].isnan().all()


def test_a_kernel_knows_when_its_weights_moved() -> None:
    """``matmul`` builds a layer's kernel arguments once and again only when a parameter no
    longer lies where the kernel reads (``holds``)."""
    problem = kernels.problem()
    if problem:
        pytest.skip(problem)
    decoded = decode(_random_raw(Q.Q4_0, 8, 64, np.random.default_rng(3)), Q.Q4_0, 64)
    codes, params = pack(decoded)
    tensors = {"codes": codes, "params": params}
    kernel = kernels.LinearKernel([(decoded.fmt, 0, 8, "codes", "params")], tensors)
    assert kernel.holds(tensors)
    tensors["params"].data = params.clone()  # the same parameter, new memory
    assert not kernel.holds(tensors)
    assert kernels.LinearKernel([], tensors).count == 0  # a layer of float segments only
