"""kvloom_platform_cuda.fused_moe (the ``fused_moe`` custom op) against the float64
definition (``kvloom.testing.fused_moe_reference``) through ``check_custom_op``.

CPU: the torch alignment (``moe_align_torch``) is tested here directly; the Triton
kernels (the alignment's and the GEMMs) run in
Triton's interpreter in one child process (this file with ``--worker``, as
test_fused_ops.py does, with its bf16 rounding patch), on small shapes that cover one
token, experts without tokens, several blocks per expert, sizes that are not multiples of
the tiles and strided hidden rows; each case is its own test here.

GPU (``gpu`` marker, skipped without CUDA): DeepSeek-V2-Lite's expert shape (hidden 2048,
intermediate 1408, 64 experts, top-6) in bf16/fp16/fp32 at 1 to 256 tokens, the Triton
alignment at up to 4096 tokens, and a CUDA graph capture replayed on new routing.
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

from kvloom.interfaces.models import select_experts
from kvloom.testing import check_custom_op, custom_op_reference
from kvloom.testing.interpreter import interpreter_results as run_worker
from kvloom.testing.interpreter import print_results, record_case

fused_moe_torch = custom_op_reference("fused_moe")

# (tokens, experts, top_k, hidden, intermediate)
INTERP_CASES = {
    "one-token": (1, 8, 2, 32, 16),
    "few-tokens-idle-experts": (5, 16, 3, 64, 32),
    "blocks-per-expert": (48, 4, 2, 32, 24),  # ~24 rows per expert: two 16-row blocks each
    "ragged-sizes": (7, 6, 2, 40, 24),  # hidden/intermediate not multiples of the tiles
    "strided-hidden": (9, 8, 2, 32, 16),
}
INTERP_DTYPES = ["float32", "bfloat16", "float16"]
#: Tensor parallelism: (tokens, experts, top_k, hidden, whole intermediate, ranks); each
#: rank's experts are cut along the intermediate dimension (FusedMoE(parallel=True)), here
#: into sizes that are not multiples of the tiles.
TP_SHARD_CASE = (11, 8, 2, 40, 72, 2)


def tp_shard(w13: torch.Tensor, w2: torch.Tensor, rank: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slices of whole experts, as ``FusedMoE(parallel=True)`` loads them:
    rows of the gate and of the up half of ``w13``, the same columns of ``w2``."""
    inter = w2.shape[-1] // ranks
    rows = slice(rank * inter, (rank + 1) * inter)
    gate, up = w13.chunk(2, dim=1)
    return torch.cat([gate[:, rows], up[:, rows]], dim=1), w2[:, :, rows]


def make_case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
              seed: int, device: str = "cpu", strided: bool = False) -> tuple:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden + (16 if strided else 0), generator=gen)[:, :hidden]
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    weights, ids = select_experts(2 * torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return (x.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device), weights.to(device),
            ids.to(device))  # fmt: skip


# --------------------------------------------------------------------------- alignment (torch)


def _fm():  # type: ignore[no-untyped-def]
    from kvloom_platform_cuda import fused_moe

    return fused_moe


ALIGN_CASES = [(1, 8, 2), (37, 8, 3), (200, 64, 6), (5, 3, 3), (70, 4, 2)]  # (tokens, experts, top_k)


def random_ids(tokens: int, experts: int, top_k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)


def check_alignment(align, ids: torch.Tensor, experts: int, block_m: int) -> None:  # type: ignore[no-untyped-def]
    """Every pair exactly once, each block of one expert and not all padding, the unused
    tail sentinel, and the padded length the group sizes give."""
    n = ids.numel()
    used = int(align.num_padded.item())
    assert used % block_m == 0 and used <= align.sorted_ids.numel()
    assert align.block_expert.numel() == align.sorted_ids.numel() // block_m
    sorted_ids = align.sorted_ids[:used].long()
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n)), "not every pair exactly once"
    assert bool((align.sorted_ids[used:] == n).all()), "the unused tail is not sentinel"
    assert bool((sorted_ids <= n).all()), "garbage ids"
    flat = ids.reshape(-1).long()
    for b in range(used // block_m):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < n]
        assert rows.numel() > 0, f"block {b} holds only padding"
        assert bool((flat[rows] == int(align.block_expert[b])).all()), f"block {b} mixes experts"
    counts = torch.bincount(flat, minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), ALIGN_CASES)
