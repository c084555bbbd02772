"""The CUDA platform: NVIDIA GPUs, with attention backend priority lists.

Priorities (1 = tried first); vLLM's "Attention Backend Feature Support" tables, except
the standard order below SM 10, which is kvloom's measured one:

============  ==========================================================================
Standard      SM 10.x: FLASHINFER, FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION
              otherwise (Ampere/Hopper, SM 8.x-9.x, and unknown): TRITON_ATTN,
              FLASH_ATTN, FLASHINFER, FLEX_ATTENTION
MLA           SM 10.x: FLASHINFER_MLA, CUTLASS_MLA, FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA,
              FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE
              otherwise: FLASH_ATTN_MLA, FLASHMLA, FLASHINFER_MLA, TRITON_MLA,
              FLASHMLA_SPARSE
MLA prefill   FLASH_ATTN_MLA, FLASHINFER_MLA, TRITON_MLA (any capability)
============  ==========================================================================

Why TRITON_ATTN first below SM 10 (vLLM puts FLASH_ATTN, then FLASHINFER, first): on the
H100 (SM 9.0), nano-vllm's offline workload (Qwen3-0.6B shape, 256 sequences, CUDA graphs)
ran at 15,030 output tok/s with TRITON_ATTN, 14,053 with FLASH_ATTN and 9,804 with
FLASHINFER under async scheduling (12,888 / 12,125 / 9,703 without), all in one run
(``docs/benchmarks/gpu_h100.md`` section 1, ``data/h100_offline_nanovllm_all_backends.json``):
FLASHINFER's per-step host work (a full ``plan()``) costs it most at small batches. No
Ampere (SM 8.x) measurement exists; it keeps the Hopper order. Where ``kvloom backends
tune`` measured this device and model shape, its cached times order the valid backends
instead (``kvloom.attention.tuning``).

Each backend's own declarations (compute capability, head sizes, ...) then decide
whether it is valid; the list only fixes the order. Each entry names the distribution
that provides the backend, so ``kvloom backends`` can say what to install.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from kvloom.interfaces import BackendCandidate, DeviceCapability, EngineConfig, Platform, TPCommunicator, WorkerBase

KVLOOM_PLUGIN_API = "1.0"

_FLASH_ATTN = BackendCandidate("FLASH_ATTN", "kvloom-backend-flash-attn")
_FLASHINFER = BackendCandidate("FLASHINFER", "kvloom-backend-flashinfer")
_TRITON_ATTN = BackendCandidate("TRITON_ATTN", "kvloom-backend-triton")
_FLEX_ATTENTION = BackendCandidate("FLEX_ATTENTION", "kvloom-backend-flex-attention")

_FLASHINFER_MLA = BackendCandidate("FLASHINFER_MLA", "kvloom-backend-flashinfer")  # beside FLASHINFER
_TRITON_MLA = BackendCandidate("TRITON_MLA", "kvloom-backend-triton-mla")
# vLLM's other MLA backends keep their place in its priority order; no first-party
# distribution provides them yet, so their install hint names a future one.
_UNWRITTEN_MLA_PROVIDER = "kvloom-backend-mla"
_CUTLASS_MLA = BackendCandidate("CUTLASS_MLA", _UNWRITTEN_MLA_PROVIDER)
_FLASH_ATTN_MLA = BackendCandidate("FLASH_ATTN_MLA", _UNWRITTEN_MLA_PROVIDER)
_FLASHMLA = BackendCandidate("FLASHMLA", _UNWRITTEN_MLA_PROVIDER)
_FLASHMLA_SPARSE = BackendCandidate("FLASHMLA_SPARSE", _UNWRITTEN_MLA_PROVIDER)
_FLASHINFER_MLA_SPARSE = BackendCandidate("FLASHINFER_MLA_SPARSE", _UNWRITTEN_MLA_PROVIDER)

STANDARD_BLACKWELL = (_FLASHINFER, _FLASH_ATTN, _TRITON_ATTN, _FLEX_ATTENTION)
#: Measured on the H100 (see the module docstring): fastest first.
STANDARD_DEFAULT = (_TRITON_ATTN, _FLASH_ATTN, _FLASHINFER, _FLEX_ATTENTION)
MLA_BLACKWELL = (
    _FLASHINFER_MLA,
    _CUTLASS_MLA,
    _FLASH_ATTN_MLA,
    _FLASHMLA,
    _TRITON_MLA,
    _FLASHMLA_SPARSE,
    _FLASHINFER_MLA_SPARSE,
)
MLA_DEFAULT = (_FLASH_ATTN_MLA, _FLASHMLA, _FLASHINFER_MLA, _TRITON_MLA, _FLASHMLA_SPARSE)
#: MLA prefill (dense varlen attention over decompressed K/V): flash-attn's varlen kernel
#: first (vLLM's default prefill), then FlashInfer's ragged prefill, then Triton. Only
#: backends declaring the "prefill" phase are valid.
MLA_PREFILL = (_FLASH_ATTN_MLA, _FLASHINFER_MLA, _TRITON_MLA)


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    builtin = True
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    supports_cuda_graphs = True
    # Kernel launches return before the GPU is done: async scheduling (on by default here)
    # prepares step n+1 on the host while step n runs.
    supports_async_scheduling = True
    dist_backend = "nccl"
    ray_device_key = "GPU"
    # -O1..-O3 compile the model, as vLLM's levels do: piecewise CUDA graphs for the steps
    # that carry a prefill chunk are what serving needs (docs/benchmarks/compile_h100.md,
    # serving_h100.md); the price is start-up (~25-40 s more, half of it cached on disk).
    # --no-torch-compile or -O0 keeps the eager model.
    compile_by_default = True

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def data_parallel_env(cls, index: int, count: int) -> dict[str, str]:
        # One GPU per replica: replica i sees only the i-th GPU this process sees (as its
        # cuda:0), so every replica runs the same code on "its" device.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            devices = [d.strip() for d in visible.split(",") if d.strip()]
        else:
            devices = [str(i) for i in range(torch.cuda.device_count())]  # NVML: no CUDA context here
        if count > len(devices):
            raise ValueError(f"--data-parallel-size: {count} replicas need one GPU each; {len(devices)} visible "
                             f"(allowed: 1..{max(len(devices), 1)})")  # fmt: skip
        return {"CUDA_VISIBLE_DEVICES": devices[index]}

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major, minor)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        if not torch.cuda.is_available():
            return cls.device_type
        return torch.cuda.get_device_name(device_id)

    @classmethod
    def get_attn_backend_priority(
        cls, use_mla: bool, capability: DeviceCapability | None
    ) -> list[BackendCandidate]:
        # Blackwell datacenter parts (SM 10.x) prefer FlashInfer (TRT-LLM kernels); every
        # other capability, and an unknown one, uses the Ampere/Hopper order.
        blackwell = capability is not None and capability.major == 10
        if use_mla:
            return list(MLA_BLACKWELL if blackwell else MLA_DEFAULT)
        return list(STANDARD_BLACKWELL if blackwell else STANDARD_DEFAULT)

    @classmethod
    def get_mla_prefill_backend_priority(cls, capability: DeviceCapability | None) -> list[BackendCandidate]:
        return list(MLA_PREFILL)

    @classmethod
    def get_worker_cls(cls) -> type[WorkerBase]:
        # Imported here: the worker pulls in the model runner and CUDA-graph machinery.
        from kvloom_platform_cuda.worker import CUDAWorker

        return CUDAWorker

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size > 1:
            from kvloom_platform_cuda.symm_mem_allreduce import max_bytes_from_env

            max_bytes_from_env()  # a bad KVLOOM_SYMM_MEM_MAX_BYTES fails here, before any rank starts

    @classmethod
    def make_tp_communicator(cls, group: ProcessGroup, device: torch.device) -> TPCommunicator:
        """PyTorch symmetric memory's one-shot all-reduce for the small messages (decode)
        when the ranks' GPUs can map each other's memory, NCCL for the rest; NCCL for
        everything, with a warning naming why, when they cannot
        (``kvloom_platform_cuda.symm_mem_allreduce``)."""
        from kvloom_platform_cuda.symm_mem_allreduce import make_communicator

        return make_communicator(group, device)

    @classmethod
    def custom_ops(cls, config: EngineConfig) -> dict[str, Callable[..., object]]:
        """Triton kernels replacing torch code:

        - the layer math of 16-bit models (one kernel each instead of a chain of small
          torch ops). fp32 models keep the torch code, whose rounding the fp32 HF-parity
          tests pin down exactly;
        - the mixture-of-experts layers (``fused_moe``) of every model dtype: grouped-GEMM
          kernels over all experts instead of GEMMs per expert; the torch path reads the
          group sizes on the host, so it cannot run inside a CUDA graph (fp32 through
          IEEE-precision dots, within 1e-5 of the float64 definition);
        - the batched LoRA update (``lora_delta``) when LoRA is enabled, for every model
          dtype: one per-token gather kernel instead of two GEMMs per adapter;
        - the sampler's temperature sampling (``random_sample``) for every model dtype
          (the sampler always runs): one Gumbel-max pass over the logits in the LM
          head's dtype instead of seven float32 passes; same distribution, greedy rows
          the exact argmax."""
        from kvloom_platform_cuda import fused_moe, sampling

        ops: dict[str, Callable[..., object]] = {}
        if config.model.dtype in (torch.float16, torch.bfloat16):
            from kvloom_platform_cuda import fused_ops

            ops.update(
                rms_norm=fused_ops.rms_norm,
                fused_add_rms_norm=fused_ops.fused_add_rms_norm,
                silu_and_mul=fused_ops.silu_and_mul,
                rotary_qk=fused_ops.rotary_qk,
                qk_norm_rotary=fused_ops.qk_norm_rotary,
            )
        ops["fused_moe"] = fused_moe.fused_moe
        ops["random_sample"] = sampling.random_sample
        if config.lora.enable_lora:
            from kvloom_platform_cuda import lora_ops

            ops["lora_delta"] = lora_ops.lora_delta
        return ops
