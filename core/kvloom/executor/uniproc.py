"""One worker in the engine core's process: tensor-parallel size 1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvloom.executor.abstract import Executor, as_pending, make_worker

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.outputs import PendingModelRunnerOutput
    from kvloom.scheduler.output import GrammarOutput, SchedulerOutput


class UniProcExecutor(Executor):
    """Calls the platform's worker directly (no process, no collective, no copy)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.driver_worker = make_worker(config)
        self.driver_worker.init_device()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingModelRunnerOutput | None:
        return as_pending(self.driver_worker.execute_model(scheduler_output))

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingModelRunnerOutput:
        return as_pending(self.driver_worker.sample_tokens(grammar_output))  # type: ignore[return-value]

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
