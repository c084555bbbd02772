"""The CUDA worker: the generic torch worker plus memory profiling and CUDA graphs.

KV-cache sizing follows vLLM: the model runner runs one forward at the largest batch the
scheduler can produce (``max_num_batched_tokens`` tokens over ``max_num_seqs`` requests)
plus a sampler pass and reports the peak of torch's allocator
(``ModelRunner.profile_peak_memory``); the KV cache gets what is left of
``gpu_memory_utilization * total`` after that peak and after memory that torch does not
own (CUDA context, cuBLAS workspaces, other processes).
"""

from __future__ import annotations

import logging

import torch

from kvloom.interfaces import Worker

KVLOOM_PLUGIN_API = "1.0"

logger = logging.getLogger(__name__)

#: Headroom for CUDA-graph memory pools and allocator fragmentation.
GRAPH_AND_FRAGMENTATION_RESERVE = 512 * 2**20


class CUDAWorker(Worker):
    def init_device(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA platform is active but torch sees no CUDA device")
        torch.cuda.set_device(self.device)
        torch.cuda.empty_cache()
        # fp32 runs must be real fp32 (HF parity); TF32 would round matmul inputs.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        super().init_device()

    def kv_cache_budget_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        peak = self.runner.profile_peak_memory(torch.cuda)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory in use that torch's allocator does not account for: CUDA context,
        # library workspaces, other processes.
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * cache.gpu_memory_utilization) - peak - non_torch - GRAPH_AND_FRAGMENTATION_RESERVE
        logger.info(
            "Memory profile: total %.1f GiB x %.2f, torch peak %.2f GiB, non-torch %.2f GiB -> KV cache %.2f GiB",
            total / 2**30,
            cache.gpu_memory_utilization,
            peak / 2**30,
            non_torch / 2**30,
            budget / 2**30,
        )
        if budget <= 0:
            raise ValueError(
                f"No memory left for the KV cache: gpu_memory_utilization={cache.gpu_memory_utilization} of "
                f"{total / 2**30:.1f} GiB minus the model's peak {peak / 2**30:.2f} GiB is not enough; "
                "raise --gpu-memory-utilization or lower --max-num-batched-tokens / --max-num-seqs"
            )
        return budget

    def compile_or_warm_up_model(self) -> None:
        # The warm-up forward (after the profile run, which compiled the model when
        # compilation is on), then the graphs the runner's dispatcher asks for (none when
        # the resolved cudagraph_mode is NONE: it logs why).
        super().compile_or_warm_up_model()
        self.runner.capture_cudagraphs()
