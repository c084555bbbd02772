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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvloom.distributed.communicator import allreduce_mode
from kvloom.distributed.parallel_state import output_rank
from kvloom.outputs import PendingModelRunnerOutput

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.lora.request import LoRARequest
    from kvloom.outputs import ModelRunnerOutput
    from kvloom.scheduler.output import GrammarOutput, SchedulerOutput


class Executor(ABC):
    """Runs ``WorkerBase`` methods on every rank; step results come from the output rank."""

    output_rank: int = 0
    """The rank whose step results the engine uses (``DistributedExecutor``: the last
    pipeline stage's tensor-parallel rank 0)."""

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
        """One step on every rank; the output rank's output. None for a step with
        ``pending_structured_output_tokens``: the ranks ran its forward, ``sample_tokens``
        samples it."""
        return self.collective_rpc("execute_model", (scheduler_output,))[self.output_rank]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Launch one step (async scheduling); None where ``execute_model`` returns None.
        Default: run it to completion."""
        output = self.execute_model(scheduler_output)
        return None if output is None else PendingModelRunnerOutput.done(output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample, on every rank, the step launched without sampling, its structured
        requests' logits masked with ``grammar_output``; the output rank's output."""
        return self.collective_rpc("sample_tokens", (grammar_output,))[self.output_rank]

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


#: Waits for one call's results on every rank (rank order); raises ``WorkerRankError``
#: naming a rank that raised or died.
Results = Callable[[], list[Any]]


class DistributedExecutor(Executor):
    """An executor of ``world_size`` ranks that sends every call to all of them
    (``MultiprocExecutor``, ``RayDistributedExecutor``). A subclass supplies ``launch``;
    the steps then run without blocking the engine core: ``execute_model_async`` launches a
    step and returns, and the output rank's result is read on ``get_output()``."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        parallel = config.parallel
        if parallel.tensor_parallel_size > 1:
            allreduce_mode()  # a bad KVLOOM_ALLREDUCE fails here, before any rank starts
        self.world_size = parallel.world_size
        self.output_rank = output_rank(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        # The forward of a step launched without sampling (structured outputs under async
        # scheduling): its results are read when its sampling's are.
        self._unsampled: Results | None = None

    @abstractmethod
    def launch(self, method: str, args: tuple[Any, ...]) -> Results:
        """Send ``method(*args)`` to every rank without waiting; what waits for the results."""

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self.launch(method, args)()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Launch the step on every rank and return (async scheduling, and the engine core's
        batch queue under pipeline parallelism). A step with
        ``pending_structured_output_tokens`` returns None: the ranks run its forward and
        wait for ``sample_tokens_async``, a second call."""
        results = self.launch("execute_model", (scheduler_output,))
        if scheduler_output.pending_structured_output_tokens:
            self._unsampled = results
            return None
        return _LaunchedStep([results], self.output_rank)

    def sample_tokens_async(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        """Launch the sampling of the step launched without sampling, its structured
        requests' logits masked with ``grammar_output``; returns like ``execute_model_async``."""
        forward, self._unsampled = self._unsampled, None
        if forward is None:
            raise RuntimeError("sample_tokens_async() without a step launched with pending_structured_output_tokens")
        return _LaunchedStep([forward, self.launch("sample_tokens", (grammar_output,))], self.output_rank)


class _LaunchedStep(PendingModelRunnerOutput):
    """A step launched on every rank: ``get_output()`` waits for each call's results in
    order (a step sampled by a second call: its forward's first, so a rank that failed
    there is reported) and returns the output rank's result of the last."""

    def __init__(self, calls: list[Results], rank: int) -> None:
        self._calls = calls
        self._rank = rank
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            for wait in self._calls:
                results = wait()
            self._calls = []  # read: what the calls hold (e.g. Ray object refs) may be freed
            self._output = results[self._rank]
        return self._output
