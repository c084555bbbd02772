"""The CUDA platform's tensor-parallel all-reduce: PyTorch symmetric memory, one shot.

A decode step of a TP model makes two all-reduces per layer of a few KiB to a few MiB
each; NCCL's fixed cost per call dominates at those sizes. Here each rank owns one
buffer in PyTorch's symmetric memory (``torch.distributed._symmetric_memory``, CUDA
backend: peer-to-peer mappings over NVLink/PCIe P2P), mapped by every rank of the group
at start-up (``rendezvous``). ``torch.ops.symm_mem.one_shot_all_reduce_copy`` then does a
message in one kernel: copy this rank's input into its buffer, wait for the peers, read
and sum every rank's buffer into a fresh output, wait again (so no rank overwrites its
buffer while a peer still reads it). Only this P2P kernel is used: no multimem /
NVLink-multicast op, and ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` defaults to 1 here, so the
rendezvous does not even set up a multicast object.

Which messages go where (the same on every rank, so the ranks never disagree):
the one-shot kernel for bfloat16/float32 contiguous tensors of at most
``KVLOOM_SYMM_MEM_MAX_BYTES`` bytes (default 8 MiB, the buffer's size) whose size is a
multiple of 4 bytes and whose storage offset is 16-byte aligned (the kernel's alignment
rule); NCCL (``torch.distributed.all_reduce``) for everything else (prefill chunks,
other dtypes).

It runs inside captured CUDA graphs (one kernel on the current stream; the output comes
from the graph's pool) and, for a compiled model, as the opaque torch op
``torch.ops.kvloom_cuda.symm_mem_all_reduce`` (a new tensor, the input untouched), which
routes as above when it runs.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from kvloom.interfaces import TPCommunicator, allreduce_mode

logger = logging.getLogger(__name__)

#: ``KVLOOM_SYMM_MEM_MAX_BYTES``: the symmetric buffer's size, the largest message the
#: one-shot kernel takes (larger ones go through NCCL).
MAX_BYTES_ENV = "KVLOOM_SYMM_MEM_MAX_BYTES"
DEFAULT_MAX_BYTES = 8 * 2**20
#: The dtypes torch's one-shot kernel is built for.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
#: Multicast stays off: the one-shot kernel reads the peers' buffers through P2P
#: mappings only (set before the first rendezvous, unless the user set it).
_DISABLE_MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


def max_bytes_from_env() -> int:
    """``KVLOOM_SYMM_MEM_MAX_BYTES`` (default 8 MiB): a positive multiple of 16, else an
    error naming the variable."""
    raw = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0 or value % 16:
        raise ValueError(f"{MAX_BYTES_ENV}={raw!r}: expected a number of bytes > 0 and a multiple of 16 "
                         f"(default {DEFAULT_MAX_BYTES})")  # fmt: skip
    return value


#: Live communicators by process-group name, for the opaque op (one per group).
_BY_GROUP: dict[str, SymmMemCommunicator] = {}


class SymmMemCommunicator(TPCommunicator):
    """One-shot all-reduce through a symmetric buffer of ``max_bytes`` bytes for the
    messages it fits (see the module), NCCL for the others. Built by
    ``make_communicator`` once the ranks agreed that they can use it; collective."""

    name = "symm_mem"

    def __init__(self, group: Any, device: torch.device, max_bytes: int) -> None:
        super().__init__(group, device)
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name: str = group.group_name
        self.max_bytes = max_bytes
        # torch's default allocation backend (no set_backend: torch 2.11 registers its CUDA
        # allocator under no name set_backend accepts). Older torch needs the group
        # enabled first; newer ones deprecate the call and need nothing.
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(self.group_name):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its deprecation notice
                enable(self.group_name)
        # One buffer for every dtype: messages view its first bytes as their dtype.
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        _BY_GROUP[self.group_name] = self

    def fits(self, x: torch.Tensor) -> bool:
        """Whether the one-shot kernel takes ``x`` (else NCCL does)."""
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in SUPPORTED_DTYPES
            and x.device == self.device
            and x.is_contiguous()
            and nbytes <= self.max_bytes
            and nbytes % 4 == 0
            and (x.storage_offset() * x.element_size()) % 16 == 0
        )

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group as a new tensor, through the buffer (``fits(x)``)."""
        staging = self.buffer.view(x.dtype)[: x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Dynamo records one opaque node; the routing runs when the graph runs.
            return torch.ops.kvloom_cuda.symm_mem_all_reduce(x, self.group_name)
        if self.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x

    def close(self) -> None:
        if _BY_GROUP.get(self.group_name) is self:
            del _BY_GROUP[self.group_name]
        # The mapping goes with the last reference to the buffer (idempotent).
        vars(self).pop("handle", None)
        vars(self).pop("buffer", None)


@torch.library.custom_op("kvloom_cuda::symm_mem_all_reduce", mutates_args=())
def symm_mem_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``SymmMemCommunicator.all_reduce`` of the group ``group_name`` for compiled models:
    the sum as a new tensor (``x`` is not modified, whichever path runs)."""
    communicator = _BY_GROUP.get(group_name)
    if communicator is None:
        raise RuntimeError(f"torch.ops.kvloom_cuda.symm_mem_all_reduce: no symmetric-memory communicator "
                           f"for process group {group_name!r} in this process")  # fmt: skip
    if communicator.fits(x):
        return communicator.one_shot(x)
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=communicator.group)
    return out


@symm_mem_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _local_reason(device: torch.device) -> str | None:
    """Why this process cannot use the one-shot kernel, before talking to the peers."""
    if device.type != "cuda":
        return f"the worker's device {device} is not a CUDA device"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401

        _ = torch.ops.symm_mem.one_shot_all_reduce_copy.default  # is the op in this build?
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this torch build ({torch.__version__}) has no symmetric-memory one-shot all-reduce ({e})"
    return None


def _p2p_reason(devices: list[int]) -> str | None:
    """Why the group's GPUs (``devices``: each rank's device index, as this process
    numbers them) cannot map each other's memory, or None. Every rank computes it from
    the same list, so they agree."""
    if len(set(devices)) != len(devices) or max(devices) >= torch.cuda.device_count():
        return (f"the ranks' GPUs {devices} are not distinct devices visible to each rank (e.g. Ray shows "
                "each actor only its own GPU), so peer-to-peer access cannot be set up")  # fmt: skip
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b}'s memory (no NVLink/PCIe peer-to-peer between them)"
    return None


def _gather(group: Any, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order. Collective."""
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _first_reason(reasons: list[str | None]) -> str | None:
    """The first rank's reason, naming the rank (None: every rank is fine)."""
    return next((f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None), None)


