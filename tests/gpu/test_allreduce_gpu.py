"""The CUDA platform's symmetric-memory all-reduce on two GPUs (``KVLOOM_ALLREDUCE=symm_mem``:
it must be usable, or the test fails naming why).

Two processes, one GPU each, an NCCL group; the communicator comes from
``CudaPlatform.make_tp_communicator`` as a worker gets it. Against NCCL's
``all_reduce`` of the same tensors (a sum of two values is correctly rounded in either
order, so the results must be bit-identical):

* bfloat16 and float32 messages of 1, 16, 64, 256 and 512 rows x 4096 take the one-shot
  kernel, leave their input untouched and give NCCL's sum; a message above the buffer
  (``KVLOOM_SYMM_MEM_MAX_BYTES``) and a float16 one go through NCCL;
* captured in a CUDA graph (a chain of all-reduces, as a decode step makes), replayed
  with new inputs;
* under ``torch.compile`` (Inductor, fullgraph) of a small function, on a message of each
  route;
* an engine: TP=2 with the symmetric-memory all-reduce, compiled with CUDA graphs, gives
  TP=1's greedy tokens (the fp32 tiny Llama).

Run on a machine with two GPUs: ``bash tests/gpu/run.sh allreduce``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers

from kvloom.testing.models import tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

HIDDEN = 4096
ROWS = (1, 16, 64, 256, 512)


def _check(failures: list[str], label: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.shape != expected.shape or got.dtype != expected.dtype or not torch.equal(got, expected):
        diff = (got.float() - expected.float()).abs().max().item() if got.shape == expected.shape else None
        failures.append(f"{label}: got {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} "
                        f"{expected.dtype}; max |diff| {diff}")  # fmt: skip


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    os.environ["KVLOOM_ALLREDUCE"] = "symm_mem"
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2, device_id=device)
    from kvloom_platform_cuda.platform import CudaPlatform
    from kvloom_platform_cuda.symm_mem_allreduce import SymmMemCommunicator

    failures: list[str] = []
    routes: dict[str, bool] = {}
    try:
        comm = CudaPlatform.make_tp_communicator(dist.group.WORLD, device)
        assert isinstance(comm, SymmMemCommunicator), type(comm)
        gen = torch.Generator(device=device).manual_seed(1234 + rank)

        def rand(rows: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.randn(rows, HIDDEN, generator=gen, device=device, dtype=torch.float32).to(dtype)

        # Eager: the one-shot kernel for each size, NCCL above the buffer and for float16.
        for dtype in (torch.bfloat16, torch.float32):
            for rows in ROWS:
                x = rand(rows, dtype)
                before = x.clone()
                label = f"eager {rows}x{HIDDEN} {dtype}"
                routes[label] = comm.fits(x)
                _check(failures, label, comm.all_reduce(x), _nccl_sum(before))
                _check(failures, f"{label} input", x, before)
        big_rows = comm.max_bytes // (HIDDEN * 2) + 1
        for label, x in (("above the buffer", rand(big_rows, torch.bfloat16)), ("float16", rand(4, torch.float16))):
            routes[label] = comm.fits(x)
            expected = _nccl_sum(x)
            _check(failures, label, comm.all_reduce(x), expected)

        # A CUDA graph of a chain of all-reduces, replayed with new inputs.
        for rows in (1, 64, 512):
            static = rand(rows, torch.bfloat16)

            def chain(t: torch.Tensor) -> torch.Tensor:
                for _ in range(4):
                    t = comm.all_reduce(t) * 0.5
                return t

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                chain(static)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(static)
            for replay in range(3):
                static.copy_(rand(rows, torch.bfloat16))
                expected = static.clone()
                for _ in range(4):
                    expected = _nccl_sum(expected) * 0.5
                graph.replay()
                _check(failures, f"graph {rows}x{HIDDEN} replay {replay}", out, expected)

        # torch.compile (Inductor): the opaque op, each route.
        compiled = torch.compile(lambda t: comm.all_reduce(t * 2) + 1, fullgraph=True)
        for rows in (1, 16, big_rows):
            x = rand(rows, torch.bfloat16)
            _check(failures, f"compiled {rows}x{HIDDEN}", compiled(x), _nccl_sum(x * 2) + 1)
        comm.close()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"failures": failures, "routes": routes}))


def test_symm_mem_all_reduce_matches_nccl(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        seen: dict[str, Any] = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["failures"] == [], f"rank {rank}: {seen['failures']}"
        routes = seen["routes"]
        assert all(routes[f"eager {rows}x{HIDDEN} {dtype}"] for rows in ROWS
                   for dtype in ("torch.bfloat16", "torch.float32")), routes  # fmt: skip
        assert routes["above the buffer"] is False and routes["float16"] is False, routes


def test_tp2_with_symm_mem_compiled_matches_tp1(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.gpu.test_tp_gpu import greedy_tokens

    model = str(tiny_model_dir("llama"))
    expected = greedy_tokens(model, enforce_eager=True)
    monkeypatch.setenv("KVLOOM_ALLREDUCE", "symm_mem")
    compiled = {"optimization_level": 2, "torch_compile": True}  # Inductor + full decode graphs
    assert greedy_tokens(model, tensor_parallel_size=2, **compiled) == expected
