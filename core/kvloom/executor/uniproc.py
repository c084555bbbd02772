"""One worker in the engine core's process: tensor-parallel size 1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvloom.executor.abstract import Executor
from kvloom.outputs import PendingModelRunnerOutput

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.outputs import ModelRunnerOutput
    from kvloom.scheduler.output import GrammarOutput, SchedulerOutput


class UniProcExecutor(Executor):
    """Calls the platform's worker directly (no process, no collective, no copy)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        platform = config.device.platform
        self.driver_worker = platform.get_worker_cls()(config, platform)
        self.driver_worker.init_device()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args)]

    # The hot path calls the worker without building argument tuples and lists.
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.driver_worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        return self.driver_worker.execute_model_async(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.driver_worker.sample_tokens(grammar_output)

    def sample_tokens_async(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        return self.driver_worker.sample_tokens_async(grammar_output)

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
