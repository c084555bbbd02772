"""The scheduler's statistics of one step: ``SchedulerStats`` and its ``PrefixCacheStats``.

Made in the engine core and sent to the front end in ``EngineCoreOutputs``
(``kvloom.outputs``), which is why they sit in a module of their own that imports nothing
of kvloom: the outputs name them, and the front end's statistics (``kvloom.metrics.stats``)
name the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups of one step (``reset``: the cache was reset in it)."""

    requests: int = 0
    """Requests whose prompt was looked up."""
    queries: int = 0
    """Tokens looked up."""
    hits: int = 0
    """Tokens found in the cache."""
    reset: bool = False
    """Whether the prefix cache was reset in this step."""


@dataclass
class SchedulerStats:
    """The scheduler's state after one step."""

    num_running_reqs: int = 0
    """Requests running (scheduled) after the step."""
    num_waiting_reqs: int = 0
    """Requests waiting (queued or preempted) after the step."""
    kv_cache_usage: float = 0.0
    """Fraction of KV-cache blocks in use, 0..1."""
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    """The step's prefix-cache lookups."""
    num_preemptions: int = 0
    """Preemptions in this step."""
    structured_output_compile_times: list[float] = field(default_factory=list)
    """Seconds each grammar compiled since the last stats (structured outputs)."""
    structured_output_cache_queries: int = 0
    """Structured requests that looked their grammar up in the compiled-grammar cache."""
    structured_output_cache_hits: int = 0
    """Those that found it there (compiled, or compiling for another request)."""
