"""example_cpu: the host CPU, described the way a vendor describes a new device.

A vendor's ``is_available`` probes its device; this example runs on any host, so it is
available only when ``KVLOOM_EXAMPLE_PLATFORM=1``: installing it does not change which
platform other runs use. When available it wins over kvloom's built-in platforms, as
every available out-of-tree platform does.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvloom.interfaces import (
    BackendCandidate,
    DeviceCapability,
    EngineConfig,
    Platform,
    WorkerBase,
)

KVLOOM_PLUGIN_API = "1.0"

AVAILABLE_ENV = "KVLOOM_EXAMPLE_PLATFORM"


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The ``silu_and_mul`` custom op: ``silu(x[..., :d]) * x[..., d:]``, a new tensor.
    (A vendor calls its fused kernel here; it must match the torch code's results.)"""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class ExamplePlatform(Platform):
    name = "example_cpu"
    device_type = "cpu"  # the torch device type tensors go to
    builtin = False  # True only for kvloom's own platforms
    supported_dtypes = (torch.float32, torch.bfloat16)  # preferred first: what dtype="auto" runs
    supports_cuda_graphs = False

    @classmethod
    def is_available(cls) -> bool:
        return os.environ.get(AVAILABLE_ENV) == "1"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return f"{AVAILABLE_ENV} is not set to 1"  # shown when this platform is forced but unavailable

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "example device (host CPU)"

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        return None  # no CUDA-style capability

    @classmethod
    def get_attn_backend_priority(cls, use_mla: bool, capability: DeviceCapability | None) -> list[BackendCandidate]:
        # (backend NAME, the distribution that provides it), highest priority first.
        return [
            BackendCandidate("EXAMPLE_ATTN", "kvloom-example-attention-backend"),
            BackendCandidate("CPU_ATTN", "kvloom-backend-cpu"),
        ]

    @classmethod
    def get_worker_cls(cls) -> type[WorkerBase]:
        from kvloom_example_platform.worker import ExampleWorker  # lazily: only engines need it

        return ExampleWorker

    @classmethod
    def custom_ops(cls, config: EngineConfig) -> dict[str, Callable[..., object]]:
        return {"silu_and_mul": silu_and_mul}
