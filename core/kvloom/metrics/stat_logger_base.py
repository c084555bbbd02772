"""The stat logger plugin contract.

Stat loggers register in ``kvloom.stat_logger_plugins``; the entry point names a class
that subclasses ``StatLoggerBase`` (anything else is a TypeError at load time). The front
end calls ``record`` after every engine step, ``log`` when ``log_stats_interval`` seconds
have passed and once more when the engine shuts down (``docs/plugins.md``, "A stat
logger", says exactly when).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.metrics.scheduler_stats import SchedulerStats
    from kvloom.metrics.stats import IterationStats


class StatLoggerBase(ABC):
    """Receives the engine's statistics: one instance per engine, built with
    ``(config, engine_index)`` when the engine logs stats (``self.config``,
    ``self.engine_index``). ``log_engine_initialized`` runs once the engine is up,
    ``record`` after every engine step, ``log`` when ``log_stats_interval`` seconds (> 0)
    have passed (offline: checked after each step; ``kvloom serve``: on a timer) and once
    more when the engine shuts down, after the last step's ``record``."""

    def __init__(self, config: "EngineConfig", engine_index: int = 0) -> None:
        self.config = config
        self.engine_index = engine_index

    @abstractmethod
    def record(
        self,
        scheduler_stats: "SchedulerStats | None",
        iteration_stats: "IterationStats | None",
        engine_idx: int = 0,
    ) -> None:
        """Called after every engine step with that step's stats, on the front end; either
        argument may be None. Must not raise: an exception fails the step."""

    def log(self) -> None:
        """Publish a summary: called when ``log_stats_interval`` seconds have passed since
        the last call, and once more when the engine shuts down (after the last
        ``record``). An exception is logged and skipped."""

    def log_engine_initialized(self) -> None:
        """Called once after the engine is up."""
