"""The CUDA platform's all-reduce choice, on the CPU (the kernel itself:
``tests/gpu/test_allreduce_gpu.py`` on two GPUs).

* ``KVLOOM_SYMM_MEM_MAX_BYTES`` takes a positive multiple of 16 (default 8 MiB); anything
  else is an error naming it, raised by ``check_and_update_config`` for a TP config;
* on two gloo ranks whose device is not a CUDA GPU, ``make_tp_communicator`` agrees on
  torch.distributed's all-reduce and logs one warning naming the reason and the rank
  (``KVLOOM_ALLREDUCE=auto``), or raises naming it on every rank (``symm_mem``);
* the opaque op for compiled models is registered with a fake implementation, and a
  compiled function (Dynamo, fullgraph; AOT autograd) calls it as one node whose message
  routes when it runs: here a communicator without a buffer (``max_bytes`` 0) on gloo
  ranks, so to torch.distributed, the input left untouched.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kvloom_platform_cuda import symm_mem_allreduce
from kvloom_platform_cuda.platform import CudaPlatform
from kvloom_platform_cuda.symm_mem_allreduce import DEFAULT_MAX_BYTES, MAX_BYTES_ENV, max_bytes_from_env

from kvloom.interfaces import TPCommunicator
from kvloom.testing import fresh_plugins, resolve_engine_config
from tests.helpers.model_fixtures import tiny_model_dir


@pytest.mark.parametrize(("value", "expected"), [(None, DEFAULT_MAX_BYTES), ("", DEFAULT_MAX_BYTES), ("4096", 4096)])
def test_the_buffer_size_reads_its_variable(value: str | None, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv(MAX_BYTES_ENV, raising=False)
    else:
        monkeypatch.setenv(MAX_BYTES_ENV, value)
    assert max_bytes_from_env() == expected


@pytest.mark.parametrize("value", ["0", "-16", "100", "8MiB"])
def test_a_bad_buffer_size_is_refused_naming_it(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_BYTES_ENV, value)
    message = f"{MAX_BYTES_ENV}='{value}': expected a number of bytes > 0 and a multiple of 16"
    with pytest.raises(ValueError, match=message):
        max_bytes_from_env()
    monkeypatch.setenv("KVLOOM_PLATFORM", "cpu")  # a TP config without a GPU
    with fresh_plugins():
        config = resolve_engine_config(model=str(tiny_model_dir("llama")), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=message):
        CudaPlatform.check_and_update_config(config)


def test_the_opaque_op_has_a_fake_implementation() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 4096, dtype=torch.bfloat16)
        out = torch.ops.kvloom_cuda.symm_mem_all_reduce(x, "0")
    assert (out.shape, out.dtype) == (x.shape, x.dtype)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _leave() -> None:
    """Leave the gloo group once both ranks got here: a rank that tears its group down
    while the other still talks to it can abort the other (seen once in CI: SIGABRT,
    "terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


def _rank_main(rank: int, store: str, out_dir: str, mode: str) -> None:
    os.environ["KVLOOM_ALLREDUCE"] = mode
    records = _Records()
    logging.getLogger("kvloom_platform_cuda").addHandler(records)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    seen: dict[str, object] = {}
    try:
        communicator = CudaPlatform.make_tp_communicator(dist.group.WORLD, torch.device("cpu"))
        seen["type"] = type(communicator).__name__
        seen["is_default"] = type(communicator) is TPCommunicator
        x = torch.full((2, 8), float(rank + 1))
        seen["sum"] = communicator.all_reduce(x).tolist()
    except RuntimeError as e:
        seen["error"] = str(e)
    finally:
        _leave()
    seen["warnings"] = records.messages
    Path(out_dir, f"{rank}.json").write_text(json.dumps(seen))


@pytest.mark.parametrize("mode", ["auto", "symm_mem"])
def test_ranks_without_cuda_agree_on_torch_distributed_and_say_why(mode: str, tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), str(tmp_path), mode), nprocs=2, join=True)
    reason = "rank 0: the worker's device cpu is not a CUDA device"
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        if mode == "auto":
            assert seen["is_default"] is True
            assert seen["sum"] == [[3.0] * 8] * 2
            assert len(seen["warnings"]) == 1
            assert "NCCL for every message, not the symmetric-memory one-shot kernel" in seen["warnings"][0]
            assert reason in seen["warnings"][0]
        else:
            assert "error" in seen, seen
            expected = f"KVLOOM_ALLREDUCE=symm_mem: the symmetric-memory all-reduce cannot be used: {reason}"
            assert expected in seen["error"]


def _compiled_rank_main(rank: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    seen: dict[str, object] = {}
    try:
        # The communicator as make_communicator builds it, without the symmetric buffer
        # (no GPU here): max_bytes 0 sends every message to torch.distributed.
        comm = symm_mem_allreduce.SymmMemCommunicator.__new__(symm_mem_allreduce.SymmMemCommunicator)
        TPCommunicator.__init__(comm, dist.group.WORLD, torch.device("cpu"))
        comm.group_name = dist.group.WORLD.group_name
        comm.max_bytes = 0
        symm_mem_allreduce._BY_GROUP[comm.group_name] = comm
        targets: list[str] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
            targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return gm

        x = torch.full((2, 8), float(rank + 1))
        compiled = torch.compile(lambda t: comm.all_reduce(t * 2) + 1, backend=backend, fullgraph=True)
        seen["compiled"] = compiled(x).tolist()
        seen["input"] = x.tolist()
        seen["targets"] = targets
        seen["aot"] = torch.compile(lambda t: comm.all_reduce(t * 2) + 1, backend="aot_eager", fullgraph=True)(
            x
        ).tolist()
        seen["eager"] = comm.all_reduce(x).tolist()
        comm.close()
        seen["unregistered"] = comm.group_name not in symm_mem_allreduce._BY_GROUP
    finally:
        _leave()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(seen))


def test_a_compiled_call_is_one_opaque_node_that_routes_when_it_runs(tmp_path: Path) -> None:
    mp.spawn(_compiled_rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["compiled"] == seen["aot"] == [[7.0] * 8] * 2  # (1*2 + 2*2) + 1
        assert seen["input"] == [[float(rank + 1)] * 8] * 2
        assert [t for t in seen["targets"] if "all_reduce" in t] == ["kvloom_cuda.symm_mem_all_reduce"]
        assert seen["eager"] == [[3.0] * 8] * 2
        assert seen["unregistered"] is True
