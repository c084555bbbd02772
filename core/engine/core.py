"""EngineCore: the inner loop. Scheduler + worker, one step at a time.

``step()`` is schedule -> execute -> update; everything the front end needs comes back
in ``EngineCoreOutputs`` (new tokens, finish reasons, event timestamps, scheduler stats).
The core holds no text and no tokenizer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from kvloom.config import EngineConfig
from kvloom.outputs import EngineCoreOutputs
from kvloom.request import EngineCoreRequest, Request, RequestStatus

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class EngineCore:
    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        from kvloom import registry
        from kvloom.scheduler.scheduler import Scheduler

        # Plugins load in every process that runs an engine core (idempotent).
        registry.load_plugins()
        self.config = config
        platform = config.platform
        worker_cls = platform.get_worker_cls()
        start = time.perf_counter()
        self.worker = worker_cls(config, platform)
        self.worker.init_device()
        self.worker.load_model()
        num_blocks = self.worker.determine_num_kv_blocks()
        needed = cdiv(config.model.max_model_len, config.cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks of {config.cache.block_size} tokens, fewer than "
                f"the {needed} blocks one request of max_model_len={config.model.max_model_len} needs. "
                "Raise --kv-cache-memory / --gpu-memory-utilization or lower --max-model-len."
            )
        self.worker.initialize_cache(num_blocks)
        config.cache.num_blocks = num_blocks
        self.worker.compile_or_warm_up_model()
        logger.info("Engine core ready in %.1f s (%d KV blocks)", time.perf_counter() - start, num_blocks)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            log_stats=log_stats,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
        )

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def finish_requests_stopped(self, request_ids: Iterable[str]) -> None:
        """Requests the front end finished (stop strings)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Requests to run, or finished/aborted ones whose outputs are not reported yet."""
        return self.scheduler.has_requests()

    # ------------------------------------------------------------------ loop
    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.worker.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request) -> bool:  # type: ignore[no-untyped-def]
        return self.worker.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.worker.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.worker.list_loras()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.worker.shutdown()
