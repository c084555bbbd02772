"""The CPU platform: torch on the host CPU, attention by the CPU_ATTN backend, models
run by ``CpuWorker`` (the generic worker; ``KVLOOM_CPU_THREADS`` sets torch's threads).

CUDA graphs do not exist on the CPU: ``supports_cuda_graphs = False``, so the engine runs
eagerly (``cudagraph_mode`` NONE, logged when the user had asked for another mode).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from kvloom.interfaces import BackendCandidate, DeviceCapability, EngineConfig, Platform, WorkerBase
from kvloom_platform_cpu.worker import THREADS_ENV

KVLOOM_PLUGIN_API = "1.0"


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    ray_device_key = "CPU"
    builtin = True
    # float32 first: "auto" runs in float32 on the CPU, where half-precision matmuls are
    # slower on most processors and less accurate.
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supports_cuda_graphs = False
    # torch on the CPU computes while the host waits: a step is done when its launch
    # returns, so async scheduling has nothing to overlap (off unless --async-scheduling).
    supports_async_scheduling = False

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def data_parallel_env(cls, index: int, count: int) -> dict[str, str]:
        # The replicas share this machine's cores: each gets its share of torch threads
        # (torch would give every one of them all the cores), unless KVLOOM_CPU_THREADS
        # says how many each should use.
        if os.environ.get(THREADS_ENV, "").strip():
            return {}
        return {THREADS_ENV: str(max(1, len(os.sched_getaffinity(0)) // count))}

    @classmethod
    def tensor_parallel_env(cls, rank: int, world_size: int) -> dict[str, str]:
        # The ranks share this machine's cores, as data-parallel replicas do.
        return cls.data_parallel_env(rank, world_size)

    @classmethod
    def get_attn_backend_priority(
        cls, use_mla: bool, capability: DeviceCapability | None
    ) -> list[BackendCandidate]:
        # MLA models: CPU_MLA (both phases; see get_mla_prefill_backend_priority, which
        # defaults to this list). Standard models: CPU_ATTN, then FLEX_ATTENTION.
        if use_mla:
            return [BackendCandidate("CPU_MLA", "kvloom-backend-cpu")]
        return [
            BackendCandidate("CPU_ATTN", "kvloom-backend-cpu"),
            BackendCandidate("FLEX_ATTENTION", "kvloom-backend-flex-attention"),
        ]

    @classmethod
    def custom_ops(cls, config: EngineConfig) -> dict[str, Callable[..., object]]:
        """For float32 models, C kernels (``layer_ops``) of ``rms_norm``,
        ``fused_add_rms_norm`` and ``rotary_qk``: one call each instead of a chain of small
        torch ops, which is most of a small model's decode step. Half-precision models keep
        the torch code."""
        if config.model.dtype != torch.float32:
            return {}
        from kvloom_platform_cpu import layer_ops

        return layer_ops.ops()

    @classmethod
    def get_worker_cls(cls) -> type[WorkerBase]:
        # Imported here: the worker pulls in the whole model runner.
        from kvloom_platform_cpu.worker import CpuWorker

        return CpuWorker
