"""The executor contract: how the engine core drives its worker(s).

The engine core asks an executor, never a worker, to load the model, size and allocate
the KV cache and run steps. ``UniProcExecutor`` holds one worker in the engine core's own
process (tensor-parallel size 1, what kvloom always did); ``MultiprocExecutor`` runs one
worker process per rank (``--distributed-executor-backend mp``; tensor-parallel size x
pipeline-parallel size ranks) and ``RayDistributedExecutor`` as many Ray actors
(``--distributed-executor-backend ray``). A step's output comes from the output rank: the last
pipeline stage's tensor-parallel rank 0 (rank 0 without pipeline parallelism).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from kvloom.outputs import PendingModelRunnerOutput

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.lora.request import LoRARequest
    from kvloom.outputs import ModelRunnerOutput
    from kvloom.scheduler.output import GrammarOutput, SchedulerOutput


class Executor(ABC):
    """Runs ``WorkerBase`` methods on every rank; step results come from the output rank
    (rank 0 here; distributed executors override the step methods with theirs)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call ``method(*args)`` on every rank's worker; the results in rank order.
        A rank that raises or dies raises here, naming the rank."""

    def load_model(self) -> None:
        self.collective_rpc("load_model")

    def determine_num_kv_blocks(self) -> int:
        """The KV blocks every rank can hold: the smallest count (ranks allocate alike)."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def compile_or_warm_up_model(self) -> None:
        self.collective_rpc("compile_or_warm_up_model")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step on every rank; the driver's output. None for a step with
        ``pending_structured_output_tokens``: the ranks ran its forward, ``sample_tokens``
        samples it."""
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Launch one step (async scheduling); None where ``execute_model`` returns None.
        Default: run it to completion."""
        output = self.execute_model(scheduler_output)
        return None if output is None else PendingModelRunnerOutput.done(output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample, on every rank, the step launched without sampling, its structured
        requests' logits masked with ``grammar_output``; the driver's output."""
        return self.collective_rpc("sample_tokens", (grammar_output,))[0]

    def sample_tokens_async(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        """``sample_tokens`` without waiting for the results. Default: run it to completion."""
        return PendingModelRunnerOutput.done(self.sample_tokens(grammar_output))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.collective_rpc("add_lora", (lora_request,))[0]

    def remove_lora(self, lora_id: int) -> bool:
        return self.collective_rpc("remove_lora", (lora_id,))[0]

    def list_loras(self) -> set[int]:
        return self.collective_rpc("list_loras")[0]

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers (and their processes); idempotent."""