def test_torch_alignment_groups_every_pair_once_by_expert(block_m: int, tokens: int, experts: int, top_k: int) -> None:
    check_alignment(_fm().moe_align_torch(random_ids(tokens, experts, top_k), experts, block_m),
                    random_ids(tokens, experts, top_k), experts, block_m)  # fmt: skip


def test_block_m_grows_with_rows_per_expert() -> None:
    fm = _fm()
    assert fm.moe_block_config(6, 64) == 16
    assert fm.moe_block_config(64 * 6, 64) == 16
    assert fm.moe_block_config(256 * 6, 64) == 32
    assert fm.moe_block_config(4096 * 6, 64) == 64


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        (lambda a: {**a, "hidden": a["hidden"].double()}, "hidden"),
        (lambda a: {**a, "w13": a["w13"][:, :-1]}, "w13"),
        (lambda a: {**a, "w2": a["w2"].half()}, "w2"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].long()}, "topk_ids"),
        (lambda a: {**a, "topk_ids": a["topk_ids"][:-1]}, "topk_ids"),
        (lambda a: {**a, "topk_weights": a["topk_weights"].half()}, "topk_weights"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(change, argument: str) -> None:  # type: ignore[no-untyped-def]
    x, w13, w2, weights, ids = make_case(4, 8, 2, 32, 16, torch.float32, seed=0)
    args = change({"hidden": x, "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids})
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        _fm().fused_moe(**args)


def test_cpu_tensors_rejected_outside_the_interpreter() -> None:
    fm = _fm()
    if fm._INTERPRET:
        pytest.skip("TRITON_INTERPRET is set in this process")
    with pytest.raises(ValueError, match=r"^hidden must be a CUDA tensor"):
        fm.fused_moe(*make_case(4, 8, 2, 32, 16, torch.bfloat16, seed=0))


# --------------------------------------------------------------------------- interpreter


def _run_worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kvloom.testing.interpreter import patch_bf16_rounding

    patch_bf16_rounding()
    fm = _fm()
    assert fm._INTERPRET
    torch.set_num_threads(1)
    results: dict = {}

    def align_case(tokens: int, experts: int, top_k: int, block_m: int) -> dict:
        ids = random_ids(tokens, experts, top_k)
        check_alignment(fm.moe_align(ids, experts, block_m), ids, experts, block_m)
        return {}

    def contract_case(index: int, name: str, shape: tuple, dtype: str) -> dict:
        args = make_case(*shape, getattr(torch, dtype), seed=200 + index, strided=name == "strided-hidden")
        report = check_custom_op("fused_moe", fm.fused_moe, *args)
        torch_report = check_custom_op("fused_moe", fused_moe_torch, *args)
        return {"max_rel": report["max_rel"], "torch_max_rel": torch_report["max_rel"]}

    def tp_shards_case() -> dict:
        # The kernels take the sharded weights as given (intermediate size from their shape):
        # each rank's output meets the contract and the ranks' sum (the all-reduce) is the
        # whole layer's within the float32 tolerance.
        *shape, ranks = TP_SHARD_CASE
        x, w13, w2, weights, ids = make_case(*shape, torch.float32, seed=300)
        parts = []
        for rank in range(ranks):
            w13_r, w2_r = tp_shard(w13, w2, rank, ranks)
            check_custom_op("fused_moe", fm.fused_moe, x, w13_r.contiguous(), w2_r.contiguous(), weights, ids)
            parts.append(fm.fused_moe(x, w13_r.contiguous(), w2_r.contiguous(), weights, ids).double())
        whole = fused_moe_torch(x.double(), w13.double(), w2.double(), weights.double(), ids)
        return {"max_abs": float((sum(parts) - whole).abs().max())}

    for tokens, experts, top_k in ALIGN_CASES:
        for block_m in (16, 32):
            key = f"align-{tokens}-{experts}-{top_k}-{block_m}"
            record_case(results, key, functools.partial(align_case, tokens, experts, top_k, block_m))
    for index, (name, shape) in enumerate(INTERP_CASES.items()):
        for dtype in INTERP_DTYPES:
            record_case(results, f"{name}-{dtype}", functools.partial(contract_case, index, name, shape, dtype))
    record_case(results, "tp-shards", tp_shards_case)
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_worker(__file__, timeout=900)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), ALIGN_CASES)
def test_interpreter_alignment_groups_every_pair_once_by_expert(
    interpreter_results: dict, tokens: int, experts: int, top_k: int, block_m: int
) -> None:
    """The Triton alignment (count, layout, scatter kernels) meets check_alignment."""
    result = interpreter_results[f"align-{tokens}-{experts}-{top_k}-{block_m}"]
    assert "error" not in result, result["error"]


@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_interpreter_meets_the_custom_op_contract(interpreter_results: dict, case: str, dtype: str) -> None:
    """check_custom_op passed in the child (float64 definition within the dtype's
    tolerance, inputs untouched, shape and dtype); the kernels' error is also no worse
    than twice the torch path's."""
    result = interpreter_results[f"{case}-{dtype}"]
    assert "error" not in result, result["error"]
    assert result["max_rel"] <= 2 * result["torch_max_rel"] + 1e-6, result


def test_benchmark_smoke_on_the_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/bench_fused_moe.py --device cpu: the tiny shape, both paths checked and timed."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks", "bench_fused_moe.py")
    out = tmp_path / "moe.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--batches", "1,5", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["tokens"] for row in result["rows"]] == [1, 5]
    for row in result["rows"]:
        assert row["triton_ms"] > 0 and row["torch_ms"] > 0 and 1 <= row["experts_touched"] <= 8


