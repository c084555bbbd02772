"""JsonLinesStatLogger: every engine step's stats, as JSON lines in ``$KVLOOM_STATS_JSONL``.

Lines: ``{"event": "init", ...}`` when the engine builds the logger,
``{"event": "engine_initialized", ...}`` once the engine is up, ``{"event": "record",
"scheduler": {...} | null, "iteration": {...} | null}`` after every engine step (the
dataclasses as dicts), and ``{"event": "log", ...}`` at every summary: when
``--log-stats-interval`` seconds have passed (checked after each step), and once more when
the engine shuts down.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from kvloom.interfaces import EngineConfig, IterationStats, SchedulerStats, StatLoggerBase

KVLOOM_PLUGIN_API = "1.0"

PATH_ENV = "KVLOOM_STATS_JSONL"

logger = logging.getLogger(__name__)


class JsonLinesStatLogger(StatLoggerBase):
    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        super().__init__(config, engine_index)  # sets self.config, self.engine_index
        self.path = os.environ.get(PATH_ENV)  # unset: this logger stays silent
        self.steps = 0
        self.generation_tokens = 0
        self._write({"event": "init", "model": config.model.served_model_name, "engine_index": engine_index})

    def _write(self, entry: dict[str, Any]) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def log_engine_initialized(self) -> None:
        cache = self.config.cache
        self._write({"event": "engine_initialized", "num_blocks": cache.num_blocks, "block_size": cache.block_size})

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None, engine_idx: int = 0
    ) -> None:
        self.steps += 1
        if iteration_stats is not None:
            self.generation_tokens += iteration_stats.num_generation_tokens
        self._write({
            "event": "record",
            "engine_idx": engine_idx,
            # FinishReason is a str enum: json writes "stop" / "length" / "abort".
            "scheduler": dataclasses.asdict(scheduler_stats) if scheduler_stats is not None else None,
            "iteration": dataclasses.asdict(iteration_stats) if iteration_stats is not None else None,
        })  # fmt: skip

    def log(self) -> None:
        logger.info("engine %d: %d steps, %d tokens generated", self.engine_index, self.steps, self.generation_tokens)
        self._write({"event": "log", "steps": self.steps, "generation_tokens": self.generation_tokens})
