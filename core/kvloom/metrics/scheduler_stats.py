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
class SpecDecodingStats:
    """Speculative decoding's verifications of one step (vLLM's ``SpecDecodingStats``)."""

    num_spec_tokens: int = 0
    """Draft tokens per request and step (``num_speculative_tokens``)."""
    num_drafts: int = 0
    """Requests whose drafts were verified (one per request and step with drafts)."""
    num_draft_tokens: int = 0
    """Draft tokens verified."""
    num_accepted_tokens: int = 0
    """Draft tokens accepted."""
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """Per draft position (0 .. num_spec_tokens - 1): drafts accepted there."""

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: ``num_draft_tokens`` drafts, the first
        ``num_accepted_tokens`` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for pos in range(num_accepted_tokens):
            per_pos[pos] += 1


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
    spec_decoding_stats: SpecDecodingStats | None = None
    """Speculative decoding's verifications in this step (None: speculation off)."""
