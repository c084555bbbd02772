"""The front end's per-request state: engine-core outputs in, user-facing outputs out.

For every running request the ``OutputProcessor`` keeps the prompt, the sampling
parameters, an incremental detokenizer, the logprobs received so far and the timing
stats. ``process_outputs`` turns one step's ``EngineCoreOutput``s into ``RequestOutput``s
(or ``PoolingRequestOutput``s) according to each request's ``output_kind``:

* CUMULATIVE: every output carries all text / tokens / logprobs so far;
* DELTA: every output carries only what is new since the previous one (streaming);
* FINAL_ONLY: one output, when the request finishes.

Stop strings are detected here (the core cannot see text): such a request finishes with
``finish_reason="stop"`` and ``stop_reason`` = the string, and its id is returned in
``reqs_to_abort`` so the caller aborts it in the engine core.

Streaming hook: ``add_request(..., queue=q)`` routes a request's outputs to ``q`` (an
``OutputQueue``: a non-blocking ``put``) instead of returning them from
``process_outputs``; for n > 1 the parent's merged outputs go there. Its last output has
``finished=True``; ``abort_requests`` puts a final aborted output so a waiting consumer
wakes up, and ``propagate_error`` puts an exception into every queue (the engine died).
``AsyncLLM`` gives each request a ``RequestOutputCollector`` (vLLM's design), so the
engine's outputs reach ``generate()`` without any routing table of its own; ``LLMEngine``
gives none and takes the returned outputs.

Per-request errors: an output that ends a request with an ``error`` (the core refused it,
or its own work failed in a step) finishes it as usual and then puts
``RequestRejectedError`` / ``RequestFailedError`` into its queue. A failure while
processing one request's output here (detokenizing, logprobs) fails that request alone
the same way, and asks the core to abort it (``reqs_to_abort``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvloom.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from kvloom.engine.errors import RequestFailedError, RequestRejectedError
from kvloom.engine.logprobs import LogprobsAccumulator, TokenDecoder
from kvloom.engine.parallel_sampling import ParentRequest
from kvloom.metrics.stats import IterationStats, RequestStateStats
from kvloom.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from kvloom.request import EngineCoreEventType, EngineCoreRequest, FinishReason
from kvloom.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

AnyRequestOutput = RequestOutput | PoolingRequestOutput


class OutputQueue(Protocol):
    """Where a request's outputs go (see the module docstring); ``put`` must not block.
    An exception put here means the engine died."""

    def put(self, output: AnyRequestOutput | BaseException) -> None: ...


class RequestOutputCollector:
    """One ``generate()``/``encode()`` call's mailbox (vLLM's class of the same name): the
    output handler ``put``s, the caller awaits ``get``.

    It holds at most one output. When the caller falls behind the engine, a newer output
    is merged into the waiting one instead of queueing behind it, so a slow consumer
    catches up in one read: DELTA outputs are concatenated per sequence
    (``CompletionOutput.index``); for the other kinds the newer output already carries
    everything and replaces the older. An exception (the engine died) wins over any
    output and is raised by ``get``.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self._output: AnyRequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: AnyRequestOutput | BaseException) -> None:
        held = self._output
        if held is None or isinstance(output, BaseException):
            self._output = output
            self._ready.set()
        elif isinstance(held, BaseException):
            return  # the error stands
        elif self.aggregate and isinstance(held, RequestOutput) and isinstance(output, RequestOutput):
            self._output = merge_delta_outputs(held, output)
        else:
            self._output = output

    async def get(self) -> AnyRequestOutput:
        while self._output is None:
            await self._ready.wait()
        output, self._output = self._output, None
        self._ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


class RequestOutputStream:
    """The outputs of one admitted request, as an async iterator (``AsyncLLM.add_request``).

    The request is in the engine already when the stream exists, so bad input was an
    exception at admission, before anything was sent to a client. ``__anext__`` returns
    the request's outputs until the finished one. Errors: ``RequestRejectedError`` /
    ``RequestFailedError`` (this request ended in the engine with an error) are raised as
    they are; any other exception in the collector (the engine died) is raised as
    ``engine_error(exc)``. Leaving early (``aclose()``, a cancelled or failed read) calls
    ``abort(request_id)`` once, which aborts what is left of the request (every sequence
    of an n > 1 request); a stream that ended normally aborts nothing.
    """

    def __init__(self, request_id: str, collector: RequestOutputCollector, abort: Callable[[str], None],
                 engine_error: Callable[[BaseException], BaseException]) -> None:  # fmt: skip
        self.request_id = request_id
        self._collector = collector
        self._abort = abort
        self._engine_error = engine_error
        self._done = False

    def __aiter__(self) -> "RequestOutputStream":
        return self

    async def __anext__(self) -> AnyRequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._collector.get()
        except (RequestRejectedError, RequestFailedError):
            self._close()
            raise
        except Exception as exc:  # put there by propagate_error: the engine died
            self._close()
            raise self._engine_error(exc) from exc
        except BaseException:  # cancelled: the caller went away
            self._close()
            raise
        if output.finished:
            self._done = True
        return output

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self.request_id)


