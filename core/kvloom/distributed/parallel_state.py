"""The tensor- and pipeline-parallel groups of this process and their collectives.

A worker process that runs one rank of a parallel model calls ``init_tensor_parallel``
once, before the model is built; the layers read ``tp_rank()`` / ``tp_world_size()`` (and
the models ``pp_rank()`` / ``pp_world_size()``) when they are constructed and call
``all_reduce`` / ``all_gather`` (tensor parallelism) or ``send`` / ``recv`` (pipeline
parallelism) in ``forward``. Without it (the single-process engine) both sizes are 1 and
no layer calls a collective, so that path does exactly the work it did before
parallelism existed.

Rank layout: ``world_size = tensor_parallel_size * pipeline_parallel_size`` and global
rank ``r`` is pipeline stage ``r // tp`` and tensor-parallel rank ``r % tp`` within it, so
the ranks of one stage are adjacent (on one machine, the GPUs of a stage are neighbours).
Each stage has its own tensor-parallel subgroup; ``send`` / ``recv`` go from a rank to the
rank of the same tensor-parallel index in the next stage, over the default group.

The collectives are torch.distributed's, with the backend the platform names
(``Platform.dist_backend``: gloo on the CPU, NCCL on CUDA), except the all-reduce, which
goes through a ``TPCommunicator`` (``kvloom.distributed.communicator``): torch.distributed's
from ``init_tensor_parallel`` on, the platform's choice once the worker has set its device
and called ``init_tp_communicator`` (the generic worker does, in ``init_device``).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kvloom.distributed.communicator import ALLREDUCE_ENV, TPCommunicator, allreduce_mode

if TYPE_CHECKING:
    from kvloom.platforms.interface import Platform

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ParallelState:
    rank: int
    world_size: int
    tp_size: int
    #: This stage's tensor-parallel group (None: the default group, or no collectives).
    tp_group: Any = None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def pp_size(self) -> int:
        return self.world_size // self.tp_size


_STATE = _ParallelState(rank=0, world_size=1, tp_size=1)
#: The all-reduce of this stage's tensor-parallel group (None without tensor parallelism).
_COMMUNICATOR: TPCommunicator | None = None


def rank() -> int:
    """This process's global rank (0 without parallelism); the device index it runs on."""
    return _STATE.rank


def world_size() -> int:
    """All ranks: tensor-parallel size x pipeline-parallel size."""
    return _STATE.world_size


def tp_rank() -> int:
    """This process's tensor-parallel rank within its stage (0 without tensor parallelism)."""
    return _STATE.tp_rank


def tp_world_size() -> int:
    """The tensor-parallel degree (1 without tensor parallelism)."""
    return _STATE.tp_size


def pp_rank() -> int:
    """This process's pipeline stage (0 without pipeline parallelism)."""
    return _STATE.pp_rank


def pp_world_size() -> int:
    """The number of pipeline stages (1 without pipeline parallelism)."""
    return _STATE.pp_size


def is_first_stage() -> bool:
    return _STATE.pp_rank == 0


def is_last_stage() -> bool:
    return _STATE.pp_rank == _STATE.pp_size - 1


def output_rank(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    """The global rank whose step output the engine uses: the last stage's TP rank 0."""
    return (pipeline_parallel_size - 1) * tensor_parallel_size


#: The device index of this rank's process when it is not its rank (None: the rank). A
#: Ray actor sees only the device its placement-group bundle reserved, as index 0.
_DEVICE_INDEX: int | None = None


def set_device_index(index: int | None) -> None:
    """Run this process's worker on device ``index`` instead of device ``rank()``."""
    global _DEVICE_INDEX
    if index is not None and index < 0:
        raise ValueError(f"device index: {index} must be >= 0")
    _DEVICE_INDEX = index


def device_index() -> int:
    """The device this process's worker runs on: its rank on one machine (rank r uses
    device r), or what ``set_device_index`` set (Ray actors: 0)."""
    return _STATE.rank if _DEVICE_INDEX is None else _DEVICE_INDEX


def init_tensor_parallel(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    tensor_parallel_size: int | None = None,
) -> None:
    """Join the default process group as ``rank`` of ``world_size`` over ``backend``, and
    this rank's stage's tensor-parallel subgroup. ``tensor_parallel_size``: ranks per
    pipeline stage (default: ``world_size``, i.e. one stage).

    ``timeout_s`` bounds every collective: a rank whose peer died raises instead of
    waiting forever (the executor also watches its workers, this is the second guard)."""
    global _STATE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is outside 0..{world_size - 1}")
    tp = world_size if tensor_parallel_size is None else tensor_parallel_size
    if tp < 1 or world_size % tp != 0:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the world size {world_size}")
    tp_group = None
    if world_size > 1:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout)  # fmt: skip
        if 1 < tp < world_size:
            # new_group is collective: every rank creates every stage's group, in order.
            for stage in range(world_size // tp):
                group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout, backend=backend)
                if stage == rank // tp:
                    tp_group = group
    _STATE = _ParallelState(rank=rank, world_size=world_size, tp_size=tp, tp_group=tp_group)
    _set_communicator(TPCommunicator(tp_group) if tp > 1 else None)
    logger.info("rank %d of %d: pipeline stage %d of %d, tensor-parallel rank %d of %d (backend %s)",
                rank, world_size, _STATE.pp_rank, _STATE.pp_size, _STATE.tp_rank, tp, backend)  # fmt: skip


