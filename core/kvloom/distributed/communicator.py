"""The tensor-parallel all-reduce as an object the platform chooses.

``parallel_state.all_reduce`` sums a layer's partial output over the ranks of its stage
through one ``TPCommunicator``. ``init_tensor_parallel`` installs this default one
(torch.distributed's ``all_reduce`` over the stage's group and ``Platform.dist_backend``:
NCCL on CUDA, gloo on the CPU); once the worker's device is set, the generic worker asks
the platform for its own (``Platform.make_tp_communicator``), e.g. the CUDA platform's
symmetric-memory one-shot all-reduce for small messages.

``KVLOOM_ALLREDUCE`` (``allreduce_mode()``) declares the choice: ``auto`` (the default:
the platform's communicator, which may log why it uses torch.distributed),
``symm_mem`` (the platform's symmetric-memory all-reduce or an error saying why not),
``nccl`` (always torch.distributed's all-reduce, over the platform's backend).
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: ``KVLOOM_ALLREDUCE``: which all-reduce the tensor-parallel layers use.
ALLREDUCE_ENV = "KVLOOM_ALLREDUCE"
ALLREDUCE_MODES = ("auto", "symm_mem", "nccl")


def allreduce_mode() -> str:
    """``KVLOOM_ALLREDUCE`` (default ``auto``); another value is an error naming the
    variable and the allowed values."""
    raw = os.environ.get(ALLREDUCE_ENV, "")
    mode = raw.strip().lower() or "auto"
    if mode not in ALLREDUCE_MODES:
        raise ValueError(f"{ALLREDUCE_ENV}={raw!r}: allowed values are {', '.join(ALLREDUCE_MODES)}")
    return mode


class TPCommunicator:
    """Sums tensors over one tensor-parallel group: torch.distributed's ``all_reduce``.

    A subclass (a platform's faster path) overrides ``all_reduce`` and ``close``, and
    names itself in ``name``. ``all_reduce`` is called in the model's forward: inside
    captured CUDA graphs and, for a compiled model, while Dynamo traces it; an override
    that is not a plain torch call hides behind a torch custom op (see the CUDA
    platform's ``symm_mem_allreduce``)."""

    name: ClassVar[str] = "torch.distributed"
    """What this all-reduce is, for the startup log (``"symm_mem"``: the platform's
    symmetric-memory all-reduce, what ``KVLOOM_ALLREDUCE=symm_mem`` requires)."""

    def __init__(self, group: Any, device: torch.device | None = None) -> None:
        #: The tensor-parallel process group (None: the default group).
        self.group = group
        #: The device of this rank's worker (None: not known yet, e.g. before the worker
        #: set it up; torch.distributed's all-reduce does not need it).
        self.device = device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks (same shape and dtype on each). The
        result may be ``x`` itself, summed in place (this default does so), or a new
        tensor: callers use the returned tensor and not ``x`` afterwards."""
        dist.all_reduce(x, group=self.group)
        return x

    def close(self) -> None:
        """Release what the communicator holds (before the process group goes)."""
