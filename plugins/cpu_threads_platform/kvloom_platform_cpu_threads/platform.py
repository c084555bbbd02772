"""CpuThreadsPlatform: the host CPU, with a fixed torch thread count, its own worker
class and its own backend priority list.

A vendor's platform probes its device in ``is_available``. This example runs on any
host, so it is available only when ``KVLOOM_CPU_THREADS_PLATFORM`` gives the number of
threads: installing it (kvloom's development setup installs everything under
``plugins/``) does not change which platform other runs use. When it is available it
wins over kvloom's built-in CPU platform, as every available out-of-tree platform does.
"""

from __future__ import annotations

import logging

import torch

from kvloom.interfaces import BackendCandidate, DeviceCapability, Platform, WorkerBase
from kvloom_platform_cpu_threads.threads import THREADS_ENV, configured_threads

KVLOOM_PLUGIN_API = "1.0"

logger = logging.getLogger(__name__)


class CpuThreadsPlatform(Platform):
    name = "cpu_threads"
    device_type = "cpu"
    builtin = False
    supported_dtypes = (torch.float32, torch.bfloat16)
    supports_cuda_graphs = False

    @classmethod
    def is_available(cls) -> bool:
        return configured_threads() is not None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return f"{THREADS_ENV} is not set"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"cpu ({configured_threads()} threads)"

    @classmethod
    def get_attn_backend_priority(
        cls, use_mla: bool, capability: DeviceCapability | None
    ) -> list[BackendCandidate]:
        # (backend NAME, the distribution that provides it), highest priority first.
        return [
            BackendCandidate("CPU_ATTN", "kvloom-backend-cpu"),
            BackendCandidate("FLEX_ATTENTION", "kvloom-backend-flex-attention"),
        ]

    @classmethod
    def get_worker_cls(cls) -> type[WorkerBase]:
        from kvloom_platform_cpu_threads.worker import CpuThreadsWorker  # lazily: the worker is heavy

        return CpuThreadsWorker
