"""The tensor-parallel all-reduce contract (``kvloom.distributed.communicator``) on the CPU.

* ``KVLOOM_ALLREDUCE`` takes ``auto`` (default), ``symm_mem``, ``nccl``; anything else is an
  error naming the variable and the allowed values, raised by the executor before any
  rank starts;
* without tensor parallelism ``all_reduce`` returns its input and the platform is never
  asked for a communicator;
* ``Platform.make_tp_communicator`` defaults to torch.distributed's all-reduce;
* on two gloo ranks: ``init_tensor_parallel`` installs torch.distributed's communicator;
  the worker's ``init_tp_communicator`` asks the platform (collectively, with the stage's
  group and the worker's device) and ``all_reduce`` then goes through what it returned,
  eagerly and under ``torch.compile`` (Dynamo, fullgraph); ``nccl`` skips the platform;
  ``symm_mem`` on a platform without one is an error naming the platform; leaving the
  group closes the communicator.

TP=2 == TP=1 through the default communicator: ``tests/distributed/test_tensor_parallel.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvloom.distributed import parallel_state
from kvloom.distributed.communicator import ALLREDUCE_ENV, TPCommunicator, allreduce_mode
from kvloom.executor.multiproc import MultiprocExecutor
from kvloom.platforms.interface import Platform
from kvloom.testing import resolve_engine_config
from kvloom.testing.models import tiny_model_dir


@pytest.mark.parametrize(
    ("value", "mode"), [(None, "auto"), ("", "auto"), ("nccl", "nccl"), (" Symm_Mem ", "symm_mem")]
)
def test_the_switch_reads_its_values(value: str | None, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv(ALLREDUCE_ENV, raising=False)
    else:
        monkeypatch.setenv(ALLREDUCE_ENV, value)
    assert allreduce_mode() == mode


def test_a_bad_switch_is_refused_naming_it_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLREDUCE_ENV, "custom")
    message = r"KVLOOM_ALLREDUCE='custom': allowed values are auto, symm_mem, nccl"
    with pytest.raises(ValueError, match=message):
        allreduce_mode()
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=message):
        MultiprocExecutor(config)


class _RecordingCommunicator(TPCommunicator):
    """torch.distributed's sum, counting the calls (a platform's own communicator)."""

    name = "recording"

    def __init__(self, group: Any, device: torch.device) -> None:
        super().__init__(group, device)
        self.calls = 0
        self.closed = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = x.clone()  # a new tensor, as a functional communicator returns
        dist.all_reduce(out, group=self.group)
        return out

    def close(self) -> None:
        self.closed = True


class _RecordingPlatform(Platform):
    name = "recording"
    device_type = "cpu"
    asked: ClassVar[list[tuple[Any, torch.device]]] = []

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def get_attn_backend_priority(cls, use_mla: bool, capability: object) -> list[Any]:
        return []

    @classmethod
    def get_worker_cls(cls) -> Any:
        raise NotImplementedError

    @classmethod
    def make_tp_communicator(cls, group: Any, device: torch.device) -> TPCommunicator:
        cls.asked.append((group, device))
        return _RecordingCommunicator(group, device)


class _PlainPlatform(_RecordingPlatform):
    """A platform that keeps the default hook (torch.distributed's all-reduce)."""

    name = "plain"
    make_tp_communicator = Platform.__dict__["make_tp_communicator"]


def test_without_tensor_parallelism_nothing_is_asked_and_the_input_comes_back() -> None:
    parallel_state.destroy_tensor_parallel()
    _RecordingPlatform.asked.clear()
    parallel_state.init_tp_communicator(_RecordingPlatform, torch.device("cpu"))
    assert _RecordingPlatform.asked == []
    assert parallel_state.tp_communicator() is None
    x = torch.ones(3)
    assert parallel_state.all_reduce(x) is x


def test_the_default_hook_is_torch_distributed() -> None:
    communicator = Platform.make_tp_communicator(None, torch.device("cpu"))  # type: ignore[arg-type]
    assert type(communicator) is TPCommunicator
    assert communicator.name == "torch.distributed"
    assert communicator.device == torch.device("cpu")


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    """One gloo rank: every scenario in order; the observations go to out_dir/rank.json."""
    seen: dict[str, Any] = {}
    parallel_state.init_tensor_parallel(rank, 2, "gloo", f"file://{store}", 60.0)
    try:
        default = parallel_state.tp_communicator()
        seen["default"] = type(default).__name__
        x = torch.full((4, 3), float(rank + 1))
        seen["default_sum"] = parallel_state.all_reduce(x.clone()).tolist()

        # auto: the platform's communicator, asked with the group and the worker's device.
        parallel_state.init_tp_communicator(_RecordingPlatform, torch.device("cpu"))
        communicator = parallel_state.tp_communicator()
        assert isinstance(communicator, _RecordingCommunicator)
        group, device = _RecordingPlatform.asked[-1]
        seen["asked_world_group"] = group is dist.group.WORLD
        seen["asked_device"] = str(device)
        seen["eager_sum"] = parallel_state.all_reduce(x).tolist()
        seen["input_untouched"] = x.tolist()

        def layer(t: torch.Tensor) -> torch.Tensor:
            return parallel_state.all_reduce(t * 2) + 1

        compiled = torch.compile(layer, backend="eager", fullgraph=True)
        seen["compiled_sum"] = compiled(x).tolist()
        seen["calls"] = communicator.calls

        # nccl: torch.distributed's, the platform is not asked.
        asked = len(_RecordingPlatform.asked)
        os.environ["KVLOOM_ALLREDUCE"] = "nccl"
        parallel_state.init_tp_communicator(_RecordingPlatform, torch.device("cpu"))
        seen["replaced_closed"] = communicator.closed
        seen["nccl"] = type(parallel_state.tp_communicator()).__name__
        seen["nccl_asked"] = len(_RecordingPlatform.asked) - asked
        seen["nccl_sum"] = parallel_state.all_reduce(x.clone()).tolist()

        # symm_mem on a platform that has none: an error naming it.
        os.environ["KVLOOM_ALLREDUCE"] = "symm_mem"
        try:
            parallel_state.init_tp_communicator(_PlainPlatform, torch.device("cpu"))
            seen["symm_mem_error"] = None
        except RuntimeError as e:
            seen["symm_mem_error"] = str(e)
        os.environ["KVLOOM_ALLREDUCE"] = "auto"
        parallel_state.init_tp_communicator(_RecordingPlatform, torch.device("cpu"))
        last = parallel_state.tp_communicator()
        dist.barrier()  # both ranks done before either tears the group down (gloo can abort the other)
    finally:
        parallel_state.destroy_tensor_parallel()
    seen["closed_on_destroy"] = isinstance(last, _RecordingCommunicator) and last.closed
    seen["after_destroy"] = parallel_state.tp_communicator() is None
    Path(out_dir, f"{rank}.json").write_text(json.dumps(seen))


def test_two_gloo_ranks_use_the_platforms_communicator(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        summed = [[3.0] * 3] * 4
        assert seen["default"] == "TPCommunicator"
        assert seen["default_sum"] == summed
        assert seen["asked_world_group"] is True
        assert seen["asked_device"] == "cpu"
        assert seen["eager_sum"] == summed
        assert seen["input_untouched"] == [[float(rank + 1)] * 3] * 4
        assert seen["compiled_sum"] == [[7.0] * 3] * 4  # (1*2 + 2*2) + 1
        assert seen["calls"] == 2  # the eager call and the compiled one
        assert seen["replaced_closed"] is True
        assert (seen["nccl"], seen["nccl_asked"], seen["nccl_sum"]) == ("TPCommunicator", 0, summed)
        assert "KVLOOM_ALLREDUCE=symm_mem: the plain platform gave the 'torch.distributed' all-reduce" in (
            seen["symm_mem_error"] or ""
        )
        assert seen["closed_on_destroy"] is True
        assert seen["after_destroy"] is True