# --------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
#: DeepSeek-V2-Lite's routed experts.
LITE = {"experts": 64, "top_k": 6, "hidden": 2048, "inter": 1408}


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 16, 64, 256])
def test_gpu_deepseek_v2_lite_shape_meets_the_contract(dtype: torch.dtype, tokens: int) -> None:
    args = make_case(tokens, LITE["experts"], LITE["top_k"], LITE["hidden"], LITE["inter"], dtype, seed=tokens,
                     device="cuda")  # fmt: skip
    report = check_custom_op("fused_moe", _fm().fused_moe, *args)
    torch_report = check_custom_op("fused_moe", fused_moe_torch, *args)
    assert report["max_rel"] <= 2 * torch_report["max_rel"] + 1e-6, (report, torch_report)


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 512, 4096])
def test_gpu_alignment(tokens: int) -> None:
    ids = random_ids(tokens, 64, 6)
    for block_m in (16, 32, 64):
        align = _fm().moe_align(ids.cuda(), 64, block_m)
        check_alignment(type(align)(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in (
            align.sorted_ids, align.block_expert, align.num_padded, align.block_m))), ids, 64, block_m)  # fmt: skip


@gpu
@needs_cuda
def test_gpu_op_replays_in_a_cuda_graph() -> None:
    """Captured once (no host synchronisation inside), replayed on new routing and new
    hidden states copied in place: the eager results."""
    fm = _fm()
    x, w13, w2, weights, ids = make_case(16, 64, 6, 256, 128, torch.bfloat16, seed=1, device="cuda")
    static = [x.clone(), weights.clone(), ids.clone()]
    fm.fused_moe(static[0], w13, w2, static[1], static[2])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(static[0], w13, w2, static[1], static[2])
    for seed in (2, 3):
        nx, _, _, nw, nids = make_case(16, 64, 6, 256, 128, torch.bfloat16, seed=seed, device="cuda")
        static[0].copy_(nx)
        static[1].copy_(nw)
        static[2].copy_(nids)
        graph.replay()
        assert torch.equal(out, fm.fused_moe(nx, w13, w2, nw, nids))


if __name__ == "__main__" and "--worker" in sys.argv:
    _run_worker()


def test_interpreter_runs_tensor_parallel_expert_shards(interpreter_results: dict) -> None:
    """Each rank's slice of the experts (intermediate 72 / 2 = 36, not a tile multiple)
    runs through the kernels and the ranks' outputs add up to the whole layer's."""
    result = interpreter_results["tp-shards"]
    assert "error" not in result, result["error"]
    assert result["max_abs"] < 1e-4, result
