"""The platform contract: one active platform describes the device kvloom runs on.

A platform is a plugin (entry-point group ``kvloom.platform_plugins``; the entry point
names a ``Platform`` subclass). Exactly one platform is active: ``KVLOOM_PLATFORM=name``
forces one; otherwise an available out-of-tree platform wins over the built-in ones
(``builtin = True``), and two available out-of-tree platforms are an error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from kvloom.config import EngineConfig
    from kvloom.distributed.communicator import TPCommunicator
    from kvloom.platforms.worker import WorkerBase


class DeviceCapability(NamedTuple):
    """A CUDA-style compute capability, e.g. ``DeviceCapability(9, 0)`` for Hopper."""

    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    @classmethod
    def parse(cls, text: str) -> "DeviceCapability":
        """Parse "9.0", "90" or "sm90"."""
        t = text.lower().removeprefix("sm").removeprefix("_")
        if "." in t:
            major, minor = t.split(".", 1)
            return cls(int(major), int(minor))
        if not t.isdigit() or len(t) < 2:
            raise ValueError(f"device capability {text!r}: expected forms like 9.0, 90 or sm90")
        return cls(int(t[:-1]), int(t[-1]))


@dataclass(frozen=True)
class BackendCandidate:
    """An attention backend named in a platform's priority list.

    ``provider`` is the pip distribution to install when no installed plugin registers
    ``name`` (so ``kvloom backends`` can say what to install).
    """

    name: str
    """The backend's ``NAME``."""
    provider: str
    """The pip distribution that provides the backend (named when it is not installed)."""


