"""Speculative decoding's statistics for the stat loggers (vLLM's spec-decode metrics).

``SpecDecodingLogging`` sums the scheduler's ``SpecDecodingStats`` over a logging interval
and writes vLLM's line::

    SpecDecoding metrics: Mean acceptance length: 2.53, Accepted throughput: 31.50 tokens/s,
    Drafted throughput: 61.50 tokens/s, Accepted: 315 tokens, Drafted: 615 tokens,
    Per-position acceptance rate: 0.780, 0.522, 0.234, Avg Draft acceptance rate: 51.2%

(mean acceptance length: tokens per verified draft, 1 + accepted / drafts).
``SpecDecodingProm`` keeps the counters ``spec_decode_num_drafts``,
``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
``spec_decode_num_accepted_tokens_per_pos`` (label ``position``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from kvloom.metrics.scheduler_stats import SpecDecodingStats


class SpecDecodingLogging:
    """The interval's speculative-decoding counts and their summary line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def observe(self, stats: SpecDecodingStats) -> None:
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        if len(self.accepted_per_pos) < len(stats.num_accepted_tokens_per_pos):
            self.accepted_per_pos += [0] * (len(stats.num_accepted_tokens_per_pos) - len(self.accepted_per_pos))
        for pos, count in enumerate(stats.num_accepted_tokens_per_pos):
            self.accepted_per_pos[pos] += count

    def line(self, elapsed: float) -> str | None:
        """The summary of the interval (``elapsed`` seconds), or None when nothing was drafted."""
        if self.num_drafts == 0:
            return None
        per_pos = ", ".join(f"{count / self.num_drafts:.3f}" for count in self.accepted_per_pos)
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + self.num_accepted_tokens / self.num_drafts:.2f}, "
            f"Accepted throughput: {self.num_accepted_tokens / elapsed:.2f} tokens/s, "
            f"Drafted throughput: {self.num_draft_tokens / elapsed:.2f} tokens/s, "
            f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: {rate * 100:.1f}%"
        )


class SpecDecodingProm:
    """vLLM's spec-decode counters, one series per engine core (``engine`` label)."""

    def __init__(self, name: Callable[[str], str], registry: CollectorRegistry, model_name: str, engines: list[str],
                 num_spec_tokens: int) -> None:  # fmt: skip
        labels = ["model_name", "engine"]

        def counter(metric: str, doc: str) -> list[Any]:
            family = Counter(name(metric), doc, labels, registry=registry)
            return [family.labels(model_name, engine) for engine in engines]

        self.num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = Counter(name("spec_decode_num_accepted_tokens_per_pos"), "Accepted tokens per draft position.",
                          [*labels, "position"], registry=registry)  # fmt: skip
        self.accepted_per_pos = [[per_pos.labels(model_name, engine, str(pos)) for pos in range(num_spec_tokens)]
                                 for engine in engines]  # fmt: skip

    def observe(self, stats: SpecDecodingStats, engine_idx: int) -> None:
        self.num_drafts[engine_idx].inc(stats.num_drafts)
        self.num_draft_tokens[engine_idx].inc(stats.num_draft_tokens)
        self.num_accepted_tokens[engine_idx].inc(stats.num_accepted_tokens)
        for counter, count in zip(self.accepted_per_pos[engine_idx], stats.num_accepted_tokens_per_pos):
            counter.inc(count)
