"""EngineCore: the inner loop. Scheduler + worker, one step at a time.

``step()`` is schedule -> execute -> update; everything the front end needs comes back
in ``EngineCoreOutputs`` (new tokens, finish reasons, event timestamps, scheduler stats).
With ``async_scheduling`` a step launches the next one before waiting for the previous
(see ``_step_async``). With pipeline parallelism the core keeps up to one micro-batch per
stage in flight (``_step_pipelined``, vLLM's batch queue).
The core holds no text and no tokenizer.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterable

from kvloom import plugins
from kvloom.config import EngineConfig
from kvloom.executor import get_executor_cls
from kvloom.kv_cache.spec import KVCacheConfig, engine_kv_cache_config
from kvloom.kv_transfer.factory import check_kv_transfer_params, scheduler_side
from kvloom.loader.tokenizer import get_tokenizer
from kvloom.lora.request import LoRARequest
from kvloom.model_limits import ModelLimits, check_against_model
from kvloom.outputs import EngineCoreOutputs, ModelRunnerOutput, PendingModelRunnerOutput
from kvloom.platforms.worker import WorkerBase
from kvloom.request import EngineCoreRequest, Request, RequestStatus
from kvloom.sample.metadata import check_sampling_state
from kvloom.sampling_params import SamplingParams
from kvloom.scheduler.output import SchedulerOutput
from kvloom.scheduler.scheduler import Scheduler
from kvloom.structured_output.manager import StructuredOutputManager
from kvloom.utils import cdiv

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        # Plugins load in every process that runs an engine core (idempotent).
        plugins.load_plugins()
        self.config = config
        self.limits = ModelLimits.of(config.model)
        start = time.perf_counter()
        # The executor runs the platform's worker: here (tensor-parallel size 1) or one
        # process per rank (--distributed-executor-backend mp).
        self.executor = get_executor_cls(config)(config)
        # The KV-cache groups, which every worker rank derives alike from the model config.
        self.kv_cache_config = engine_kv_cache_config(config)
        try:
            num_blocks = self._start_workers(config, start)
        except BaseException:
            self.executor.shutdown()
            raise
        self.structured_output_manager = StructuredOutputManager(
            config.structured_outputs.backend,
            config.model.vocab_size,
            tokenizer_loader=functools.partial(get_tokenizer, config.model),
            reasoning_parser=config.structured_outputs.reasoning_parser,
            enable_in_reasoning=config.structured_outputs.enable_in_reasoning,
        )
        # The KV connector's scheduler side (kv_transfer_config), which the scheduler drives.
        self.kv_connector = scheduler_side(config)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            log_stats=log_stats,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
            structured_output_manager=self.structured_output_manager,
            pipeline_parallel_size=config.parallel.pipeline_parallel_size,
            kv_cache_config=self.kv_cache_config,
            speculative_config=config.speculative,
            kv_connector=self.kv_connector,
        )
        self.async_scheduling = config.scheduler.async_scheduling
        # Pipeline parallelism: micro-batches in flight at most (vLLM's max_concurrent_batches).
        self.max_concurrent_batches = config.parallel.pipeline_parallel_size
        # Async scheduling: steps launched on the device whose outputs are not applied yet.
        # (Under async scheduling a step launched without sampling holds None until it is
        # sampled within the same step() call.)
        self._in_flight: deque[tuple[SchedulerOutput, PendingModelRunnerOutput | None]] = deque()

    @property
    def worker(self) -> WorkerBase:
        """The worker in this process (tensor-parallel size 1 only; tests reach into it)."""
        worker = getattr(self.executor, "driver_worker", None)
        if worker is None:
            raise AttributeError(f"{type(self.executor).__name__} runs its workers in other processes")
        return worker

    def _start_workers(self, config: EngineConfig, start: float) -> int:
        """Load the model, size and allocate the KV cache, warm up (every rank); the
        number of KV blocks."""
        self.executor.load_model()
        loaded = time.perf_counter()
        logger.info("Model loading took %.2f s", loaded - start)
        # On devices with memory profiling this runs the first forward, which compiles
        # the model when compilation is on (the runner logs the compile time itself).
        num_blocks = self.executor.determine_num_kv_blocks()
        profiled = time.perf_counter()
        kv = self.kv_cache_config
        usable = num_blocks - kv.needs_null_block  # the null block is no request's
        needed = kv.blocks_per_request(config.model.max_model_len, config.scheduler.max_num_batched_tokens)
        if usable < needed:
            raise ValueError(
                f"The KV cache holds {usable} blocks of {config.cache.block_size} tokens, fewer than "
                f"the {needed} blocks one request of max_model_len={config.model.max_model_len} needs "
                f"({kv.describe()}). Raise --kv-cache-memory / --gpu-memory-utilization or lower --max-model-len."
            )
        self.executor.initialize_cache(num_blocks)
        config.cache.num_blocks = num_blocks
        self._log_kv_cache_size(num_blocks)
        cache_ready = time.perf_counter()
        self.executor.compile_or_warm_up_model()
        ready = time.perf_counter()
        logger.info(
            "Engine core ready in %.1f s (%d KV blocks): load %.1f s, KV-cache sizing (profile run) %.1f s, "
            "KV-cache allocation %.1f s, warm-up and CUDA-graph capture %.1f s; torch.compile time is logged "
            "by the model runner within the first forwards",
            ready - start, num_blocks, loaded - start, profiled - loaded, cache_ready - profiled, ready - cache_ready,
        )  # fmt: skip
        return num_blocks

    def _log_kv_cache_size(self, num_blocks: int) -> None:
        """vLLM's start-up line: the KV cache in tokens and how many requests of
        max_model_len tokens it holds at once (the worker logs its bytes)."""
        log_kv_cache_size(self.config, self.kv_cache_config, num_blocks)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit a request. One this engine cannot serve (token ids outside the
        vocabulary, sampling parameters that cannot be sampled with, pooling it cannot
        do) is refused alone, before it joins a batch: it finishes with
        ``FinishReason.ABORT`` and ``error`` saying why, in the next step's outputs."""
        problem = self.check_request(request)
        if problem is not None:
            logger.warning("Refused request %s: %s", request.request_id, problem)
            self.scheduler.reject_request(request.request_id, problem)
            return
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def check_request(self, request: EngineCoreRequest) -> str | None:
        """Why this engine cannot serve ``request``, or None. The front end validated it
        already, but the core trusts no client (several may feed it): the model-bounded
        rules again (``check_against_model``, the front end's and the server's too), then
        a dry run of the request's sampling state, which a step would trip on."""
        params = request.sampling_params if request.sampling_params is not None else request.pooling_params
        if params is None:
            return "sampling_params: a request needs sampling or pooling parameters"
        problems = check_against_model(params, request.prompt_token_ids, self.limits)
        if problems:
            return problems[0][1]
        if isinstance(params, SamplingParams):
            try:
                check_sampling_state(params, request.prompt_token_ids, self.limits.vocab_size, request.eos_token_id)
            except ValueError as exc:
                return str(exc)
            if params.kv_transfer_params is not None:
                problem = check_kv_transfer_params(self.kv_connector, params.kv_transfer_params)
                if problem is not None:
                    return f"kv_transfer_params: {problem}"
        if request.lora_request is not None and not self.config.lora.enable_lora:
            return "lora_request: LoRA is not enabled; start the engine with --enable-lora"
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Requests to run, steps in flight, or finished/aborted requests whose outputs
        are not reported yet."""
        return bool(self._in_flight) or self.scheduler.has_requests()

    # ------------------------------------------------------------------ loop
    def step(self) -> EngineCoreOutputs:
        if self.async_scheduling:
            return self._step_async()
        if self.max_concurrent_batches > 1:
            return self._step_pipelined()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty():
            # Nothing runs but grammars compile: wait for one instead of spinning.
            self.structured_output_manager.wait_for_compile(0.01)
        pending = self.executor.execute_model(scheduler_output)
        assert pending is not None  # only async scheduling defers a step's sampling
        return self.scheduler.update_from_output(scheduler_output, pending.get_output())

    def _step_async(self) -> EngineCoreOutputs:
        """One step with up to two in flight: launch step n+1 behind step n, then wait
        for step n and apply its tokens. The host's scheduling and input preparation
        then overlap the device's work instead of following it. Every request overlaps:
        what sampling reads of the token still in flight (penalties' counts, placeholders
        in the inputs) the runner takes from the device.

        Structured outputs: when a structured request of step n+1 has its token of step n
        still in flight (``pending_structured_output_tokens``), only the forward of n+1 is
        launched; once step n's tokens are applied (advancing the grammar matchers), the
        bitmask of n+1 is filled and n+1 sampled with it. The device runs the forward of
        n+1 while the host waits for step n and fills the bitmask."""
        in_flight, scheduler = self._in_flight, self.scheduler
        unsampled: SchedulerOutput | None = None
        if not in_flight or (len(in_flight) < 2 and scheduler.has_unfinished_requests()):
            scheduler_output = scheduler.schedule()
            if scheduler_output.is_empty() and len(in_flight) == 0:
                self.structured_output_manager.wait_for_compile(0.01)  # as in step()
            pending = self.executor.execute_model(scheduler_output)
            if pending is None:  # its sampling waits for the bitmask, below
                if not in_flight:
                    raise RuntimeError("a step's structured outputs wait for tokens, but no step is in flight")
                unsampled = scheduler_output
            in_flight.append((scheduler_output, pending))
            if len(in_flight) == 1 and not scheduler_output.is_empty():
                # The pipeline was empty: keep this step running, schedule the next behind it.
                return EngineCoreOutputs(timestamp=time.monotonic())
        scheduler_output, pending = in_flight.popleft()
        assert pending is not None
        outputs = scheduler.update_from_output(scheduler_output, pending.get_output())
        if unsampled is not None:
            # Step n's tokens are applied: the bitmask of step n+1 follows them. A request
            # that finished with step n gets no row; its token of n+1 is dropped on arrival.
            grammar_output = scheduler.get_grammar_bitmask(unsampled)
            in_flight[0] = (unsampled, self.executor.sample_tokens(grammar_output))
        return outputs

    def _step_pipelined(self) -> EngineCoreOutputs:
        """One step of the batch queue (pipeline parallelism): while fewer than
        ``max_concurrent_batches`` micro-batches are in flight, schedule one more (the
        scheduler leaves out requests already in flight) and return at once; otherwise,
        or when nothing more can be scheduled, wait for the oldest and apply its tokens.
        The first stage then works on micro-batch n+1 while the next stage runs n."""
        in_flight, scheduler = self._in_flight, self.scheduler
        if len(in_flight) < self.max_concurrent_batches:
            scheduler_output = scheduler.schedule()
            if not scheduler_output.is_empty() or scheduler_output.finished_req_ids:
                # A step that only drops finished requests goes out too: every stage must
                # forget them, in order with the steps around it.
                in_flight.append((scheduler_output, self.executor.execute_model(scheduler_output)))
                if not scheduler_output.is_empty() and len(in_flight) < self.max_concurrent_batches:
                    return EngineCoreOutputs(timestamp=time.monotonic())
            elif not in_flight:
                self.structured_output_manager.wait_for_compile(0.01)  # as in step()
                return scheduler.update_from_output(scheduler_output, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        scheduler_output, pending = in_flight.popleft()
        assert pending is not None  # steps are sampled at once without async scheduling
        return scheduler.update_from_output(scheduler_output, pending.get_output())

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.executor.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.executor.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.executor.list_loras()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        if self.kv_connector is not None:
            try:
                self.kv_connector.shutdown()
            except Exception:
                logger.exception("KV connector %s raised in shutdown", self.kv_connector.NAME)
        self.executor.shutdown()


def log_kv_cache_size(config: EngineConfig, kv: KVCacheConfig, num_blocks: int) -> None:
    """The KV cache in tokens (one request's longest context it holds) and how many requests
    of ``max_model_len`` tokens fit at once. With sliding-window groups a request holds only
    its window there, so it is counted through the groups' block needs."""
    max_len, batched, block_size = config.model.max_model_len, config.scheduler.max_num_batched_tokens, config.cache.block_size
    if not kv.needs_null_block:  # full attention only: tokens = blocks x block size
        tokens = num_blocks * block_size
        concurrency = tokens / (cdiv(max_len, block_size) * block_size)
        logger.info(
            "KV cache size: %d tokens (%d blocks of %d); maximum concurrency for %d tokens per request: %.2fx",
            tokens, num_blocks, block_size, max_len, concurrency,
        )  # fmt: skip
        return
    # Beyond max_model_len only to report the capacity: the bound keeps the search finite.
    tokens = kv.max_tokens_in(num_blocks - 1, batched, limit=max(max_len, num_blocks * block_size))
    concurrency = (num_blocks - 1) / kv.blocks_per_request(max_len, batched)
    logger.info(
        "KV cache size: %d tokens for one request (%d blocks of %d over %s); maximum concurrency for %d tokens "
        "per request: %.2fx",
        tokens, num_blocks, block_size, kv.describe(), max_len, concurrency,
    )  # fmt: skip
