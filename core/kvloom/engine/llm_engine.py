"""LLMEngine: the synchronous front end (input processing -> core -> output processing).

Used by ``LLM`` for offline batches. The engine core runs in its own process
(``SyncMPClient``: it steps on its own, ``step()`` takes the next outputs), or with
``KVLOOM_ENABLE_MULTIPROCESSING=0`` in this thread, one step per ``step()`` call
(``InprocClient``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvloom.config import EngineConfig
from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.engine.core_client import EngineCoreClient, InprocClient, SyncMPClient
from kvloom.engine.frontend import Frontend
from kvloom.inputs import PromptType, RequestInput
from kvloom.lora.request import LoRARequest
from kvloom.metrics.loggers import PrometheusStatLogger
from kvloom.metrics.reader import Metric, get_metrics_snapshot
from kvloom.outputs import PoolingRequestOutput, RequestOutput
from kvloom.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Stats (the logging stat logger and the stat logger plugins) are on unless
    ``config.observability.disable_log_stats``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.log_stats = log_stats = not config.observability.disable_log_stats
        EngineCoreClient.prepare(config)  # overlaps the tokenizer's load
        self.frontend = Frontend(config, log_stats=log_stats)
        self.tokenizer = self.frontend.tokenizer
        client = EngineCoreClient.make_client(config, log_stats, asyncio_mode=False)
        assert isinstance(client, (InprocClient, SyncMPClient))  # the synchronous kinds (typed for the reader)
        self.engine_core: InprocClient | SyncMPClient = client
        # A Prometheus registry of its own, read by get_metrics() (vLLM's LLM keeps one too).
        self.frontend.start_stat_loggers(stat_loggers=[PrometheusStatLogger])

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(create_engine_config(args))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        request = RequestInput(request_id, prompt, params, arrival_time, lora_request, priority, cache_salt)
        for core_request in self.frontend.add_request(request):
            self.engine_core.add_request(core_request)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        core_outputs = self.engine_core.get_output()
        request_outputs, to_abort = self.frontend.process(core_outputs)
        self.engine_core.abort_requests(to_abort)
        self.frontend.maybe_log_stats(time.monotonic())
        return request_outputs

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.frontend.abort(ids))

    def has_unfinished_requests(self) -> bool:
        return self.frontend.has_unfinished_requests() or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.frontend.num_unfinished_requests()

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run the engine core's utility ``method`` (the names in
        ``kvloom.engine.core_proc.UTILITY_METHODS``) between two steps."""
        return self.engine_core.call_utility(method, *args)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return set(self.call_utility("list_loras"))

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def get_metrics(self) -> list[Metric]:
        """The engine's Prometheus metrics now (``kvloom.metrics.reader``); stats must be on."""
        for stat_logger in self.frontend.stat_loggers:
            if isinstance(stat_logger, PrometheusStatLogger):
                return get_metrics_snapshot(stat_logger.registry)
        raise ValueError("get_metrics: engine stats are off; start the engine without disable_log_stats=True")

    def shutdown(self) -> None:
        self.frontend.log_stats_at_shutdown()  # the stat loggers' last log(), after the last step's record()
        self.engine_core.shutdown()
