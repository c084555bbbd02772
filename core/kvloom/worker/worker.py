"""The generic torch worker: runs on any device torch supports.

The CPU platform subclasses it to set torch's thread count; the CUDA platform to size the
KV cache by profiling and to capture CUDA graphs (through the model runner's
``profile_peak_memory`` and ``capture_cudagraphs``). Out-of-tree platforms can do the same.
"""

from __future__ import annotations

import logging

import torch

from kvloom.config import EngineConfig
from kvloom.distributed import parallel_state
from kvloom.lora.request import LoRARequest
from kvloom.outputs import ModelRunnerOutput, PendingModelRunnerOutput
from kvloom.platforms.interface import Platform
from kvloom.scheduler.output import GrammarOutput, SchedulerOutput
from kvloom.worker.model_runner import ModelRunner
from kvloom.worker.worker_base import WorkerBase

logger = logging.getLogger(__name__)

#: KV-cache budget on devices without a memory-utilisation notion (CPU), unless
#: --kv-cache-memory says otherwise.
DEFAULT_HOST_KV_CACHE_BYTES = 2 * 2**30


class Worker(WorkerBase):
    """kvloom's generic torch worker: runs on ``platform.device()`` through a ``ModelRunner``
    (``self.runner``). Platforms subclass it and override ``init_device`` (device setup),
    ``kv_cache_budget_bytes`` (the KV-cache memory budget) and ``compile_or_warm_up_model``
    (e.g. CUDA-graph capture), driving the runner through its public methods only.

    Threads: it leaves torch's thread settings alone, so the model runs with torch's
    defaults (intra-op threads: the cores torch sees, or ``OMP_NUM_THREADS``) in the
    process that runs the engine core. ``torch.set_num_threads`` is process-wide: a
    platform that wants another count calls it in ``init_device`` (kvloom's CPU worker does
    so from ``KVLOOM_CPU_THREADS``, else from the cores the process may use)."""

    def __init__(self, config: EngineConfig, platform: type[Platform]) -> None:
        super().__init__(config, platform)
        # Global rank r (pipeline stage r // tp, tensor-parallel rank r % tp) runs on
        # device r of this machine (a Ray actor on the one device Ray made visible to it:
        # parallel_state.device_index).
        self.device = platform.device(parallel_state.device_index())
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        """Seed torch with ``config.model.seed``, take the platform's tensor-parallel
        all-reduce (``parallel_state.init_tp_communicator``: collective, with TP > 1 only)
        and build the model runner on ``self.device``; torch's thread count is left as it
        is. A subclass sets its device up before calling it."""
        torch.manual_seed(self.config.model.seed)
        parallel_state.init_tp_communicator(self.platform, self.device)
        self.model_runner = ModelRunner(self.config, self.device)

    @property
    def runner(self) -> ModelRunner:
        """The model runner (built by ``init_device``)."""
        if self.model_runner is None:
            raise RuntimeError("init_device() must run before the worker is used")
        return self.model_runner

    def load_model(self) -> None:
        self.runner.load_model()

    def kv_cache_budget_bytes(self) -> int:
        """Bytes for the KV cache. Devices with memory profiling override this."""
        return self.config.cache.kv_cache_memory or DEFAULT_HOST_KV_CACHE_BYTES

    def determine_num_kv_blocks(self) -> int:
        if self.config.cache.num_gpu_blocks_override is not None:
            return self.config.cache.num_gpu_blocks_override
        per_block = self.runner.kv_cache_bytes_per_block()
        return max(self.kv_cache_budget_bytes() // per_block, 0)

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> None:
        # One eager forward so lazy initialisation (kernels, allocator) happens before the
        # first request's timings.
        self.runner.dummy_forward(min(16, self.runner.max_num_tokens), 1)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        return self.runner.execute_model_async(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.runner.sample_tokens(grammar_output).get_output()

    def sample_tokens_async(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        return self.runner.sample_tokens(grammar_output)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the runner's LoRA manager; ValueError without ``--enable-lora``."""
        manager = getattr(self.runner, "lora_manager", None)
        if manager is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True (--enable-lora)")
        return manager.add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if it was not loaded."""
        manager = getattr(self.runner, "lora_manager", None)
        return manager.remove_adapter(lora_id) if manager is not None else False

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters."""
        manager = getattr(self.runner, "lora_manager", None)
        return manager.list_adapters() if manager is not None else set()
