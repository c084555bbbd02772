"""A stat logger plugin for kvloom's server tests.

Every call is appended as one JSON line to the file named by the environment variable
KVLOOM_TEST_STAT_LOGGER_OUT: an "init" line when the engine makes the logger, a "record"
line per engine step, a "log" line per periodic log call.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvloom.interfaces import StatLoggerBase

KVLOOM_PLUGIN_API = "1.0"


class ProbeStatLogger(StatLoggerBase):
    def __init__(self, config: Any, engine_index: int = 0) -> None:
        super().__init__(config, engine_index)
        self.path = os.environ["KVLOOM_TEST_STAT_LOGGER_OUT"]
        self._write({"event": "init", "model_name": config.model.served_model_name, "engine_index": engine_index})

    def _write(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        entry: dict[str, Any] = {"event": "record"}
        if scheduler_stats is not None:
            entry["running"] = scheduler_stats.num_running_reqs
            entry["waiting"] = scheduler_stats.num_waiting_reqs
            entry["kv_cache_usage"] = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            entry["prompt_tokens"] = iteration_stats.num_prompt_tokens
            entry["generation_tokens"] = iteration_stats.num_generation_tokens
            entry["finished"] = [str(r.finish_reason) for r in iteration_stats.finished_requests]
        self._write(entry)

    def log(self) -> None:
        self._write({"event": "log"})

    def log_engine_initialized(self) -> None:
        self._write({"event": "engine_initialized"})
