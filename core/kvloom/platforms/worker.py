"""The worker contracts: what the engine core asks of the device-side process.

A platform names its worker class (``Platform.get_worker_cls``). ``WorkerBase`` is the
contract; ``Worker`` is kvloom's generic torch worker, which runs any torch device and is
what the CPU and CUDA platforms subclass. An out-of-tree platform may subclass either.

A worker drives a model runner, which it is handed (``model_runner_cls``), not one it
imports: this module imports contracts only, so the plugin face does not load the
engine. ``ModelRunnerProtocol`` lists the runner methods a worker (and so a platform)
may call; everything else on kvloom's runner is private.

A step is two verbs: ``execute_model`` launches it and returns a
``PendingModelRunnerOutput`` (None when its sampling waits for ``sample_tokens``:
structured outputs under async scheduling), ``sample_tokens`` launches that sampling.
Neither waits for the device: only the engine core calls ``get_output()``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from kvloom.deprecation import Deprecation, deprecated_method
from kvloom.distributed import parallel_state
from kvloom.outputs import PendingModelRunnerOutput

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.lora.request import LoRARequest
    from kvloom.platforms.interface import Platform
    from kvloom.scheduler.output import GrammarOutput, SchedulerOutput

logger = logging.getLogger(__name__)

#: KV-cache budget on devices without a memory-utilisation notion (CPU), unless
#: --kv-cache-memory says otherwise.
DEFAULT_HOST_KV_CACHE_BYTES = 2 * 2**30


class DeviceMemory(Protocol):
    """The allocator calls a memory profile makes (``ModelRunnerProtocol.profile_peak_memory``);
    the ``torch.cuda`` module has them."""

    def synchronize(self) -> None:
        """Wait for the device's queued work."""

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak from what is allocated now."""

    def max_memory_allocated(self) -> int:
        """The peak of allocated bytes since the reset."""

    def empty_cache(self) -> None:
        """Give cached, unused memory back to the device."""


@runtime_checkable
class ModelRunnerProtocol(Protocol):
    """The model runner methods a worker may call (kvloom's ``ModelRunner`` has them).

    Set-up, in this order: ``load_model``; ``kv_cache_bytes_per_block`` (and, on devices
    with a memory budget, ``profile_peak_memory``) to size the cache;
    ``initialize_kv_cache``; ``dummy_forward`` to warm up and ``capture_cudagraphs`` where
    the device has graphs. Then per step ``execute_model`` and, for a step it returned
    None for, ``sample_tokens``."""

    max_num_tokens: int
    """The most tokens one step may hold (``max_num_batched_tokens``, at least ``max_num_seqs``)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None: ...

    def load_model(self) -> None:
        """Build the model on the device and load its weights (and LoRA slots when enabled)."""

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV-cache block takes over all attention layers."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's KV cache of ``num_blocks`` blocks."""

    def profile_peak_memory(self, memory: DeviceMemory) -> int:
        """Torch's peak allocated bytes over a forward at the largest batch the scheduler
        can produce plus a sampler pass (``memory``: ``torch.cuda`` on CUDA); runs before
        ``initialize_kv_cache``."""

    def capture_cudagraphs(self) -> None:
        """Capture the CUDA graphs the resolved ``cudagraph_mode`` asks for (none: it logs why)."""

    def dummy_forward(self, num_tokens: int, num_reqs: int | None = None) -> torch.Tensor:
        """A forward of ``num_tokens`` tokens over ``num_reqs`` requests that writes no KV."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Launch one step; None when its sampling waits for ``sample_tokens``."""

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        """Launch the sampling of the step ``execute_model`` returned None for."""

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter; ValueError without ``--enable-lora``."""

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if it was not loaded."""

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters."""


class WorkerBase(ABC):
    """Owns one device: loads the model, owns the KV cache, runs steps."""

    def __init__(
        self,
        config: EngineConfig,
        platform: type[Platform],
        *,
        model_runner_cls: type[ModelRunnerProtocol] | None = None,
    ) -> None:
        self.config = config
        self.platform = platform
        #: The model runner class this worker builds (handed in by the executor).
        self.model_runner_cls = model_runner_cls

    @abstractmethod
    def init_device(self) -> None:
        """Select and set up the device (threads, seeds, streams)."""

    @abstractmethod
    def load_model(self) -> None:
        """Build the model and load its weights onto the device."""

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """How many KV-cache blocks fit in the memory budget (after profiling)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache with ``num_blocks`` blocks per layer."""

    def compile_or_warm_up_model(self) -> None:
        """Warm up, and capture CUDA graphs where the platform supports them."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Launch one step: forward the scheduled tokens and sample. Returns without
        waiting for the device where it can. A step with
        ``scheduler_output.pending_structured_output_tokens`` (async scheduling) only runs
        its forward, keeps the logits and returns None: ``sample_tokens`` samples it.

        (Plugin API 1.0 returned a ``ModelRunnerOutput``; the engine still accepts one,
        with a deprecation warning, until 2.0.)"""

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        """Launch the sampling of the step whose ``execute_model`` returned None, the logits
        of its structured requests masked with ``grammar_output`` (None: no row). Needed
        for structured outputs under async scheduling; default: unsupported."""
        raise NotImplementedError(f"{type(self).__name__} does not support sampling a step after its forward "
                                  "(structured outputs with async scheduling)")  # fmt: skip

    @deprecated_method(Deprecation("WorkerBase.execute_model_async", "WorkerBase.execute_model", "2.0"))
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Deprecated since plugin API 1.1: ``execute_model`` launches."""
        return self.execute_model(scheduler_output)

    @deprecated_method(Deprecation("WorkerBase.sample_tokens_async", "WorkerBase.sample_tokens", "2.0"))
    def sample_tokens_async(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        """Deprecated since plugin API 1.1: ``sample_tokens`` launches."""
        return self.sample_tokens(grammar_output)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (``--enable-lora``); True if it was added. Default: unsupported."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA")

    def remove_lora(self, lora_id: int) -> bool:
        """Unload the adapter with ``lora_id``; True if it was loaded. Default: unsupported."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA")

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters. Default: none."""
        return set()

    def shutdown(self) -> None:
        """Release device resources."""


class Worker(WorkerBase):
    """kvloom's generic torch worker: runs on ``platform.device()`` through a model runner
    (``self.runner``, built by ``init_device`` from ``model_runner_cls``). Platforms
    subclass it and override ``init_device`` (device setup), ``kv_cache_budget_bytes``
    (the KV-cache memory budget) and ``compile_or_warm_up_model`` (e.g. CUDA-graph
    capture), driving the runner through ``ModelRunnerProtocol`` only.

    Threads: it leaves torch's thread settings alone, so the model runs with torch's
    defaults (intra-op threads: the cores torch sees, or ``OMP_NUM_THREADS``) in the
    process that runs the engine core. ``torch.set_num_threads`` is process-wide: a
    platform that wants another count calls it in ``init_device`` (kvloom's CPU worker does
    so from ``KVLOOM_CPU_THREADS``, else from the cores the process may use)."""

    def __init__(
        self,
        config: EngineConfig,
        platform: type[Platform],
        *,
        model_runner_cls: type[ModelRunnerProtocol] | None = None,
    ) -> None:
        super().__init__(config, platform, model_runner_cls=model_runner_cls)
        # Global rank r (pipeline stage r // tp, tensor-parallel rank r % tp) runs on
        # device r of this machine (a Ray actor on the one device Ray made visible to it:
        # parallel_state.device_index).
        self.device = platform.device(parallel_state.device_index())
        self.model_runner: ModelRunnerProtocol | None = None

    def init_device(self) -> None:
        """Seed torch with ``config.model.seed``, take the platform's tensor-parallel
        all-reduce (``parallel_state.init_tp_communicator``: collective, with TP > 1 only)
        and build the model runner on ``self.device``; torch's thread count is left as it
        is. A subclass sets its device up before calling it."""
        if self.model_runner_cls is None:
            raise RuntimeError(f"{type(self).__name__} was built without a model_runner_cls")
        torch.manual_seed(self.config.model.seed)
        parallel_state.init_tp_communicator(self.platform, self.device)
        self.model_runner = self.model_runner_cls(self.config, self.device)

    @property
    def runner(self) -> ModelRunnerProtocol:
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

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        return self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        return self.runner.sample_tokens(grammar_output)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the runner; ValueError without ``--enable-lora``."""
        return self.runner.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if it was not loaded."""
        return self.runner.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters."""
        return self.runner.list_loras()

    def shutdown(self) -> None:
        """Release the runner's resources (its KV connector), where it has a ``shutdown``."""
        runner_shutdown = getattr(self.model_runner, "shutdown", None)
        if runner_shutdown is not None:
            runner_shutdown()

