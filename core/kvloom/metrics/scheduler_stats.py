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
class KVTransferCounts:
    """Blocks moved in one direction (a ``transfer_type`` such as ``"GPU_to_CPU"``)."""

    blocks: int = 0
    """KV-cache blocks moved."""
    bytes: int = 0
    """Bytes moved."""
    seconds: float = 0.0
    """Time the transfers took (from issue to completion, as the connector measured it)."""

    def add(self, blocks: int, nbytes: int, seconds: float) -> None:
        """Count ``blocks`` more blocks of ``nbytes`` bytes moved in ``seconds``."""
        self.blocks += blocks
        self.bytes += nbytes
        self.seconds += seconds


@dataclass
class KVTransferStats:
    """What a KV connector did since the last stats (``kvloom.interfaces.KVConnectorBase``):
    the lookups of the scheduler side and the transfers of the worker side."""

    queries: int = 0
    """Tokens of the requests looked up in the connector (vLLM's external prefix cache queries)."""
    hits: int = 0
    """Tokens the connector supplied (vLLM's external prefix cache hits)."""
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    """The hits by where they came from (e.g. ``"cpu"``, ``"disk"``, ``"remote"``): the
    connector's own names."""
    transfers: dict[str, KVTransferCounts] = field(default_factory=dict)
    """Blocks, bytes and seconds by ``transfer_type`` (``"CPU_to_GPU"``, ``"GPU_to_CPU"``,
    ``"disk_to_CPU"``, ...): the connector's own names, vLLM's where it has them."""
    failed_loads: int = 0
    """Requests whose KV failed to load."""
    failed_saves: int = 0
    """Saves that failed (their KV is missing elsewhere later: a miss, or the load's failure)."""

    def count_hit(self, tier: str, tokens: int) -> None:
        """Count ``tokens`` supplied from ``tier``."""
        self.hits_by_tier[tier] = self.hits_by_tier.get(tier, 0) + tokens

    def count_transfer(self, transfer_type: str, blocks: int, nbytes: int, seconds: float) -> None:
        """Count ``blocks`` blocks (``nbytes`` bytes, ``seconds``) moved as ``transfer_type``."""
        self.transfers.setdefault(transfer_type, KVTransferCounts()).add(blocks, nbytes, seconds)

    def merge(self, other: "KVTransferStats | None") -> "KVTransferStats":
        """Add ``other``'s counts to these; returns ``self``."""
        if other is None:
            return self
        self.queries += other.queries
        self.hits += other.hits
        for tier, tokens in other.hits_by_tier.items():
            self.count_hit(tier, tokens)
        for kind, counts in other.transfers.items():
            self.count_transfer(kind, counts.blocks, counts.bytes, counts.seconds)
        self.failed_loads += other.failed_loads
        self.failed_saves += other.failed_saves
        return self

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not (self.queries or self.hits or self.transfers or self.failed_loads or self.failed_saves)


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
    kv_transfer_stats: KVTransferStats | None = None
    """The KV connector's lookups and transfers in this step (None without a connector)."""
