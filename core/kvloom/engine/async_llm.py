"""AsyncLLM: the asyncio front end used by the OpenAI server.

Requests from concurrent clients are admitted between engine steps (continuous
batching). Each ``generate``/``encode`` call registers a ``RequestOutputCollector`` with
the output processor (``Frontend.add_request(..., queue=...)``); one output-handler task
runs ``process_outputs`` on every engine step and the outputs land in the collectors,
which the calls await. So there is one path from the engine to a caller, with no routing
table here. Streams get one step's tokens per output while their readers keep up: the
handler lets them run between steps; a reader that falls behind, or every reader while
the handler itself is more than ``CATCH_UP_LAG_S`` behind the engine, gets the steps it
missed merged into one output (``RequestOutputCollector``), nothing lost. n > 1 is handled below this class: the front end fans the request out
(``ParentRequest``) and the collector receives the merged outputs under the caller's
request id.

The engine core runs in its own process (``AsyncMPClient``; the output handler reads its
socket in this event loop), or with ``KVLOOM_ENABLE_MULTIPROCESSING=0`` in a thread of
this process (``ThreadedClient``). Closing or cancelling a generator before its request
finished (a client disconnecting) aborts the request, every child of it included. If the
engine core dies, every waiting call raises ``EngineDeadError`` at once, ``check_health``
raises it, and the callbacks given to ``on_engine_dead`` run (the server exits).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from kvloom.config import EngineConfig
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.engine.core_client import AsyncMPClient, ClientAddresses, EngineCoreClient, EngineDeadError, ThreadedClient
from kvloom.engine.frontend import Frontend
from kvloom.engine.output_processor import RequestOutputCollector, RequestOutputStream
from kvloom.inputs import PromptType, RequestInput
from kvloom.lora.request import LoRARequest
from kvloom.outputs import PoolingRequestOutput, RequestOutput
from kvloom.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

#: The front end behind the engine by more than this (seconds): it stops letting streams
#: send between steps, so each stream's missed steps merge into one event until it caught
#: up (its per-step work then falls with the number of events).
CATCH_UP_LAG_S = 0.02


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        stat_loggers: list[Any] | None = None,
        client_index: int = 0,
        client_addresses: ClientAddresses | None = None,
    ) -> None:
        """``client_addresses``: connect to engine cores that a launcher started (this is
        API server ``client_index`` of several) instead of starting one."""
        self.config = config
        self.log_stats = log_stats and not config.observability.disable_log_stats
        if client_addresses is None:
            EngineCoreClient.prepare(config)  # overlaps the tokenizer's load
        self.frontend = Frontend(config, log_stats=self.log_stats)
        self.tokenizer = self.frontend.tokenizer
        self.engine_core: ThreadedClient | AsyncMPClient
        if client_addresses is None:
            client = EngineCoreClient.make_client(config, self.log_stats, asyncio_mode=True)
            assert isinstance(client, (ThreadedClient, AsyncMPClient))  # the asyncio kinds (typed for the reader)
            self.engine_core = client
        else:
            self.engine_core = AsyncMPClient(config, self.log_stats, client_index, client_addresses)
        self.frontend.start_stat_loggers(stat_loggers)
        self._output_handler: asyncio.Task | None = None
        self.errored: BaseException | None = None
        self._dead_callbacks: list[Callable[[BaseException], Any]] = []
        try:  # made inside the event loop (the server): read outputs from the start
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            self._ensure_running()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[Any] | None = None) -> "AsyncLLM":
        """``stat_loggers``: extra stat logger factories, called as ``(config, engine_index)``
        (the server passes ``PrometheusStatLogger``). Their ``log()`` is the caller's to
        call periodically (the server does, every ``log_stats_interval`` seconds)."""
        return cls(create_engine_config(args), stat_loggers=stat_loggers)

    # ------------------------------------------------------------------ plumbing
    def _ensure_running(self) -> None:
        if self.errored is not None:
            raise EngineDeadError(f"engine is dead: {self.errored!r}") from self.errored
        if self._output_handler is None:
            loop = asyncio.get_running_loop()
            self.engine_core.attach(loop)
            self._output_handler = loop.create_task(self._handle_outputs(), name="kvloom-output-handler")

    async def _handle_outputs(self) -> None:
        try:
            while True:
                core_outputs = await self.engine_core.get_output_async()
                # Every request has a collector: the outputs land there, none come back.
                _, to_abort = self.frontend.process(core_outputs)
                if to_abort:
                    self.engine_core.abort_requests(to_abort)
                if not self._behind(core_outputs.timestamp):
                    # Let the streams woken by this step send its tokens before the next
                    # step's outputs land: a step message already waiting is read without
                    # yielding, and its tokens would merge into the unread ones (two tokens
                    # per event, issue 35). A stream that still holds an output then is
                    # one whose client does not keep up; only its outputs merge.
                    await asyncio.sleep(0)
        except Exception as e:  # wake every waiting request with the error
            if isinstance(e, EngineDeadError):
                logger.error("AsyncLLM: %s", e)
            else:
                logger.exception("AsyncLLM output handler failed")
            self.errored = e
            self.frontend.propagate_error(e)
            for callback in self._dead_callbacks:
                try:
                    callback(e)
                except Exception:
                    logger.exception("An on_engine_dead callback failed")

    @staticmethod
    def _behind(timestamp: float) -> bool:
        """Whether the outputs made at ``timestamp`` (the engine core's monotonic clock,
        which processes on one machine share) are more than ``CATCH_UP_LAG_S`` old: the
        front end is falling behind the engine, and its streams coalesce (fewer, larger
        events) until it caught up. An unknown or implausible age counts as not behind."""
        lag = time.monotonic() - timestamp
        return timestamp > 0 and CATCH_UP_LAG_S < lag < 60.0

    def on_engine_dead(self, callback: Callable[[BaseException], Any]) -> None:
        """Call ``callback(error)`` in the event loop once the engine has died (after
        every open request got the error)."""
        self._dead_callbacks.append(callback)

    async def _run(self, request: RequestInput) -> AsyncIterator[Any]:
        stream = self._admit(request)
        async with aclosing(stream):  # cancelled, disconnected or failed: abort it, free its blocks
            async for output in stream:
                yield output

    def _admit(self, request: RequestInput) -> RequestOutputStream:
        self._ensure_running()
        params = request.params
        output_kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
        collector = RequestOutputCollector(output_kind)
        core_requests = self.frontend.add_request(request, queue=collector)
        request_id = request.request_id
        try:
            for core_request in core_requests:
                self.engine_core.add_request(core_request)
        except BaseException:
            self._abort_now(request_id)
            raise
        return RequestOutputStream(request_id, collector, self._abort_now, lambda e: EngineDeadError(
            f"engine failed while serving {request_id}: {e}"))  # fmt: skip

    # ------------------------------------------------------------------ public API
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestOutputStream:
        """Validate, tokenize and admit a request now, and return its output stream (see
        ``RequestOutputStream``). Bad input raises ``ValueError`` here, before anything
        runs; closing the stream before the request finished aborts it. ``generate`` and
        ``encode`` are this plus iteration (their errors come at the first iteration)."""
        request = RequestInput(request_id, prompt, params, lora_request=lora_request, priority=priority,
                               cache_salt=cache_salt)  # fmt: skip
        return self._admit(request)

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        return self._run(RequestInput(request_id, prompt, sampling_params, lora_request=lora_request,
                                      priority=priority, cache_salt=cache_salt))  # fmt: skip

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        return self._run(RequestInput(request_id, prompt, pooling_params, lora_request=lora_request))

    def _abort_now(self, request_id: str) -> None:
        core_ids = self.frontend.abort([request_id])
        self.engine_core.abort_requests(core_ids)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    @property
    def is_dead(self) -> bool:
        return self.errored is not None or self.engine_core.dead_error is not None

    async def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError(f"engine is dead: {self.errored or self.engine_core.dead_error}")

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run the engine core's utility ``method`` between two steps (the names in
        ``kvloom.engine.core_proc.UTILITY_METHODS``)."""
        self._ensure_running()
        return await self.engine_core.call_utility_async(method, *args)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self.call_utility("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.call_utility("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return set(await self.call_utility("list_loras"))

    async def reset_prefix_cache(self) -> bool:
        return await self.call_utility("reset_prefix_cache")

    def get_stat_loggers(self) -> list[Any]:
        return self.frontend.stat_loggers

    def shutdown(self) -> None:
        if self._output_handler is not None:
            self._output_handler.cancel()
        self.frontend.log_stats_at_shutdown()  # the stat loggers' last log(), after the last step's record()
        self.engine_core.shutdown()
