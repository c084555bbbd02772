"""kvloom_platform_cuda.sampling (the ``random_sample`` custom op) through ``check_custom_op``:
greedy rows exactly torch's argmax, sampled rows' token frequencies those of
softmax(logits / temperature).

CPU: the Triton kernel runs in Triton's interpreter in one child process (this file with
``--worker``, as test_fused_ops.py does), on small shapes with small chunks and blocks:
float32/bfloat16/float16 logits, a greedy mask mixed in and an all-random batch (greedy
None), strided rows, vocabularies that are not multiples of the block or the chunk,
several chunks per row, ties, -inf and NaN logits, the seed from torch's generator. The
interpreter runs ~15 ms per program, so the distributional checks use 200 draws per row
(the GPU tests use check_custom_op's default 4000); each case is its own test here.

GPU (``gpu`` marker, skipped without CUDA): Qwen3's vocabulary (151,936) in the three
dtypes, strided rows, a batch of 256 flat rows, a CUDA graph replay (fresh noise per
replay), ``torch.manual_seed`` reproducibility.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

if __name__ == "__main__" and "--worker" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch

from kvloom.testing import check_custom_op
from kvloom.testing.interpreter import interpreter_results as run_worker
from kvloom.testing.interpreter import print_results, record_case

#: Draws per sampled row in the interpreter (see the module docstring).
INTERP_DRAWS = 200
#: name -> (dtype, vocab, temperatures, greedy rows or None, chunk_size, block, row padding)
INTERP_CASES = {
    "fp32-mixed-greedy-two-chunks": ("float32", 40, [0.6, 1.7, 1.0], [False, False, True], 32, 8, 0),
    "bf16-all-random-one-ragged-block": ("bfloat16", 27, [0.5, 1.5], None, 32, 8, 0),
    "fp16-strided-rows": ("float16", 20, [0.7, 1.0, 1.4], [False, True, False], 16, 4, 9),
    "bf16-four-chunks": ("bfloat16", 100, [0.8, 1.0], [False, True], 32, 8, 0),
}
QWEN3_VOCAB = 151_936


def _sampling():  # type: ignore[no-untyped-def]
    from kvloom_platform_cuda import sampling

    return sampling


def make_case(dtype: str, vocab: int, temperatures: list[float], greedy: list[bool] | None, pad: int = 0,
              seed: int = 0, device: str = "cpu", scale: float = 2.0) -> tuple:  # fmt: skip
    """Spread logits (one masked token per row), float32 temperatures and the greedy mask;
    with ``pad``, the logits are rows of a wider tensor (strided)."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(temperatures)
    wide = scale * torch.randn(rows, vocab + pad, generator=gen)
    wide[:, 3] = float("-inf")
    logits = wide.to(getattr(torch, dtype)).to(device)[:, :vocab]
    temperature = torch.tensor(temperatures, dtype=torch.float32, device=device)
    mask = None if greedy is None else torch.tensor(greedy, device=device)
    return logits, temperature, mask


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        (lambda a: {**a, "logits": a["logits"].double()}, "logits"),
        (lambda a: {**a, "logits": a["logits"][0]}, "logits"),
        (lambda a: {**a, "temperature": a["temperature"].half()}, "temperature"),
        (lambda a: {**a, "temperature": a["temperature"][:1]}, "temperature"),
        (lambda a: {**a, "greedy": a["greedy"].int()}, "greedy"),
        (lambda a: {**a, "greedy": a["greedy"][:, None]}, "greedy"),
        (lambda a: {**a, "chunk_size": 48}, "chunk_size"),
        (lambda a: {**a, "block": 12}, "block"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(change, argument: str) -> None:  # type: ignore[no-untyped-def]
    logits, temperature, greedy = make_case("float32", 40, [0.6, 1.0], [False, True])
    args = change({"logits": logits, "temperature": temperature, "greedy": greedy, "chunk_size": 32, "block": 8})
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        _sampling().random_sample(**args)


def test_cpu_tensors_rejected_outside_the_interpreter() -> None:
    from kvloom_platform_cuda.fused_ops import _INTERPRET

    if _INTERPRET:
        pytest.skip("TRITON_INTERPRET is set in this process")
    with pytest.raises(ValueError, match=r"^logits must be a CUDA tensor"):
        _sampling().random_sample(*make_case("bfloat16", 40, [0.6], None))


# --------------------------------------------------------------------------- interpreter


def _special_values(sampling) -> dict:  # type: ignore[no-untyped-def]
    """Ties, -inf and NaN rows, the default chunk/block, the seed's source."""
    op = functools.partial(sampling.random_sample, chunk_size=32, block=8)
    vocab = 70
    logits = torch.randn(6, vocab)
    logits[0, [9, 40, 65]] = 5.0  # greedy: a tie across chunks -> the lowest index, 9
    logits[1, [33, 34, 35, 41]] = 5.0  # greedy: ties within one chunk, across lanes -> 33
    logits[2] = float("-inf")  # greedy, nothing finite -> 0
    logits[3] = float("-inf")  # sampled, all -inf -> 0
    logits[4, :] = float("-inf")
    logits[4, 50] = 0.0  # sampled, one finite token -> it
    logits[5, ::2] = float("nan")  # sampled: a NaN never wins
    greedy = torch.tensor([True, True, True, False, False, False])
    temperature = torch.tensor([1.0, 1.0, 1.0, 0.7, 0.7, 0.7])
    out = op(logits, temperature, greedy)
    assert out.tolist()[:5] == [9, 33, 0, 0, 50], out.tolist()
    assert torch.equal(out[:2], logits[:2].argmax(dim=1))
    nan_rows = logits[5:].repeat(40, 1)
    drawn = op(nan_rows, torch.full((40,), 0.7), None)
    assert bool((drawn % 2 == 1).all()), f"NaN tokens drawn: {drawn.tolist()}"
    # The default work split (block 1024, chunks of 4096 for small batches): two chunks.
    big = torch.randn(3, 5000)
    big[2, 4999] = 50.0  # greedy row whose maximum is the last token of the second chunk
    got = sampling.random_sample(big, torch.tensor([0.5, 1.0, 1.0]), torch.tensor([False, True, True]))
    assert got[1:].tolist() == big[1:].argmax(dim=1).tolist() and 0 <= int(got[0]) < 5000
    # The seed comes from torch's default generator.
    flat = torch.zeros(16, 24)
    ones = torch.ones(16)
    torch.manual_seed(11)
    first = op(flat, ones, None)
    torch.manual_seed(11)
    again = op(flat, ones, None)
    third = op(flat, ones, None)
    assert torch.equal(first, again) and not torch.equal(again, third)
    return {}


def _run_worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from kvloom_platform_cuda.fused_ops import _INTERPRET

    assert _INTERPRET
    sampling = _sampling()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results: dict = {}

    def contract_case(index: int, dtype: str, vocab: int, temps: list, greedy: list | None, chunk: int, block: int,
                      pad: int) -> dict:  # fmt: skip
        args = make_case(dtype, vocab, temps, greedy, pad=pad, seed=100 + index)
        assert pad == 0 or args[0].stride(0) == vocab + pad
        op = functools.partial(sampling.random_sample, chunk_size=chunk, block=block)
        report = check_custom_op("random_sample", op, *args, draws=INTERP_DRAWS)
        return {"draws": report["draws"], "max_chi2_ratio": report["max_chi2_ratio"]}

    for index, (name, case) in enumerate(INTERP_CASES.items()):
        record_case(results, name, functools.partial(contract_case, index, *case))
    record_case(results, "special-values", functools.partial(_special_values, sampling))
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_worker(__file__, timeout=900)


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_meets_the_custom_op_contract(interpreter_results: dict, case: str) -> None:
    """check_custom_op passed in the child: shape, dtype, inputs untouched, greedy rows
    exact, token ids in range, the sampled rows' frequencies within the chi-square bound."""
    result = interpreter_results[case]
    assert "error" not in result, result["error"]
    assert result["draws"] >= INTERP_DRAWS and result["max_chi2_ratio"] < 1, result


def test_interpreter_ties_infinities_nan_and_seed(interpreter_results: dict) -> None:
    """Ties go to the lowest index (across chunks and lanes); rows with nothing finite give
    token 0; a single finite token always wins; NaN logits never do; the default work
    split; the same torch.manual_seed gives the same draws, the next call new ones."""
    result = interpreter_results["special-values"]
    assert "error" not in result, result["error"]


def test_benchmark_smoke_on_the_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/bench_sampler.py --device cpu: a small vocabulary, the op checked, both
    sampler paths and the op timed."""
    script = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks", "bench_sampler.py"
    )
    out = tmp_path / "sampler.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--vocab", "300", "--batches", "1,3",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["check"]["passed"] and [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["torch_ms"] > 0 and row["sampler_op_ms"] > 0 and row["op_ms"] > 0


# --------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
#: Four sampled rows (temperatures around nano-vllm's 0.6) and two greedy ones.
GPU_TEMPERATURES = [0.6, 1.0, 1.0, 0.6, 1.4, 0.8]
GPU_GREEDY = [False, True, False, False, True, False]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("pad", [0, 64], ids=["contiguous", "strided"])
def test_gpu_qwen3_vocabulary_meets_the_contract(dtype: str, pad: int) -> None:
    torch.manual_seed(0)
    args = make_case(dtype, QWEN3_VOCAB, GPU_TEMPERATURES, GPU_GREEDY, pad=pad, seed=1, device="cuda", scale=3.0)
    report = check_custom_op("random_sample", _sampling().random_sample, *args)
    assert report["draws"] >= 4000 and report["max_chi2_ratio"] < 1, report


@gpu
@needs_cuda
def test_gpu_batch_256_of_flat_rows_spreads_over_the_vocabulary() -> None:
    """Flat rows at temperature 0.6: uniform draws. The mean id is within 5 standard
    deviations of the middle, and the lowest 1% of ids get their share (ties resolved to
    the lowest index would inflate it)."""
    torch.manual_seed(0)
    logits = torch.zeros(256, QWEN3_VOCAB, dtype=torch.bfloat16, device="cuda")
    temperature = torch.full((256,), 0.6, device="cuda")
    ids = torch.cat([_sampling().random_sample(logits, temperature, None) for _ in range(16)]).double().cpu()
    n = ids.numel()
    sigma = QWEN3_VOCAB / (12 * n) ** 0.5
    assert abs(float(ids.mean()) - (QWEN3_VOCAB - 1) / 2) < 5 * sigma
    low = float((ids < QWEN3_VOCAB / 100).double().mean())
    assert abs(low - 0.01) < 5 * (0.01 * 0.99 / n) ** 0.5, low


@gpu
@needs_cuda
def test_gpu_op_replays_in_a_cuda_graph_with_fresh_noise() -> None:
    sampling = _sampling()
    logits, temperature, greedy = make_case("bfloat16", QWEN3_VOCAB, [1.0] * 64, [i % 4 == 0 for i in range(64)],
                                            device="cuda", scale=0.1)  # fmt: skip
    sampling.random_sample(logits, temperature, greedy)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampling.random_sample(logits, temperature, greedy)
    draws = []
    for _ in range(3):
        graph.replay()
        draws.append(out.clone())
    argmax = logits.float().argmax(dim=1)
    for drawn in draws:
        assert torch.equal(drawn[greedy], argmax[greedy])
        assert bool(((drawn >= 0) & (drawn < QWEN3_VOCAB)).all())
    assert not torch.equal(draws[0][~greedy], draws[1][~greedy]), "a replay reused the captured noise"


@gpu
@needs_cuda
def test_gpu_manual_seed_reproduces_the_draws() -> None:
    sampling = _sampling()
    logits, temperature, _ = make_case("bfloat16", QWEN3_VOCAB, [0.6] * 32, None, device="cuda", scale=0.1)
    torch.manual_seed(5)
    first = sampling.random_sample(logits, temperature, None)
    torch.manual_seed(5)
    assert torch.equal(first, sampling.random_sample(logits, temperature, None))
    assert not torch.equal(first, sampling.random_sample(logits, temperature, None))


if __name__ == "__main__" and "--worker" in sys.argv:
    _run_worker()
