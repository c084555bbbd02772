"""The tensor-parallel group of this process and its collectives.

A process that runs one rank of a tensor-parallel model calls ``init_tensor_parallel``
once, before the model is built; the layers read ``tp_rank()`` / ``tp_world_size()`` when
they are constructed and call ``all_reduce`` / ``all_gather`` in ``forward``. Without it
(the single-process engine) the world size is 1 and no layer calls a collective, so the
TP=1 path does exactly the work it did before tensor parallelism existed.

The collectives are torch.distributed's, on the default process group, with the backend
the platform names (``Platform.dist_backend``: gloo on the CPU, NCCL on CUDA).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _TPState:
    rank: int
    world_size: int


_STATE = _TPState(rank=0, world_size=1)


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 without tensor parallelism)."""
    return _STATE.rank


def tp_world_size() -> int:
    """The tensor-parallel degree (1 without tensor parallelism)."""
    return _STATE.world_size


#: The device index of this rank's process when it is not its rank (None: the rank). A
#: Ray actor sees only the device its placement-group bundle reserved, as index 0.
_DEVICE_INDEX: int | None = None


def set_device_index(index: int | None) -> None:
    """Run this process's worker on device ``index`` instead of device ``tp_rank()``."""
    global _DEVICE_INDEX
    if index is not None and index < 0:
        raise ValueError(f"device index: {index} must be >= 0")
    _DEVICE_INDEX = index


def device_index() -> int:
    """The device this process's worker runs on: its rank on one machine (rank r uses
    device r), or what ``set_device_index`` set (Ray actors: 0)."""
    return _STATE.rank if _DEVICE_INDEX is None else _DEVICE_INDEX


def init_tensor_parallel(
    rank: int, world_size: int, backend: str, init_method: str, timeout_s: float
) -> None:
    """Join the default process group as ``rank`` of ``world_size`` over ``backend``.

    ``timeout_s`` bounds every collective: a rank whose peer died raises instead of
    waiting forever (the executor also watches its workers, this is the second guard)."""
    global _STATE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is outside 0..{world_size - 1}")
    if world_size > 1:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    _STATE = _TPState(rank=rank, world_size=world_size)
    logger.info("tensor-parallel rank %d of %d (backend %s)", rank, world_size, backend)


def destroy_tensor_parallel() -> None:
    """Leave the process group (idempotent)."""
    global _STATE
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = _TPState(rank=0, world_size=1)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place); ``x`` itself at world size 1."""
    if _STATE.world_size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, rank order."""
    if _STATE.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
