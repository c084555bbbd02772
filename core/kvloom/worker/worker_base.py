"""The worker contract: what the engine core asks of the device-side process.

A platform names its worker class (``Platform.get_worker_cls``). kvloom's generic
``kvloom.worker.worker.Worker`` runs any torch device and is what the CPU and CUDA
platforms build on; an out-of-tree platform may subclass it or implement this ABC.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from kvloom.outputs import PendingModelRunnerOutput

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.lora.request import LoRARequest
    from kvloom.outputs import ModelRunnerOutput
    from kvloom.platforms.interface import Platform
    from kvloom.scheduler.output import GrammarOutput, SchedulerOutput


class WorkerBase(ABC):
    """Owns one device: loads the model, owns the KV cache, runs steps."""

    def __init__(self, config: "EngineConfig", platform: type["Platform"]) -> None:
        self.config = config
        self.platform = platform

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
    def execute_model(self, scheduler_output: "SchedulerOutput") -> "ModelRunnerOutput | None":
        """Run one step: forward the scheduled tokens and sample. A step with
        ``scheduler_output.pending_structured_output_tokens`` (async scheduling) only runs
        its forward, keeps the logits and returns None: ``sample_tokens`` samples it."""

    def execute_model_async(self, scheduler_output: "SchedulerOutput") -> "PendingModelRunnerOutput | None":
        """Launch one step and return without waiting for its results (async scheduling);
        None where ``execute_model`` returns None (the sampling waits for ``sample_tokens``).

        The default runs the step to completion; workers whose device runs asynchronously
        override it so that the engine core can schedule the next step meanwhile.
        """
        output = self.execute_model(scheduler_output)
        return None if output is None else PendingModelRunnerOutput.done(output)

    def sample_tokens(self, grammar_output: "GrammarOutput | None") -> "ModelRunnerOutput":
        """Sample the step whose ``execute_model`` returned None, the logits of its
        structured requests masked with ``grammar_output`` (None: no row), and return its
        results. Needed for structured outputs under async scheduling; default: unsupported."""
        raise NotImplementedError(f"{type(self).__name__} does not support sampling a step after its forward "
                                  "(structured outputs with async scheduling)")  # fmt: skip

    def sample_tokens_async(self, grammar_output: "GrammarOutput | None") -> "PendingModelRunnerOutput":
        """``sample_tokens`` without waiting for the results. Default: runs to completion."""
        return PendingModelRunnerOutput.done(self.sample_tokens(grammar_output))

    def add_lora(self, lora_request: "LoRARequest") -> bool:
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