class Platform(ABC):
    """Describes a device type: capability, dtypes, worker class, backend priorities."""

    name: ClassVar[str]
    """Unique platform name ("cpu", "cuda", ...): the entry-point name, used by KVLOOM_PLATFORM."""
    device_type: ClassVar[str]
    """The torch device type tensors are placed on."""
    builtin: ClassVar[bool] = False
    """True only for the first-party platforms shipped with kvloom (an available
    out-of-tree platform wins over them)."""
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    """Model dtypes the platform can run, preferred first (used for dtype="auto")."""
    supports_cuda_graphs: ClassVar[bool] = False
    """Whether the worker can capture and replay CUDA graphs. False: the engine runs
    eagerly (cudagraph_mode NONE) whatever the user asked for."""
    supports_async_scheduling: ClassVar[bool] = False
    """Whether the device runs a step asynchronously from the host (a launch returns
    before the device's work is done, as CUDA kernels do), so that async scheduling
    overlaps the host's scheduling and input preparation with the device's step: the
    default (``--async-scheduling`` not given) turns it on here, without pipeline
    parallelism. Declare it only when the worker's ``execute_model`` returns before the
    device finishes and it implements ``sample_tokens`` (structured outputs need it under
    async scheduling). False (the CPU): steps are synchronous by default; an explicit
    ``--async-scheduling`` still runs, correct but with nothing to overlap."""
    dist_backend: ClassVar[str] = "gloo"
    """The torch.distributed backend the tensor-parallel ranks of this platform talk over
    ("gloo" on the CPU, "nccl" on CUDA; an out-of-tree platform names its own, e.g. "hccl")."""
    ray_device_key: ClassVar[str | None] = None
    """The Ray resource one tensor-parallel rank of this platform reserves under
    ``--distributed-executor-backend ray`` ("GPU" on CUDA, "CPU" on the CPU; an
    out-of-tree platform names the resource its Ray nodes advertise, e.g. "NPU"). Ray makes
    only the reserved device visible to the rank's actor, which therefore runs on device
    index 0 of its process. None: the platform does not run under Ray (refused, naming it)."""
    compile_by_default: ClassVar[bool] = False
    """Whether ``-O1`` and above ``torch.compile`` the model by default here (an explicit
    ``--torch-compile`` / ``--no-torch-compile`` wins)."""

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this platform's device is usable in the current process."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why ``is_available()`` returns False, in words for the user (e.g. "no NPU driver
        found", "KVLOOM_MY_PLATFORM is not set"); kvloom appends it to the error it shows
        when the platform is forced or none is available. Default: None (no reason given)."""
        return None

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        """Compute capability (CUDA-like devices); ``None`` when the notion does not apply."""
        return None

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        """The device's name for people (e.g. "NVIDIA H100 80GB HBM3"), shown in the
        engine's startup line and by ``kvloom backends``; only called when the platform is
        available. Default: the device type."""
        return cls.device_type

    @classmethod
    @abstractmethod
    def get_attn_backend_priority(
        cls, use_mla: bool, capability: DeviceCapability | None
    ) -> list[BackendCandidate]:
        """Backends to try, highest priority first."""

    @classmethod
    def get_mla_prefill_backend_priority(cls, capability: DeviceCapability | None) -> list[BackendCandidate]:
        """MLA prefill backends to try, highest priority first (an MLA model selects its
        decode backend from ``get_attn_backend_priority(True, ...)`` and its prefill
        backend from this list). Default: the MLA decode list (a backend declaring both
        phases serves both)."""
        return cls.get_attn_backend_priority(True, capability)

    @classmethod
    @abstractmethod
    def get_worker_cls(cls) -> type["WorkerBase"]:
        """The worker class that runs models on this platform."""

    @classmethod
    def check_and_update_config(cls, config: "EngineConfig") -> None:
        """Adjust the engine config for this platform (called once, early). Default: no-op."""

    @classmethod
    def custom_ops(cls, config: "EngineConfig") -> dict[str, Callable[..., object]]:
        """Fused kernels replacing layer math (and the sampler's ``random_sample``) for
        this config: op name (a key of ``kvloom.interfaces.CUSTOM_OP_SIGNATURES``) -> a
        callable taking that op's arguments. Each must match the torch code it replaces as
        ``kvloom.testing.check_custom_op`` checks (bit-identical, within 2 ulp for the
        norms, or in distribution for ``random_sample``) for the dtypes it is returned
        for; return only the ops that hold for ``config.model.dtype``. Called once when the
        model loads; ``--custom-ops none`` drops them all, except for a compiled model
        ``fused_moe`` (its torch code syncs with the host) and ``random_sample`` (the
        sampler runs outside the compiled graph). A compiled model calls the layer ops
        through opaque torch ops (``kvloom.compilation.opaque_ops``), so Dynamo never
        traces into them. Default: none, the torch code runs."""
        return {}

    @classmethod
    def data_parallel_env(cls, index: int, count: int) -> dict[str, str]:
        """The environment variables of data-parallel replica ``index`` of ``count``
        (``--data-parallel-size``): each replica is an engine core process of its own,
        which sets these before its worker starts (e.g. the one device it may use, or its
        share of the CPU threads). Raises ``ValueError`` naming the flag and the allowed
        range when this machine cannot hold ``count`` replicas. Default: data parallelism
        is not supported (a ``ValueError``)."""
        raise ValueError(f"--data-parallel-size: {count} replicas are not supported by the {cls.name} platform "
                         "(allowed: 1)")  # fmt: skip

    @classmethod
    def tensor_parallel_env(cls, rank: int, world_size: int) -> dict[str, str]:
        """The environment variables of tensor-parallel rank ``rank`` of ``world_size``
        (``--tensor-parallel-size``): each rank is a worker process of its own, which sets
        these before its worker is built (e.g. its share of the CPU threads). Rank ``r``'s
        worker runs on ``device(r)``. Default: none."""
        return {}

    @classmethod
    def make_tp_communicator(cls, group: ProcessGroup, device: torch.device) -> TPCommunicator:
        """The all-reduce of one tensor-parallel group (``group``: its torch.distributed
        process group, over ``dist_backend``), for the rank whose worker runs on
        ``device`` (already set up). Called once per rank, by every rank of the group
        together, after the worker set its device (the generic worker's ``init_device``),
        unless ``KVLOOM_ALLREDUCE=nccl``. A platform with a faster path for some messages
        returns a ``kvloom.distributed.communicator.TPCommunicator`` subclass; one that
        cannot use it here logs why (once, naming the reason) and returns the default;
        with ``KVLOOM_ALLREDUCE=symm_mem`` it raises instead. Default: torch.distributed's
        all-reduce (``TPCommunicator``)."""
        from kvloom.distributed.communicator import TPCommunicator

        return TPCommunicator(group, device)

    @classmethod
    def device(cls, device_id: int = 0) -> torch.device:
        """The torch device the worker runs on."""
        return torch.device(cls.device_type, device_id) if cls.device_type != "cpu" else torch.device("cpu")
