"""The continuous-batching scheduler (vLLM V1's), behind ``SchedulerInterface``
(``kvloom.scheduler.interface``: what the engine core calls).

Every step, ``schedule()`` spends a token budget (``max_num_batched_tokens``) in three
phases (``_schedule_running``, ``_schedule_waiting``, ``_step_output``):

1. Running requests first, in order. Each gets the tokens it has not computed yet (one
   for a decode, plus its draft tokens; the rest of its prompt for a chunked prefill,
   capped by ``long_prefill_token_threshold`` and the budget). If the KV cache cannot
   hold them, the lowest-priority running request (``priority`` policy: largest priority
   value, latest arrival; ``fcfs``: the one that started running last) is preempted by
   recompute: its blocks are freed, it goes back to the front of the waiting queue with
   its output so far, and it will recompute prompt + output (prefix-cache hits make
   that cheap). A request may have to preempt itself.
2. Then, if nothing was preempted this step, waiting requests in queue order while the
   budget, ``max_num_seqs`` and the KV cache allow: prefix-cache lookup (then the KV
   connector's, ``kvloom.scheduler.kv_connector``), then the rest of the prompt (chunked
   unless ``enable_chunked_prefill`` is off, in which case a prompt that does not fit the
   remaining budget waits).
3. The step's output: the grammar bitmask of its structured requests (below) and the
   requests finished since the last step, for the worker to drop.

``update_from_output()`` appends the tokens the runner sampled, applies stop conditions
(EOS unless ``ignore_eos``, stop token ids, both only once ``min_tokens`` are out;
``max_tokens`` and ``max_model_len``), frees finished requests and returns their outputs.

The engine core steps while ``has_requests()`` is true (unfinished requests, or finished
ones not reported yet) and calls ``update_from_output()`` after every ``schedule()``, also
for a step that scheduled nothing: aborts and requests too large for the cache are
reported through the next ``EngineCoreOutputs``. Aborts (``finish_requests``) are
expected between steps, not between ``schedule()`` and ``update_from_output()``.

With ``async_scheduling`` the engine core schedules step n+1 while step n still runs on
the device, so a running request's newest token is not known yet: it is counted in
``num_output_placeholders`` and scheduled all the same (the runner takes it from the
device). A request is not scheduled past its ``max_tokens``/``max_model_len`` limit by
placeholders; one that stops on EOS or a stop token may have one more step in flight,
whose token is dropped. ``update_from_output()`` then also accepts tokens for requests
preempted since their step was scheduled. Every sampling feature overlaps: penalties
count the token in flight on the device (``kvloom.worker.step_sampler``).

Structured outputs (``kvloom.structured_output``): a request with ``structured_outputs``
waits in ``WAITING_FOR_FSM`` (set aside, keeping its place in the queue, while the others
are scheduled) until its grammar has compiled; a grammar that fails to compile finishes
its request alone with ``FinishReason.ERROR``. Each step carries a bitmask row for every
structured request that samples in it; its tokens advance its matcher, and it finishes
(``stop``) when the grammar terminates. With async scheduling the bitmask of step n+1
needs the token of step n, which is still in flight when step n+1 is scheduled: such a
step is marked ``pending_structured_output_tokens`` and carries no bitmask; the engine
core launches its forward, applies step n's tokens (``update_from_output`` advances the
matchers) and then fills the bitmask (``get_grammar_bitmask``) for the sampling of step
n+1. Structured requests thus keep async scheduling's overlap.

Pipeline parallelism (``pipeline_parallel_size`` P > 1): the engine core keeps up to P
micro-batches in flight, one per stage. A request is in at most one of them: while its
step is in flight it is not scheduled again (``_in_flight``), so every step's inputs are
known tokens. The stages before the last sample nothing; each scheduled running request
carries the tokens its step computes (``CachedRequestData.new_token_ids``).

Speculative decoding (``kvloom.scheduler.speculation``): a running request's drafts
(``spec_token_ids``, from the runner's last output) are scheduled as extra new tokens with
KV slots for them and the proposer's lookahead; ``update_from_output()`` rolls back the
rejected ones, gives their blocks back and keeps the step's new drafts. A structured
request's bitmask then has a row per verified position.

Requests never wait on each other forever: a request that needs more KV blocks than the
whole cache has (a cache sized below one ``max_model_len`` request; the engine avoids
this) is finished with ``FinishReason.LENGTH`` instead of being retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from kvloom.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvloom.kv_cache.manager import KVCacheManager, block_ids_of
from kvloom.kv_cache.spec import KVCacheConfig
from kvloom.metrics.scheduler_stats import PrefixCacheStats, SchedulerStats
from kvloom.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput
from kvloom.request import EngineCoreEventType, FinishReason, Request, RequestStatus
from kvloom.scheduler.interface import SchedulerInterface
from kvloom.scheduler.kv_connector import Found, KVConnectorBase, scheduler_part
from kvloom.scheduler.output import CachedRequestData, GrammarOutput, NewRequestData, SchedulerOutput
from kvloom.scheduler.request_queue import create_request_queue
from kvloom.scheduler.speculation import Speculation
from kvloom.scheduler.utils import StepPlan, check_stop, final_output, stop_limits
from kvloom.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING


class Scheduler(SchedulerInterface):
    """vLLM V1's continuous-batching scheduler (the module docstring tells the algorithm)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        log_stats: bool = True,
        max_loras: int | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        pipeline_parallel_size: int = 1,
        kv_cache_config: KVCacheConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        kv_connector: KVConnectorBase | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.async_scheduling = scheduler_config.async_scheduling
        # Without chunked prefill no prompt is split, so the chunk cap does not apply.
        self.long_prefill_token_threshold = (
            scheduler_config.long_prefill_token_threshold if self.enable_chunked_prefill else 0
        )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with enable_chunked_prefill=False, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}), or long prompts could never be scheduled"
            )
        self.log_stats = log_stats
        # With LoRA: at most this many distinct adapters in the running batch (the
        # runner's adapter slots); None = LoRA off.
        self.max_loras = max_loras
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
            log_stats=log_stats,
            kv_cache_config=kv_cache_config,
        )
        self.policy = scheduler_config.policy
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished, aborted or preempted since the last schedule(): the worker drops them.
        self.finished_req_ids: set[str] = set()
        # Final outputs produced outside update_from_output (aborts, requests too large
        # for the cache), delivered with the next EngineCoreOutputs.
        self._pending_outputs: list[EngineCoreOutput] = []
        self._finished_since_output: set[str] = set()
        self._num_preemptions = 0  # since the last make_stats()
        # Per generating request: (token ids that may stop it, token count that ends it),
        # so that the common step needs no full stop check.
        self._stop_limits: dict[str, tuple[frozenset[int], int]] = {}
        # Structured outputs: None = refused (the engine core passes its manager).
        self.structured_output_manager = structured_output_manager
        self._structured: set[str] = set()  # ids of requests with a grammar
        # Pipeline parallelism: ids of requests in a step not yet back from the last stage.
        self.pipeline_parallel = pipeline_parallel_size > 1
        self._in_flight: set[str] = set()
        # Speculative decoding (kvloom.scheduler.speculation): None = off.
        self.speculation = Speculation(speculative_config, self.kv_cache_manager, self.max_model_len) \
            if speculative_config is not None else None  # fmt: skip
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config is not None else 0
        self.kv_connector = scheduler_part(kv_connector, self.kv_cache_manager, cache_config.prefix_caching_hash_algo)

    # ------------------------------------------------------------------ requests in

    def add_request(self, request: Request) -> None:
        """Queue a request. Its prompt obeys the model's limits (not empty, shorter than
        ``max_model_len``, ids in the vocabulary): the engine core checked it
        (``EngineCore.check_request``, with ``kvloom.model_limits``) before it came here."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        self.requests[request.request_id] = request
        params = request.sampling_params
        if params is not None:
            self._stop_limits[request.request_id] = stop_limits(request, self.max_model_len)
            if params.structured_outputs is not None:
                if self.structured_output_manager is None:
                    raise ValueError(f"request {request.request_id!r}: structured outputs are not enabled in this scheduler")
                self.structured_output_manager.grammar_init(request)
                request.status = RequestStatus.WAITING_FOR_FSM
                self._structured.add(request.request_id)
        self.waiting.add(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def reject_request(self, request_id: str, message: str) -> None:
        """Refuse a request that never joined the queues (the engine core found it
        unservable when it arrived): it is reported in the next ``EngineCoreOutputs``,
        finished with ``FinishReason.ABORT`` and ``error=message``."""
        self._pending_outputs.append(
            EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT, error=message)
        )

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests in any state (abort, or a stop string the front end found).

        Unknown or already finished ids are ignored. Aborted requests get a final output
        (finish reason ABORT) in the next EngineCoreOutputs.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        gone_running, gone_waiting = [], []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            (gone_running if request.status == _RUNNING else gone_waiting).append(request)
            request.status = finished_status
            self._free_request(request)
            if finished_status == RequestStatus.FINISHED_ABORTED:
                self._pending_outputs.append(final_output(request))
        if gone_running:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if gone_waiting:
            self.waiting.remove_all(gone_waiting)

    def has_unfinished_requests(self) -> bool:
        return len(self.waiting) + len(self.running) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_requests(self) -> bool:
        """Whether a step has anything to do: run requests, report finished ones, hear of KV transfers."""
        return self.has_unfinished_requests() or bool(self.finished_req_ids or self._pending_outputs) \
            or self.kv_connector.has_pending()  # fmt: skip

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        step = StepPlan(token_budget=self.max_num_batched_tokens, now=time.monotonic() if self.log_stats else 0.0)
        self._schedule_running(step)
        if not step.num_preempted:  # waiting requests would not fit: the cache is short already
            self._schedule_waiting(step)
        return self._step_output(step)

    def _schedule_running(self, step: StepPlan) -> None:
        """Phase 1: the running requests, in order, each its next tokens; preempts when the
        KV cache cannot hold them. A scheduled request's tokens count as computed at once
        (the worker computes them before the next step); the data for the worker carries
        the count before this step."""
        token_budget = step.token_budget
        threshold = self.long_prefill_token_threshold
        max_model_len = self.max_model_len
        num_scheduled_tokens = step.num_scheduled_tokens
        spec_decode_tokens = step.spec_decode_tokens
        cached_reqs = step.cached_reqs
        allocate_slots = self.kv_cache_manager.allocate_slots
        async_scheduling = self.async_scheduling
        stop_limits = self._stop_limits
        pipeline, in_flight = self.pipeline_parallel, self._in_flight
        lookahead, kept_blocks = self.num_lookahead_tokens, self.speculation.kept_blocks if self.speculation else None

        for request in list(self.running):  # a copy: preemption removes from self.running
            if token_budget == 0:
                break
            if request.status != _RUNNING:  # preempted earlier in this loop
                continue
            if pipeline and request.request_id in in_flight:  # its previous step is still in the pipeline
                continue
            num_computed = request.num_computed_tokens
            num_placeholders = request.num_output_placeholders
            num_known = len(request.all_token_ids)
            if num_placeholders and num_known + num_placeholders >= stop_limits[request.request_id][1]:
                continue  # its last token is in flight: the request finishes when it arrives
            num_new = num_known + num_placeholders + len(request.spec_token_ids) - num_computed
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > token_budget:
                num_new = token_budget
            if num_new > max_model_len - num_computed:  # no KV position past max_model_len
                num_new = max_model_len - num_computed
            if num_new == 0 and async_scheduling:  # a pooling request waiting for its result
                continue
            # A draft model's lookahead slots, never past max_model_len (no draft goes there).
            lookahead_now = min(lookahead, max_model_len - num_computed - num_new)
            while (new_blocks := allocate_slots(request, num_new, None, 0, lookahead_now)) is None:
                if len(self.running) == 1:  # alone and still too big: the cache is too small
                    self._finish_too_large(request)
                    break
                victim = self._pick_victim()
                victim_id = victim.request_id
                if victim_id in num_scheduled_tokens:  # priority policy: undo its step
                    num_undone = num_scheduled_tokens.pop(victim_id)
                    token_budget += num_undone
                    victim.num_computed_tokens -= num_undone
                    spec_decode_tokens.pop(victim_id, None)
                    cached_reqs[:] = [c for c in cached_reqs if c.req_id != victim_id]
                self._preempt(victim, step.now)
                step.num_preempted += 1
                if victim is request:
                    break
            if new_blocks is None:
                continue
            request_id = request.request_id
            cached_reqs.append(
                CachedRequestData(request_id, block_ids_of(new_blocks), num_computed,
                                  request.all_token_ids[num_computed : num_computed + num_new] if pipeline else None,
                                  kept_blocks.pop(request_id, None) if kept_blocks else None)
            )  # fmt: skip
            request.num_computed_tokens = num_computed + num_new
            num_scheduled_tokens[request_id] = num_new
            token_budget -= num_new
            if async_scheduling and num_computed + num_new >= num_known + num_placeholders and request_id in stop_limits:
                request.num_output_placeholders += 1  # this step samples a token the host sees later
            if request.spec_token_ids:
                num_spec = num_computed + num_new - len(request.all_token_ids)
                if num_spec > 0:
                    spec_decode_tokens[request_id] = request.spec_token_ids[:num_spec]
        step.token_budget = token_budget

    def _schedule_waiting(self, step: StepPlan) -> None:
        """Phase 2: waiting requests in queue order while the budget, ``max_num_seqs`` and the
        KV cache allow. A request that cannot start yet but must not hold up the queue (its
        adapter would exceed ``max_loras``, its grammar is compiling, its KV arriving, a step
        of it is in flight) is set aside, keeping its place, so that the requests behind it run."""
        kv = self.kv_cache_manager
        threshold = self.long_prefill_token_threshold
        skipped: list[Request] = []
        active_loras = (
            {r.lora_int_id for r in self.running if r.lora_request is not None} if self.max_loras is not None else set()
        )
        while self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if (
                self.max_loras is not None
                and request.lora_request is not None
                and request.lora_int_id not in active_loras
                and len(active_loras) >= self.max_loras
            ):
                skipped.append(self.waiting.pop())
                continue
            if request.num_output_placeholders or (self.pipeline_parallel and request.request_id in self._in_flight):
                skipped.append(self.waiting.pop())  # preempted with a step in flight: wait for its token
                continue
            if request.status == RequestStatus.WAITING_FOR_FSM:
                assert self.structured_output_manager is not None
                ready = self.structured_output_manager.grammar_ready(request)
                if ready is False:  # still compiling: the requests behind it go on
                    skipped.append(self.waiting.pop())
                    continue
                if ready is not True:  # failed to compile: this request fails alone
                    self.waiting.pop()
                    self._pending_outputs.append(self._fail_request(request, ready))
                    continue
                request.status = RequestStatus.WAITING
            hit = self.kv_connector.lookup(request)  # prefix-cache hits, and the KV connector's tokens
            if hit is None:  # its KV is on its way (or the connector answers later): it keeps its place
                skipped.append(self.waiting.pop())
                continue
            if not isinstance(hit, Found):  # the KV connector failed for this request alone
                self._pending_outputs.append(self._fail_request(self.waiting.pop(), hit))
                continue
            num_hits = hit.num_hits + hit.num_external  # the KV connector's tokens count as cached
            num_new = 0 if hit.load_async else request.num_tokens - num_hits
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > step.token_budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = step.token_budget
            lookahead = min(self.num_lookahead_tokens, self.max_model_len - num_hits - num_new)
            if kv.allocate_slots(request, num_new + hit.num_external, hit.blocks, hit.num_hits, lookahead,
                                 hit.load_async) is None:  # fmt: skip
                if self.running:
                    break  # wait for running requests to free blocks
                self.waiting.pop()  # the whole cache is free and still too small
                self._finish_too_large(request)
                continue
            self.waiting.pop()
            if failure := self.kv_connector.after_alloc(request, hit):
                self._pending_outputs.append(self._fail_request(request, failure))
                continue
            if hit.load_async:  # it waits for its KV, keeping its place
                skipped.append(request)
                continue
            if request.lora_request is not None:
                active_loras.add(request.lora_int_id)
            self._start_running(request, step, num_hits, num_new)
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _start_running(self, request: Request, step: StepPlan, num_hits: int, num_new: int) -> None:
        """Move a waiting request, its blocks allocated, to the running batch of this step:
        ``num_hits`` tokens cached (prefix-cache hits, the KV connector's), ``num_new`` to compute."""
        kv = self.kv_cache_manager
        self.running.append(request)
        request.status = _RUNNING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hits
        if self.log_stats:
            request.record_event(EngineCoreEventType.SCHEDULED, step.now)
        step.new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                pooling_params=request.pooling_params,
                block_ids=kv.get_block_ids(request.request_id),
                num_computed_tokens=num_hits,
                lora_request=request.lora_request,
                eos_token_id=request.eos_token_id,
            )
        )
        request.num_computed_tokens = num_hits + num_new
        step.num_scheduled_tokens[request.request_id] = num_new
        step.token_budget -= num_new
        if self.async_scheduling and num_hits + num_new >= request.num_tokens and request.request_id in self._stop_limits:
            request.num_output_placeholders += 1

    def _step_output(self, step: StepPlan) -> SchedulerOutput:
        """Phase 3: the step's ``SchedulerOutput``, with the grammar bitmask rows of its
        structured requests and the requests finished since the last step; the requests it
        sends into the pipeline are in flight until their results come back."""
        num_scheduled_tokens = step.num_scheduled_tokens
        bitmask_rows: dict[str, int] = {}
        bitmask = None
        pending_tokens = False
        if self._structured:
            # Structured requests that sample this step (a prefill chunk short of the
            # prompt's end samples nothing).
            sampling = [
                req
                for req_id in num_scheduled_tokens
                if req_id in self._structured and (req := self.requests[req_id]).num_computed_tokens >= req.num_tokens
            ]
            # Async scheduling: a sampling request counts this step's token as a placeholder;
            # one more means a token of the step in flight, which its bitmask must follow.
            if self.async_scheduling and any(req.num_output_placeholders > 1 for req in sampling):
                pending_tokens = True
                bitmask_rows = {req.request_id: i for i, req in enumerate(sampling)}
            elif sampling:
                assert self.structured_output_manager is not None
                # With drafts, one row per verified position (kvloom.scheduler.speculation).
                bitmask_rows, bitmask = self.structured_output_manager.grammar_bitmask(sampling, step.spec_decode_tokens)

        finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        if self.pipeline_parallel:
            self._in_flight.update(num_scheduled_tokens)
        return SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.token_budget,
            scheduled_spec_decode_tokens=step.spec_decode_tokens,
            finished_req_ids=finished_req_ids,
            structured_output_request_ids=bitmask_rows,
            grammar_bitmask=bitmask,
            pending_structured_output_tokens=pending_tokens,
            kv_connector_metadata=self.kv_connector.build_step(step, finished_req_ids, self.requests),
        )

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask of a step scheduled with ``pending_structured_output_tokens``, filled
        now that the tokens of the step before it are applied (``update_from_output``
        advanced the matchers): one row per structured request of the step still running.
        A request that finished meanwhile (its grammar terminated, a stop token, a failure)
        gets no row; its token from this step is dropped when it arrives. None when no row
        is left."""
        sampling = [
            request
            for req_id in scheduler_output.structured_output_request_ids
            if req_id in self._structured and (request := self.requests[req_id]).status == _RUNNING
        ]
        if not sampling:
            return None
        assert self.structured_output_manager is not None
        rows, bitmask = self.structured_output_manager.grammar_bitmask(sampling)
        assert bitmask is not None
        return GrammarOutput(rows, bitmask)

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            # Largest priority value, then latest arrival; among equals the latest started.
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, now: float) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)  # before resetting num_computed_tokens
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        if self.speculation is not None:
            self.speculation.forget(request.request_id)
        request.num_preemptions += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, now)
        self.waiting.prepend(request)
        self.finished_req_ids.add(request.request_id)
        self._num_preemptions += 1

    def _finish_too_large(self, request: Request) -> None:
        """Finish a request that needs more KV blocks than the whole cache has."""
        logger.warning(
            "Request %s needs more KV-cache blocks than the cache has (%d blocks of %d tokens) "
            "at %d tokens; finishing it with reason 'length'",
            request.request_id,
            self.kv_cache_manager.block_pool.num_usable_blocks,
            self.block_size,
            request.num_tokens,
        )
        if request.status == _RUNNING:
            self.running.remove(request)
        started = request.num_output_tokens > 0 or request.status == _RUNNING
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED if started else RequestStatus.FINISHED_IGNORED
        self._free_request(request)
        self._pending_outputs.append(final_output(request))

    # ------------------------------------------------------------------ results in

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs, self._pending_outputs = self._pending_outputs, []
        self.kv_connector.update_from_output(model_runner_output.kv_connector_output)
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        if self.pipeline_parallel:
            self._in_flight.difference_update(num_scheduled_tokens)
        req_ids = model_runner_output.req_ids
        if len(req_ids) != len(num_scheduled_tokens):
            missing = sorted(set(num_scheduled_tokens) - set(req_ids))
            raise RuntimeError(f"the model runner returned no result for scheduled requests {missing}")
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        pooler_output = model_runner_output.pooler_output
        prompt_logprobs = model_runner_output.prompt_logprobs
        failed = model_runner_output.failed
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        spec_token_ids = model_runner_output.spec_token_ids
        requests = self.requests
        max_model_len = self.max_model_len
        stop_limits = self._stop_limits
        any_finished = False
        step_starts: dict[str, int] | None = None  # pooling requests: where this step's tokens began

        for i, req_id in enumerate(req_ids):
            if req_id not in num_scheduled_tokens:
                raise RuntimeError(f"the model runner returned a result for unscheduled request {req_id!r}")
            request = requests.get(req_id)
            if request is None:  # finished or aborted since scheduled
                continue
            if failed and req_id in failed:  # its own work failed: it ends, the others go on
                outputs.append(self._fail_request(request, failed[req_id]))
                any_finished = True
                continue
            new_token_ids = sampled[i]
            # Async scheduling: a request preempted while this step was in flight keeps its
            # token; it is recomputed with the rest when the request runs again.
            preempted = request.status == RequestStatus.PREEMPTED
            if request.status != _RUNNING and not (preempted and new_token_ids):
                continue
            if request.num_output_placeholders and new_token_ids:
                request.num_output_placeholders -= 1
            if spec_decode_tokens and (drafts := spec_decode_tokens.get(req_id)):
                # The runner accepted len(new_token_ids) - 1 drafts plus one bonus token.
                assert self.speculation is not None, "draft tokens were scheduled without speculative decoding"
                self.speculation.verified(request, len(drafts), len(new_token_ids))

            finished = False
            pooled = None
            if request.pooling_params is not None:
                # Whether this step completed the prompt: with async scheduling a later chunk
                # may be scheduled already, so the request's own count can be ahead of it.
                if step_starts is None:
                    scheduled = (*scheduler_output.scheduled_new_reqs, *scheduler_output.scheduled_cached_reqs)
                    step_starts = {d.req_id: d.num_computed_tokens for d in scheduled}
                if step_starts[req_id] + num_scheduled_tokens[req_id] >= request.num_tokens:  # prompt complete
                    pooled = pooler_output[i] if pooler_output is not None else None
                    if pooled is None:
                        raise RuntimeError(f"the model runner returned no pooler output for request {req_id!r}")
                    request.status = RequestStatus.FINISHED_STOPPED
                    finished = True
            elif new_token_ids:
                stop_token_ids, max_num_tokens = stop_limits[req_id]
                num_accepted = 0
                for token_id in new_token_ids:
                    request.append_output_token_ids(token_id)
                    num_accepted += 1
                    # Cheap pre-check; check_stop applies min_tokens and sets the reason.
                    if (token_id in stop_token_ids or len(request.all_token_ids) >= max_num_tokens) and check_stop(
                        request, max_model_len
                    ):
                        finished = True
                        break
                if num_accepted < len(new_token_ids):
                    new_token_ids = new_token_ids[:num_accepted]
                if req_id in self._structured:
                    manager = self.structured_output_manager
                    assert manager is not None
                    if not manager.accept_tokens(request, len(new_token_ids)):
                        outputs.append(self._fail_request(
                            request, f"structured outputs: the sampled tokens {new_token_ids} are not allowed by the "
                                     "request's grammar"))  # fmt: skip
                        any_finished = True
                        continue
                    if not finished and manager.is_terminated(req_id):
                        request.status = RequestStatus.FINISHED_STOPPED
                        finished = True

            if spec_token_ids is not None and not finished and (drafts := spec_token_ids[i]):
                assert self.speculation is not None
                self.speculation.take_drafts(request, drafts, stop_limits[req_id][1],
                                             self.structured_output_manager if req_id in self._structured else None)
            new_prompt_logprobs = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if new_token_ids or finished or new_prompt_logprobs:
                new_logprobs = logprobs[i] if logprobs is not None else None
                if new_logprobs is not None and len(new_logprobs) > len(new_token_ids):
                    new_logprobs = new_logprobs[: len(new_token_ids)]
                outputs.append(
                    EngineCoreOutput(
                        req_id,
                        new_token_ids,
                        new_logprobs,
                        new_prompt_logprobs,
                        pooled,
                        request.get_finished_reason() if finished else None,
                        request.stop_reason,
                        request.take_events() if request.events else None,
                        request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
                    )
                )
            if finished:
                if preempted:
                    self.waiting.remove_all([request])
                outputs[-1].kv_transfer_params = self._free_request(request)
                any_finished = True

        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        finished_ids, self._finished_since_output = self._finished_since_output, set()
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.make_stats() if self.log_stats else None,
            timestamp=time.monotonic(),
            finished_requests=finished_ids,
        )

    def _free_request(self, request: Request) -> dict | None:
        """Release a finished request (the caller removes it from running/waiting); its ``kv_transfer_params``."""
        del self.requests[request.request_id]
        self._stop_limits.pop(request.request_id, None)
        if self.speculation is not None:
            self.speculation.forget(request.request_id)
        if request.request_id in self._structured:
            self._structured.discard(request.request_id)
            assert self.structured_output_manager is not None
            self.structured_output_manager.free(request.request_id)
        self.finished_req_ids.add(request.request_id)
        self._finished_since_output.add(request.request_id)
        return self.kv_connector.free_request(request)  # its blocks now, or once the connector's transfer ended

    def _fail_request(self, request: Request, message: str) -> EngineCoreOutput:
        """Finish a request whose own work failed in a step (``FinishReason.ERROR``).

        Its blocks may have been cached for tokens whose KV was never written (a failure
        before the forward), so the blocks only it holds leave the prefix cache."""
        logger.error("Request %s failed in the engine and was finished: %s", request.request_id, message)
        if request.status == RequestStatus.PREEMPTED:
            self.waiting.remove_all([request])
        request.status = RequestStatus.FINISHED_ERROR
        request.num_computed_tokens = 0  # free() uncaches every block no one else holds
        self._free_request(request)
        output = final_output(request)
        output.error = message
        return output

    # ------------------------------------------------------------------ stats

    def make_stats(self) -> SchedulerStats:
        """Queue sizes, KV-cache usage, and prefix-cache/preemption counts since the last call."""
        num_preemptions, self._num_preemptions = self._num_preemptions, 0
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats() or PrefixCacheStats(),
            num_preemptions=num_preemptions,
        )
        if self.structured_output_manager is not None:
            structured = self.structured_output_manager.take_stats()
            stats.structured_output_compile_times = structured.compile_times
            stats.structured_output_cache_queries = structured.cache_queries
            stats.structured_output_cache_hits = structured.cache_hits
        if self.speculation is not None:
            stats.spec_decoding_stats = self.speculation.take_stats()
        stats.kv_transfer_stats = self.kv_connector.take_stats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget all cached KV blocks; False (nothing done) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

