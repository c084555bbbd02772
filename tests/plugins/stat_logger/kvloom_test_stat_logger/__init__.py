"""StepCountingLogger: counts engine steps and the peak number of running requests."""

from __future__ import annotations

import logging
from typing import Any

from kvloom.interfaces import StatLoggerBase

KVLOOM_PLUGIN_API = "1.0"

logger = logging.getLogger(__name__)


class StepCountingLogger(StatLoggerBase):
    def __init__(self, config: Any, engine_index: int = 0) -> None:
        super().__init__(config, engine_index)
        self.num_steps = 0
        self.peak_running = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        self.num_steps += 1
        if scheduler_stats is not None:
            self.peak_running = max(self.peak_running, scheduler_stats.num_running_reqs)

    def log(self) -> None:
        logger.info(
            "engine %d: %d steps, peak %d running requests", self.engine_index, self.num_steps, self.peak_running
        )