def merge_delta_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Two successive DELTA outputs of one request as one: per sequence, text, token ids
    and logprobs are concatenated, and the newer finish reason, stop reason and cumulative
    logprob hold. Prompt logprobs (delivered in pieces) are concatenated too. The inputs
    are not modified."""
    merged = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        prev = merged.get(c.index)
        if prev is not None:
            logprobs = c.logprobs
            if prev.logprobs is not None and c.logprobs is not None:
                logprobs = [*prev.logprobs, *c.logprobs]
            # Built field by field: dataclasses.replace costs ~10x more, and a server whose
            # clients fall behind merges once per sequence per step.
            c = CompletionOutput(c.index, prev.text + c.text, prev.token_ids + c.token_ids, c.cumulative_logprob,
                                 logprobs, c.finish_reason, c.stop_reason, c.lora_request)  # fmt: skip
        merged[c.index] = c
    prompt_logprobs = older.prompt_logprobs
    if newer.prompt_logprobs:
        prompt_logprobs = [*(prompt_logprobs or []), *newer.prompt_logprobs]
    return RequestOutput(newer.request_id, newer.prompt, newer.prompt_token_ids, prompt_logprobs,
                         [merged[i] for i in sorted(merged)],
                         newer.finished, newer.num_cached_tokens, newer.metrics, newer.lora_request,
                         newer.kv_transfer_params or older.kv_transfer_params)  # fmt: skip


@dataclass
class OutputProcessorOutput:
    #: Outputs of requests that have no queue, in the order of the step's outputs.
    request_outputs: list[AnyRequestOutput] = field(default_factory=list)
    #: Requests finished here (stop strings) that the engine core must abort.
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestState:
    """Everything the front end tracks for one engine-core request."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: Tokenizer | None,
        token_decoder: TokenDecoder,
        parent: ParentRequest | None,
        index: int,
        queue: OutputQueue | None,
    ) -> None:
        self.request_id = request.request_id
        self.request = request
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.parent = parent
        self.index = index
        self.queue = queue
        self.params = request.sampling_params
        self.is_pooling = self.params is None
        self.output_kind = self.params.output_kind if self.params is not None else RequestOutputKind.FINAL_ONLY
        self.detokenizer: IncrementalDetokenizer | None = None
        self.logprobs: LogprobsAccumulator | None = None
        if self.params is not None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, self.params)
            self.logprobs = LogprobsAccumulator(token_decoder, self.params.logprobs, self.params.prompt_logprobs)
        self.stats = RequestStateStats(arrival_time=request.arrival_time)
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.is_prefilling = True
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None  # the KV connector's, with the final output
        self._num_tokens_sent = 0
        self._num_logprobs_sent = 0

    @property
    def delta(self) -> bool:
        return self.output_kind == RequestOutputKind.DELTA

    def make_completion_output(self, finish_reason: FinishReason | None, stop_reason: int | str | None) -> CompletionOutput | None:
        """This request's CompletionOutput for the step, or None when nothing is due
        (FINAL_ONLY before the end)."""
        assert self.detokenizer is not None and self.logprobs is not None
        finished = finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        detok = self.detokenizer
        text = detok.get_next_output_text(finished, self.delta)
        logprobs = self.logprobs.logprobs
        if self.delta:
            token_ids = detok.token_ids[self._num_tokens_sent :]
            if logprobs is not None:
                logprobs = logprobs[self._num_logprobs_sent :]
        else:
            token_ids = list(detok.token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        self._num_tokens_sent = len(detok.token_ids)
        self._num_logprobs_sent = len(self.logprobs.logprobs or [])
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.logprobs.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason.value if finish_reason is not None else None,
            stop_reason=stop_reason,
            lora_request=self.request.lora_request,
        )

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        return self.logprobs.take_prompt_logprobs(self.delta) if self.logprobs is not None else None

    def metrics_snapshot(self) -> RequestMetrics:
        m = self.metrics  # built field by field: a fifth of dataclasses.replace's cost, once per output
        return RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                              m.finished_time)  # fmt: skip