def init_tp_communicator(platform: type[Platform], device: torch.device) -> None:
    """Use the platform's all-reduce for this stage's tensor-parallel group from now on
    (``Platform.make_tp_communicator``; ``KVLOOM_ALLREDUCE=nccl``: torch.distributed's).
    Collective: every rank of the group calls it, once its device is set (``device`` is
    the one its worker runs on). Nothing to do without tensor parallelism."""
    if _STATE.tp_size == 1:
        return
    mode = allreduce_mode()
    group = _STATE.tp_group if _STATE.tp_group is not None else dist.group.WORLD
    if mode == "nccl":
        communicator = TPCommunicator(_STATE.tp_group, device)
    else:
        communicator = platform.make_tp_communicator(group, device)
        if mode == "symm_mem" and communicator.name != "symm_mem":
            raise RuntimeError(f"{ALLREDUCE_ENV}=symm_mem: the {platform.name} platform gave the "
                               f"{communicator.name!r} all-reduce (it has no symmetric-memory one); "
                               f"use {ALLREDUCE_ENV}=auto or nccl")  # fmt: skip
    _set_communicator(communicator)
    logger.info("tensor-parallel rank %d: all-reduce through %s (%s=%s)", _STATE.tp_rank, communicator.name,
                ALLREDUCE_ENV, mode)  # fmt: skip


def tp_communicator() -> TPCommunicator | None:
    """The communicator ``all_reduce`` uses (None without tensor parallelism)."""
    return _COMMUNICATOR


def _set_communicator(communicator: TPCommunicator | None) -> None:
    global _COMMUNICATOR
    if _COMMUNICATOR is not None and _COMMUNICATOR is not communicator:
        _COMMUNICATOR.close()
    _COMMUNICATOR = communicator


def destroy_tensor_parallel() -> None:
    """Leave the process group (idempotent)."""
    global _STATE
    _set_communicator(None)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = _ParallelState(rank=0, world_size=1, tp_size=1)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over this stage's tensor-parallel ranks through the communicator: the
    sum may be ``x`` (in place) or a new tensor, use the returned one. ``x`` itself at
    size 1."""
    if _STATE.tp_size == 1:
        return x
    assert _COMMUNICATOR is not None, "init_tensor_parallel installs a communicator with the group"
    return _COMMUNICATOR.all_reduce(x)


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every tensor-parallel rank's ``x`` (same shape on all) along ``dim``, rank order."""
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)


def send_to_next_stage(x: torch.Tensor) -> Any:
    """Start sending ``x`` to the same tensor-parallel rank of the next stage; the send's
    handle (``wait()`` it before ``x`` is reused). Messages between two ranks arrive in
    the order they were sent."""
    if is_last_stage():
        raise RuntimeError("send_to_next_stage: the last pipeline stage has no next stage")
    return dist.isend(x.contiguous(), dst=_STATE.rank + _STATE.tp_size)


def recv_from_previous_stage(x: torch.Tensor) -> torch.Tensor:
    """Receive into ``x`` (its shape and dtype must be the sender's) from the same
    tensor-parallel rank of the previous stage; blocks until it arrived."""
    if is_first_stage():
        raise RuntimeError("recv_from_previous_stage: the first pipeline stage has no previous stage")
    dist.recv(x, src=_STATE.rank - _STATE.tp_size)
    return x
