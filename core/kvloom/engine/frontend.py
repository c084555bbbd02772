"""The front-end half shared by ``LLMEngine`` and ``AsyncLLM``.

It owns the tokenizer, turns prompts into ``EngineCoreRequest``s (fanning out n > 1 into
child requests), turns ``EngineCoreOutputs`` into ``RequestOutput``s, computes the
front-end stats (vLLM's interval metrics: TTFT, inter-token latency, end-to-end latency)
and feeds the stat loggers. It never runs the model: the engines decide where the core
runs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvloom.config import EngineConfig
from kvloom.engine.input_processor import InputProcessor
from kvloom.engine.output_processor import OutputProcessor, OutputQueue
from kvloom.engine.parallel_sampling import ParentRequest
from kvloom.inputs import RequestInput
from kvloom.loader.tokenizer import get_tokenizer
from kvloom.metrics.loggers import build_stat_loggers
from kvloom.metrics.stats import IterationStats
from kvloom.outputs import EngineCoreOutputs, PoolingRequestOutput, RequestOutput
from kvloom.request import EngineCoreRequest

logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig) -> Any | None:
    if config.model.skip_tokenizer_init:
        return None

    return get_tokenizer(config.model)


class Frontend:
    def __init__(self, config: EngineConfig, log_stats: bool) -> None:
        self.config = config
        self.log_stats = log_stats
        self.tokenizer = load_tokenizer(config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers: list[Any] = []
        self._last_log = time.monotonic()
        self._stats_closed = False

    # ------------------------------------------------------------------ stats
    def start_stat_loggers(self, stat_loggers: list[Any] | None) -> None:
        """Build the stat loggers (logging, the given factories, plugins) once the engine
        is up. ``stat_loggers`` are factories called as ``(config, engine_index)``."""
        if not self.log_stats:
            return

        self.stat_loggers = build_stat_loggers(self.config, custom_factories=stat_loggers)
        for stat_logger in self.stat_loggers:
            stat_logger.log_engine_initialized()

    def maybe_log_stats(self, now: float) -> None:
        """``log()`` of every stat logger if ``log_stats_interval`` seconds have passed since
        the last time (or since the front end was built). ``LLMEngine`` calls it after each
        step, once that step's ``record()`` calls are done. A ``log()`` that raises is
        logged; the step and the other loggers go on."""
        if self.stat_loggers and not self._stats_closed and (
            now - self._last_log >= self.config.observability.log_stats_interval
        ):
            self._last_log = now
            self._log_all("")

    def log_stats_at_shutdown(self) -> None:
        """The last ``log()`` of every stat logger, when the engine shuts down (after its
        last step's ``record()``), so no step goes unpublished. Runs once; later calls, and
        ``maybe_log_stats``, do nothing. A ``log()`` that raises is logged and the other
        loggers still run: shutdown goes on."""
        if self._stats_closed:
            return
        self._stats_closed = True
        self._log_all(" at shutdown")

    def _log_all(self, when: str) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.log()
            except Exception:
                logger.exception("Stat logger %s failed in log()%s", type(stat_logger).__qualname__, when)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: RequestInput, queue: OutputQueue | None = None) -> list[EngineCoreRequest]:
        """Validate, tokenize and register a request; returns what to send to the core.
        With ``queue``, the request's outputs (for n > 1 the parent's) go there instead of
        being returned by ``process`` (see ``OutputProcessor``)."""
        op = self.output_processor
        request_id = request.request_id
        if request_id in op.request_states or request_id in op.parent_requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        core_request, text = self.input_processor.process(request)
        sampling = core_request.sampling_params
        if sampling is None or sampling.n == 1:
            op.add_request(core_request, text, queue=queue)
            return [core_request]
        parent = ParentRequest(core_request)
        children = []
        for index, child in parent.child_requests():
            op.add_request(child, text, parent=parent, index=index, queue=queue)
            children.append(child)
        return children

    def abort(self, request_ids: list[str]) -> list[str]:
        """Forget requests (a parent id stands for its children); returns the engine-core
        ids to abort. Each request aborted here counts as finished with reason "abort" in
        the stats (the core's own abort output finds it gone and is not counted again)."""
        iteration_stats = IterationStats() if self.log_stats else None
        core_ids = self.output_processor.abort_requests(request_ids, iteration_stats)
        if core_ids and iteration_stats is not None:
            self._record(None, iteration_stats)
        return core_ids

    def propagate_error(self, error: BaseException) -> None:
        """The engine died: every request with a queue gets ``error``."""
        self.output_processor.propagate_error(error)

    def process(self, core_outputs: EngineCoreOutputs) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """One step's outputs: (outputs of requests without a queue, ids to abort in the
        core). Outputs of requests with a queue are put there."""
        iteration_stats = IterationStats() if self.log_stats else None
        processed = self.output_processor.process_outputs(
            core_outputs.outputs, core_outputs.timestamp, iteration_stats
        )
        self._record(core_outputs.scheduler_stats, iteration_stats, core_outputs.engine_index)
        return processed.request_outputs, processed.reqs_to_abort

    def _record(self, scheduler_stats: Any, iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats, engine_idx)
            except Exception:  # a stat logger's failure must not stop the engine's outputs
                logger.exception("Stat logger %s failed in record()", type(stat_logger).__qualname__)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()
