"""The contract between the engine core and its scheduler.

The engine core (``kvloom.engine.core.EngineCore``) owns one scheduler and drives it with
these calls, in this order within a step: ``schedule()`` picks what the next forward
computes, the executor runs it, and ``update_from_output()`` applies what came back and
returns the outputs for the front end. Between steps it adds new requests
(``add_request``, or ``reject_request`` for one it found unservable) and finishes others
(``finish_requests``: aborts and stop strings). ``kvloom.scheduler.scheduler.Scheduler``
(vLLM V1's continuous batching) is the implementation; its module docstring tells the
algorithm.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvloom.metrics.scheduler_stats import SchedulerStats
    from kvloom.outputs import EngineCoreOutputs, ModelRunnerOutput
    from kvloom.request import Request, RequestStatus
    from kvloom.scheduler.output import GrammarOutput, SchedulerOutput


class SchedulerInterface(ABC):
    """What the engine core calls on its scheduler (see the module docstring for the order)."""

    # ------------------------------------------------------------------ requests in

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request to be scheduled by a later ``schedule()``.

        Raises ``ValueError`` (naming the request) for one it can never serve; the engine
        core reports that to the request's client and goes on."""

    @abstractmethod
    def reject_request(self, request_id: str, message: str) -> None:
        """Refuse a request that never joined the queues: it is reported in the next
        ``EngineCoreOutputs`` as finished (``FinishReason.ABORT``) with ``error=message``."""

    @abstractmethod
    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests in any state, with a ``FINISHED_*`` status: aborted by the client,
        or stopped by a stop string the front end found after detokenizing.

        Unknown or already finished ids are ignored. Called between steps, never between a
        ``schedule()`` and its ``update_from_output()``."""

    # ------------------------------------------------------------------ the step

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide what the next forward pass computes: how many tokens of which requests
        (``num_scheduled_tokens``: a whole or chunked prompt, one decode token, drafts),
        within the token budget, the batch size and the KV cache, with the data the model
        runner needs to update its persistent copy of each request. Called once per step by
        the engine core's busy loop, also when nothing can be scheduled (the output then
        carries only the finished requests the runner must drop)."""

    @abstractmethod
    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The structured-output bitmask of a step scheduled with
        ``pending_structured_output_tokens`` (async scheduling), now that the tokens of the
        step before it are applied; None when no request of the step still needs a row."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply the model runner's results of a step ``schedule()`` returned: append the
        sampled tokens, apply the stop conditions, finish and free finished or failed
        requests, and return every request's new output (plus outputs produced since the
        last call: aborts, refusals) and, with stats on, the scheduler's stats."""

    # ------------------------------------------------------------------ state

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        """The number of requests waiting or running."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""

    @abstractmethod
    def has_requests(self) -> bool:
        """Whether a step has anything to do: unfinished requests, or finished ones whose
        ids or final outputs are not reported yet. The engine core steps while it is true."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats:
        """Queue sizes, KV-cache usage and the counters (prefix cache, preemptions,
        structured outputs) accumulated since the last call."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (nothing done) while requests hold blocks."""
