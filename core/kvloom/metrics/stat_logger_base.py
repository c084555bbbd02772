"""The stat logger plugin contract.

Stat loggers register in ``kvloom.stat_logger_plugins``; the entry point names a class
that subclasses ``StatLoggerBase`` (anything else is a TypeError at load time). The front
end calls ``record`` after every engine step and ``log`` periodically.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.metrics.stats import IterationStats, SchedulerStats


class StatLoggerBase(ABC):
    """Receives the engine's statistics: one instance per engine, built with
    ``(config, engine_index)`` when the engine logs stats (``self.config``,
    ``self.engine_index``). ``record`` runs after every engine step, ``log`` every
    ``log_stats_interval`` seconds, ``log_engine_initialized`` once the engine is up."""

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
        """Called once per engine step with that step's stats."""

    def log(self) -> None:
        """Called periodically (every few seconds) to publish a summary."""

    def log_engine_initialized(self) -> None:
        """Called once after the engine is up."""