def make_communicator(group: Any, device: torch.device) -> TPCommunicator:
    """The CUDA platform's ``make_tp_communicator``: a ``SymmMemCommunicator`` when every
    rank of ``group`` can use it; otherwise torch.distributed's, with one warning naming
    why (``KVLOOM_ALLREDUCE=auto``), or a ``RuntimeError`` naming why
    (``KVLOOM_ALLREDUCE=symm_mem``). Collective: every rank calls it, in the same order."""
    mode = allreduce_mode()
    max_bytes = max_bytes_from_env()
    # Each step is decided from what every rank reported, so all ranks take the same path.
    gathered = _gather(group, (device.index, _local_reason(device)))
    why = _first_reason([reason for _, reason in gathered])
    if why is None:
        why = _p2p_reason([index for index, _ in gathered])
    communicator: SymmMemCommunicator | None = None
    if why is None:
        os.environ.setdefault(_DISABLE_MULTICAST_ENV, "1")
        failure = None
        try:
            communicator = SymmMemCommunicator(group, device, max_bytes)
        except Exception as e:  # noqa: BLE001 (torch's C++ setup raises RuntimeError and others; all are reasons)
            failure = f"symmetric-memory rendezvous failed: {type(e).__name__}: {e}"
        why = _first_reason(_gather(group, failure))
        if why is not None and communicator is not None:
            communicator.close()
            communicator = None
    if communicator is not None:
        logger.info("all-reduce: symmetric-memory one-shot for bfloat16/float32 messages up to %d bytes "
                    "(%s), NCCL above", max_bytes, MAX_BYTES_ENV)  # fmt: skip
        return communicator
    if mode == "symm_mem":
        raise RuntimeError(f"KVLOOM_ALLREDUCE=symm_mem: the symmetric-memory all-reduce cannot be used: {why}")
    logger.warning("all-reduce: NCCL for every message, not the symmetric-memory one-shot kernel: %s "
                   "(KVLOOM_ALLREDUCE=nccl chooses NCCL without trying)", why)  # fmt: skip
    return TPCommunicator(group, device)