class OutputProcessor:
    """Front-end request states; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._token_decoder = TokenDecoder(tokenizer)

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: OutputQueue | None = None,
    ) -> None:
        """Track a request sent to the core. For n > 1, call once per child (from
        ``parent.child_requests()``) with its parent and index; the parent's outputs go to
        ``queue`` (given with any child) when one is set."""
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if parent is not None:
            if not 0 <= index < parent.n:
                raise ValueError(f"index: {index} is outside 0..{parent.n - 1} for parent request {parent.request_id!r}")
            if queue is not None:
                parent.queue = queue
            queue = None  # outputs are the parent's
            self.parent_requests[parent.request_id] = parent
        self.request_states[request_id] = RequestState(
            request, prompt, self.tokenizer, self._token_decoder, parent, index, queue
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def propagate_error(self, error: BaseException) -> None:
        """Put ``error`` into every running request's queue, once per queue: the engine
        died, and whoever waits on a request must wake up and fail."""
        queues: dict[int, OutputQueue] = {}
        for state in self.request_states.values():
            queue = state.parent.queue if state.parent is not None else state.queue
            if queue is not None:
                queues[id(queue)] = queue
        for queue in queues.values():
            queue.put(error)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def abort_requests(self, request_ids: Iterable[str], iteration_stats: IterationStats | None = None) -> list[str]:
        """Forget requests (a parent id stands for all its children). Returns the engine-core
        request ids that were running, for the caller to abort in the core. Requests with a
        queue get a final output with finish_reason "abort"; with ``iteration_stats`` their
        finished-request stats are recorded too."""
        core_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            if parent is not None:
                core_ids.extend(s.request_id for s in self.request_states.values() if s.parent is parent)
            elif request_id in self.request_states:
                core_ids.append(request_id)
        if not core_ids:
            return []
        aborted = [EngineCoreOutput(request_id=i, new_token_ids=[], finish_reason=FinishReason.ABORT) for i in core_ids]
        # Finishing them the ordinary way feeds the queues and the parents; outputs of
        # requests without a queue are dropped (the caller asked for the abort).
        self.process_outputs(aborted, engine_core_timestamp=time.monotonic(), iteration_stats=iteration_stats)
        return core_ids

    # ----------------------------------------------------------------- outputs

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        engine_core_timestamp: float,
        iteration_stats: IterationStats | None,
    ) -> OutputProcessorOutput:
        """Process one step's outputs. ``engine_core_timestamp`` is
        ``EngineCoreOutputs.timestamp`` (the core's monotonic clock); ``iteration_stats``
        (None when stats are off) is updated in place."""
        result = OutputProcessorOutput()
        now = iteration_stats.iteration_timestamp if iteration_stats is not None else time.time()
        # Emission slots in step order: a ready output, or a parent resolved at the end.
        slots: list[AnyRequestOutput | ParentRequest] = []
        touched_parents: set[str] = set()

        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted in the front end already
            try:
                self._process_output(state, output, engine_core_timestamp, now, iteration_stats, result, slots,
                                     touched_parents)  # fmt: skip
            except Exception as exc:  # this request's processing failed: it fails, the others go on
                logger.exception("Processing the output of request %s failed", state.request_id)
                message = f"processing its output failed ({type(exc).__name__}: {exc})"
                if output.finish_reason is None:
                    result.reqs_to_abort.append(state.request_id)
                self._fail(state, RequestFailedError(state.request_id, message), iteration_stats, touched_parents,
                           slots)  # fmt: skip

        for slot in slots:
            if isinstance(slot, ParentRequest):
                parent_output = slot.make_request_output(slot.request.prompt_token_ids)
                if parent_output is None:
                    continue
                if slot.queue is not None:
                    slot.queue.put(parent_output)
                else:
                    result.request_outputs.append(parent_output)
                if parent_output.finished:
                    self.parent_requests.pop(slot.request_id, None)
                    if iteration_stats is not None:
                        iteration_stats.update_from_finished_user_request(slot.n, slot.max_num_generation_tokens)
            else:
                result.request_outputs.append(slot)
        return result

    # ----------------------------------------------------------------- helpers

    def _process_output(
        self,
        state: RequestState,
        output: EngineCoreOutput,
        engine_core_timestamp: float,
        now: float,
        iteration_stats: IterationStats | None,
        result: OutputProcessorOutput,
        slots: list[AnyRequestOutput | ParentRequest],
        touched_parents: set[str],
    ) -> None:
        """One request's output of the step (see ``process_outputs``)."""
        finish_reason = output.finish_reason
        stop_reason = output.stop_reason
        produced = bool(output.new_token_ids) or output.pooling_output is not None

        if iteration_stats is not None:
            iteration_stats.update_from_output(
                output, engine_core_timestamp, state.is_prefilling, len(state.prompt_token_ids), state.stats
            )
        self._update_metrics(state, output, engine_core_timestamp, now, produced)
        if produced:
            state.is_prefilling = False
        if output.num_cached_tokens:
            state.num_cached_tokens = output.num_cached_tokens
        if output.kv_transfer_params is not None:
            state.kv_transfer_params = output.kv_transfer_params

        if state.is_pooling:
            request_output: AnyRequestOutput | None = None
            if output.pooling_output is not None:
                state.metrics.finished_time = now
                request_output = PoolingRequestOutput(
                    request_id=state.request_id,
                    outputs=PoolingOutput(data=output.pooling_output),
                    prompt_token_ids=state.prompt_token_ids,
                    finished=True,
                )
                finish_reason = finish_reason or FinishReason.STOP
        else:
            assert state.detokenizer is not None and state.logprobs is not None
            num_before = state.detokenizer.num_output_tokens
            stop_string = state.detokenizer.update(output.new_token_ids, finish_reason == FinishReason.STOP)
            num_kept = state.detokenizer.num_output_tokens - num_before
            if stop_string is not None:
                # The stop string came first, even if the core also finished the
                # request later in this step (a stop token, max_tokens).
                if finish_reason is None:
                    result.reqs_to_abort.append(state.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_string
            if output.new_logprobs:
                state.logprobs.add_sample_logprobs(output.new_logprobs[:num_kept])
            if output.new_prompt_logprobs:
                state.logprobs.add_prompt_logprobs(output.new_prompt_logprobs)
            if not produced and finish_reason is None:
                return  # e.g. a prompt-logprobs chunk of a chunked prefill: nothing to show yet
            if finish_reason is not None:
                state.metrics.finished_time = now
            request_output = self._make_output(state, finish_reason, stop_reason, touched_parents, slots)

        if request_output is not None:
            if state.queue is not None:
                state.queue.put(request_output)
            else:
                slots.append(request_output)

        if finish_reason is not None:
            self._finish(state, finish_reason, iteration_stats)

        if output.error is not None:  # it ended in the engine without a result: its caller learns why
            error: Exception = (
                RequestRejectedError(state.request_id, output.error)
                if finish_reason == FinishReason.ABORT
                else RequestFailedError(state.request_id, output.error)
            )
            queue = state.parent.queue if state.parent is not None else state.queue
            if queue is not None:
                queue.put(error)

    def _fail(
        self,
        state: RequestState,
        error: Exception,
        iteration_stats: IterationStats | None,
        touched_parents: set[str],
        slots: list[AnyRequestOutput | ParentRequest],
    ) -> None:
        """Finish ``state`` with ``error`` (put into its queue) after its processing failed."""
        parent = state.parent
        if parent is not None:
            parent.record_child_output(state.index, None, True, 0, state.metrics_snapshot(), state.prompt, None, 0)
            if parent.request_id not in touched_parents:
                touched_parents.add(parent.request_id)
                slots.append(parent)
        queue = parent.queue if parent is not None else state.queue
        if queue is not None:
            queue.put(error)
        if state.request_id in self.request_states:
            self._finish(state, FinishReason.ERROR, iteration_stats)


    def _make_output(
        self,
        state: RequestState,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        touched_parents: set[str],
        slots: list[AnyRequestOutput | ParentRequest],
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        completion = state.make_completion_output(finish_reason, stop_reason)
        parent = state.parent
        if parent is not None:
            parent.record_child_output(
                state.index,
                completion,
                finished,
                state.detokenizer.num_output_tokens if state.detokenizer else 0,
                state.metrics_snapshot(),
                state.prompt,
                state.take_prompt_logprobs() if state.index == 0 else None,
                state.num_cached_tokens,
            )
            if parent.request_id not in touched_parents:
                touched_parents.add(parent.request_id)
                slots.append(parent)
            return None
        if completion is None:
            return None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.take_prompt_logprobs(),
            outputs=[completion],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics_snapshot(),
            lora_request=state.request.lora_request,
            kv_transfer_params=state.kv_transfer_params,
        )

    @staticmethod
    def _update_metrics(state: RequestState, output: EngineCoreOutput, core_ts: float, now: float, produced: bool) -> None:
        """Wall-clock RequestMetrics. The core's SCHEDULED time is on its monotonic clock:
        it is mapped to wall clock by its age relative to the step's timestamp."""
        m = state.metrics
        if m.first_scheduled_time is None and output.events:
            for event in output.events:
                if event.type == EngineCoreEventType.SCHEDULED:
                    m.first_scheduled_time = now - max(core_ts - event.timestamp, 0.0)
                    break
        if produced:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now

    def _finish(self, state: RequestState, finish_reason: FinishReason, iteration_stats: IterationStats | None) -> None:
        self.request_states.pop(state.request_id, None)
        if iteration_stats is None:
            return
        params = state.params
        iteration_stats.update_from_finished_request(
            finish_reason,
            len(state.prompt_token_ids),
            params.max_tokens if params is not None else None,
            state.stats,
            state.num_cached_tokens,
        )
        if state.parent is None:
            iteration_stats.update_from_finished_user_request(1, state.stats.num_generation_tokens)
