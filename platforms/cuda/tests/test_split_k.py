"""``kvloom_platform_cuda.split_k``: a split-K launch whose last program of each tile adds the
partials. The sum is the partials added in split order (bit for bit, whoever arrives last),
the counters are zero after every launch (so the next launch and a replayed CUDA graph add
again), and unsplit launches write the output directly.

CPU: Triton's interpreter in one child process (this file with ``--worker``). GPU (``gpu``
marker): many back-to-back launches over a grid far larger than the GPU, where a program
reading a partial before its writer's stores are visible would show as a wrong or changing
sum.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--worker" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch

from kvloom.testing.interpreter import interpreter_results, patch_bf16_rounding, print_results, record_case

triton = pytest.importorskip("triton")
tl = triton.language

from kvloom_platform_cuda.split_k import split_k_buffers, store_split_k


@triton.jit
def _partials_kernel(src_ptr, out_ptr, part_ptr, counter_ptr, M, N, SPLIT_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Split ``s`` of the tile contributes ``src[s]``'s tile: the output is ``sum_s src[s]``."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    at = tl.program_id(2) * M * N + offs_m[:, None] * N + offs_n[None, :]
    acc = tl.load(src_ptr + at, mask=mask, other=0.0)
    store_split_k(acc, out_ptr, part_ptr, counter_ptr, offs_m, offs_n, M, N, N, SPLIT_K)


def split_sum(src: torch.Tensor, out_dtype: torch.dtype, block: int = 16) -> tuple[torch.Tensor, int]:
    """``src [S, M, N]`` float32 -> (its sum over S through ``store_split_k``, the split used)."""
    s, m, n = src.shape
    grid = (triton.cdiv(m, block), triton.cdiv(n, block))
    split, partials, counters = split_k_buffers(m, n, s, grid[0] * grid[1], src.device)
    assert split == s
    out = torch.empty((m, n), dtype=out_dtype, device=src.device)
    _partials_kernel[(*grid, split)](src, out, partials, counters, m, n, SPLIT_K=split, BLOCK_M=block, BLOCK_N=block)
    return out, split


def in_order(src: torch.Tensor) -> torch.Tensor:
    total = src[0].clone()
    for part in src[1:]:
        total += part
    return total


CASES = {"split-3": (3, 5, 40, torch.float32), "split-4-bf16": (4, 17, 33, torch.bfloat16),
         "unsplit": (1, 9, 20, torch.float16)}  # fmt: skip


def run_case(name: str) -> dict:
    from kvloom_platform_cuda.split_k import split_k_counters

    s, m, n, dtype = CASES[name]
    src = torch.randn(s, m, n, generator=torch.Generator().manual_seed(len(name)))
    first, _ = split_sum(src, dtype)
    second, _ = split_sum(src, dtype)
    return {"error": None, "exact": torch.equal(first, in_order(src).to(dtype)), "again": torch.equal(first, second),
            "counters_zero": int(split_k_counters(src.device).abs().sum())}  # fmt: skip


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results(__file__, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_split_sum_in_the_interpreter(results: dict, name: str) -> None:
    result = results[name]
    assert result.get("error") is None, result["error"]
    assert result["exact"] and result["again"] and result["counters_zero"] == 0, result


def test_more_tiles_than_counters_run_unsplit() -> None:
    from kvloom_platform_cuda.split_k import MAX_SPLIT_TILES

    split, partials, counters = split_k_buffers(4, 8, 3, MAX_SPLIT_TILES + 1, torch.device("cpu"))
    assert split == 1 and partials is counters


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("split", [2, 7, 16])
def test_split_sum_on_the_gpu_under_many_launches(split: int) -> None:
    """20,000+ programs per launch (many waves over the SMs), 200 launches back to back, and
    the same launches replayed from a CUDA graph: every sum exact, the counters zero."""
    from kvloom_platform_cuda.split_k import split_k_counters

    src = torch.randn(split, 64, 4096 * 3, device="cuda")
    expected = in_order(src).to(torch.bfloat16)
    outs = [split_sum(src, torch.bfloat16)[0] for _ in range(200)]
    torch.cuda.synchronize()
    assert all(torch.equal(out, expected) for out in outs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = split_sum(src, torch.bfloat16)
    for _ in range(50):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)
    assert int(split_k_counters(src.device).abs().sum()) == 0


if __name__ == "__main__" and "--worker" in sys.argv:
    patch_bf16_rounding()
    collected: dict = {}
    for case_name in CASES:
        record_case(collected, case_name, lambda case_name=case_name: run_case(case_name))
    print_results(collected)
