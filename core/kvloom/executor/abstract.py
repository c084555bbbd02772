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

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvloom.deprecation import Deprecation
from kvloom.distributed.communicator import allreduce_mode
from kvloom.distributed.parallel_state import output_rank
from kvloom.outputs import ModelRunnerOutput, PendingModelRunnerOutput
from kvloom.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.lora.request import LoRARequest
    from kvloom.platforms.worker import WorkerBase
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

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Launch one step on every rank; the output rank's pending output. None for a
        step with ``pending_structured_output_tokens``: the ranks run its forward,
        ``sample_tokens`` samples it. Default: run it to completion."""
        output = self.collective_rpc("execute_model", (scheduler_output,))[self.output_rank]
        return None if output is None else PendingModelRunnerOutput.done(output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        """Sample, on every rank, the step launched without sampling, its structured
        requests' logits masked with ``grammar_output``. Default: run it to completion."""
        return PendingModelRunnerOutput.done(self.collective_rpc("sample_tokens", (grammar_output,))[self.output_rank])

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
    the steps then run without blocking the engine core: ``execute_model`` launches a
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

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        """Launch the step on every rank and return (async scheduling, and the engine core's
        batch queue under pipeline parallelism). A step with
        ``pending_structured_output_tokens`` returns None: the ranks run its forward and
        wait for ``sample_tokens``, a second call."""
        results = self.launch("execute_model", (scheduler_output,))
        if scheduler_output.pending_structured_output_tokens:
            self._unsampled = results
            return None
        return _LaunchedStep([results], self.output_rank)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        """Launch the sampling of the step launched without sampling, its structured
        requests' logits masked with ``grammar_output``; returns like ``execute_model``."""
        forward, self._unsampled = self._unsampled, None
        if forward is None:
            raise RuntimeError("sample_tokens() without a step launched with pending_structured_output_tokens")
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


#: Worker methods that return a step (a ``PendingModelRunnerOutput``); only the output
#: rank's result goes back to the engine core.
STEP_METHODS = frozenset({"execute_model", "sample_tokens"})


def make_worker(config: EngineConfig) -> WorkerBase:
    """The platform's worker for ``config``, handed kvloom's model runner class. A worker
    class written for plugin API 1.0 whose ``__init__`` takes no ``model_runner_cls`` gets
    it as an attribute instead (deprecated: goes in 2.0)."""
    platform = config.device.platform
    worker_cls = platform.get_worker_cls()
    params = inspect.signature(worker_cls.__init__).parameters
    if "model_runner_cls" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return worker_cls(config, platform, model_runner_cls=ModelRunner)
    Deprecation(f"{worker_cls.__qualname__}.__init__ without model_runner_cls",
                "__init__(config, platform, *, model_runner_cls=None)", "2.0").warn()
    worker = worker_cls(config, platform)
    worker.model_runner_cls = ModelRunner
    return worker


def call_worker(worker: WorkerBase, method: str, args: tuple[Any, ...]) -> Any:
    """Run ``worker.method(*args)`` for a caller in another process: a step's pending
    output is waited for here (the result crosses the process boundary). A worker
    written for plugin API 1.0 may still return a finished ``ModelRunnerOutput``."""
    result = getattr(worker, method)(*args)
    if isinstance(result, PendingModelRunnerOutput):
        return result.get_output()
    return result


def as_pending(result: PendingModelRunnerOutput | ModelRunnerOutput | None) -> PendingModelRunnerOutput | None:
    """A step from a worker in this process. Plugin API 1.0's workers returned a finished
    ``ModelRunnerOutput`` from ``execute_model`` / ``sample_tokens``: still accepted,
    with a deprecation warning, until 2.0."""
    if result is None or isinstance(result, PendingModelRunnerOutput):
        return result
    Deprecation("a worker step returning ModelRunnerOutput", "a PendingModelRunnerOutput "
                "(PendingModelRunnerOutput.done(output) for a finished step)", "2.0").warn()
    return PendingModelRunnerOutput.done(result)
