"""The front end's request and iteration statistics, computed from engine-core outputs
(the scheduler's per-step ``SchedulerStats`` are in ``kvloom.metrics.scheduler_stats``).

Request and iteration metrics are collected in the front end (off the engine core's hot loop), from what each
``EngineCoreOutputs`` carries:

* per-request events (QUEUED, SCHEDULED, PREEMPTED) timestamped with the engine core's
  monotonic clock, and the batch's own monotonic timestamp, which is the NEW_TOKENS
  event of every request in it;
* the front end's wall-clock ``arrival_time`` of each request.

Intervals are always taken between two timestamps of the same process:

* queue: QUEUED -> SCHEDULED; prefill: SCHEDULED -> first NEW_TOKENS;
  decode: first NEW_TOKENS -> last NEW_TOKENS; inference: SCHEDULED -> last NEW_TOKENS;
  inter-token: between successive NEW_TOKENS (all engine-core clock);
* time to first token and end-to-end latency: from ``arrival_time`` to when the front end
  processes the first / final token (front-end wall clock), so they include input
  processing and transport.

Preemption: a preempted request goes back to the waiting queue and is SCHEDULED again;
only its first SCHEDULED counts. So a preemption during decode lengthens the inter-token,
decode and inference intervals, and one during prefill lengthens time to first token and
the prefill interval; the queue interval is the first wait only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvloom.request import EngineCoreEvent, EngineCoreEventType, FinishReason

if TYPE_CHECKING:
    from kvloom.outputs import EngineCoreOutput


# ----------------------------------------------------------------- front end


@dataclass
class RequestStateStats:
    """Timing state of one request, kept by the output processor while it runs."""

    #: Front-end wall-clock time (``time.time()``) the request arrived.
    arrival_time: float
    num_generation_tokens: int = 0
    # Engine-core monotonic timestamps (None until the event is seen).
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    #: Time to first token (front-end clock), once known.
    first_token_latency: float | None = None
    num_preemptions: int = 0


@dataclass
class FinishedRequestStats:
    """Inputs of the per-request histograms, recorded once when a request finishes."""

    finish_reason: FinishReason
    """Why it finished: ``"stop"``, ``"length"`` or ``"abort"`` (a ``str`` enum)."""
    e2e_latency: float
    """Seconds from arrival to the final token (front-end wall clock)."""
    num_prompt_tokens: int
    """Prompt tokens."""
    num_generation_tokens: int
    """Tokens generated."""
    max_tokens_param: int | None
    """The request's ``max_tokens``."""
    queued_time: float
    """Seconds queued before first scheduled (engine clock; 0 if never scheduled)."""
    prefill_time: float
    """Seconds from first scheduled to the first token."""
    inference_time: float
    """Seconds from first scheduled to the last token."""
    decode_time: float
    """Seconds from the first to the last token."""
    mean_time_per_output_token: float
    """``decode_time / (num_generation_tokens - 1)`` (0 for one token)."""
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache."""


def _interval(start: float | None, end: float | None) -> float:
    """end - start, or 0.0 when either event never happened (e.g. aborted while queued)."""
    if start is None or end is None:
        return 0.0
    return max(end - start, 0.0)


@dataclass
class IterationStats:
    """Stats of one engine step (one ``EngineCoreOutputs``), handed to the stat loggers.

    ``queue_times_iter`` / ``prefill_times_iter`` observe the intervals as soon as they are
    known (requests first scheduled / first token in this step); ``finished_requests``
    carries the same intervals again at finish, with the rest of the per-request values.
    A logger should histogram one or the other (vLLM's Prometheus logger uses the
    finished-request values).
    """

    iteration_timestamp: float = field(default_factory=time.time)
    """Front-end wall-clock time this step's outputs were processed."""
    num_generation_tokens: int = 0
    """Tokens generated in this step."""
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests whose prefill completed in this step."""
    num_preempted_reqs: int = 0
    """Preemptions seen in this step."""
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    """One entry per request that finished in this step."""
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    """Seconds from arrival to first token of the requests whose first token came in this step."""
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    """Inter-token latencies (time per output token) of the decode outputs in this step."""
    queue_times_iter: list[float] = field(default_factory=list)
    """Queue intervals (queued -> first scheduled) that ended in this step."""
    prefill_times_iter: list[float] = field(default_factory=list)
    """Prefill intervals (first scheduled -> first token) that ended in this step."""
    n_params_iter: list[int] = field(default_factory=list)
    """Per finished user request (for n > 1: the parent): its ``n``."""
    max_num_generation_tokens_iter: list[int] = field(default_factory=list)
    """Per finished user request: the token count of its longest output."""

    def _since(self, wall_start: float) -> float:
        return max(self.iteration_timestamp - wall_start, 0.0)

    def update_from_output(
        self,
        output: EngineCoreOutput,
        engine_core_timestamp: float,
        is_prefilling: bool,
        prompt_len: int,
        req_stats: RequestStateStats,
    ) -> None:
        """Account one request's output of this step. ``is_prefilling``: the request had
        produced nothing before this output."""
        if output.events:
            self.update_from_events(output.events, req_stats)

        num_new = len(output.new_token_ids)
        produced = num_new > 0 or output.pooling_output is not None
        self.num_generation_tokens += num_new
        req_stats.num_generation_tokens += num_new
        if not produced:
            return

        if is_prefilling:
            self.num_prompt_tokens += prompt_len
            ttft = self._since(req_stats.arrival_time)
            req_stats.first_token_latency = ttft
            self.time_to_first_tokens_iter.append(ttft)
            req_stats.first_token_ts = engine_core_timestamp
            if req_stats.scheduled_ts is not None:
                self.prefill_times_iter.append(_interval(req_stats.scheduled_ts, engine_core_timestamp))
        elif req_stats.last_token_ts is not None:
            self.inter_token_latencies_iter.append(_interval(req_stats.last_token_ts, engine_core_timestamp))
        req_stats.last_token_ts = engine_core_timestamp

    def update_from_events(self, events: list[EngineCoreEvent], req_stats: RequestStateStats) -> None:
        """Account a request's QUEUED / SCHEDULED / PREEMPTED events (the front end calls it)."""
        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                if req_stats.queued_ts is None:
                    req_stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if req_stats.scheduled_ts is None:  # rescheduling after a preemption does not count
                    req_stats.scheduled_ts = event.timestamp
                    if req_stats.queued_ts is not None:
                        self.queue_times_iter.append(_interval(req_stats.queued_ts, event.timestamp))
            elif event.type == EngineCoreEventType.PREEMPTED:
                self.num_preempted_reqs += 1
                req_stats.num_preemptions += 1

    def update_from_finished_request(
        self,
        finish_reason: FinishReason,
        num_prompt_tokens: int,
        max_tokens_param: int | None,
        req_stats: RequestStateStats,
        num_cached_tokens: int = 0,
    ) -> FinishedRequestStats:
        """Record a finished request in ``finished_requests`` (the front end calls it)."""
        decode_time = _interval(req_stats.first_token_ts, req_stats.last_token_ts)
        n = req_stats.num_generation_tokens
        finished = FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_latency=self._since(req_stats.arrival_time),
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=n,
            max_tokens_param=max_tokens_param,
            queued_time=_interval(req_stats.queued_ts, req_stats.scheduled_ts),
            prefill_time=_interval(req_stats.scheduled_ts, req_stats.first_token_ts),
            inference_time=_interval(req_stats.scheduled_ts, req_stats.last_token_ts),
            decode_time=decode_time,
            mean_time_per_output_token=decode_time / (n - 1) if n > 1 else 0.0,
            num_cached_tokens=num_cached_tokens,
        )
        self.finished_requests.append(finished)
        return finished

    def update_from_finished_user_request(self, n: int, max_num_generation_tokens: int) -> None:
        """Once per user request (after all n samples finished)."""
        self.n_params_iter.append(n)
        self.max_num_generation_tokens_iter.append(max_num_generation_tokens)
