"""The scheduler's side of speculative decoding.

A running request carries the drafts the proposer made after its last step
(``Request.spec_token_ids``). ``Scheduler.schedule`` spends budget on them like on any new
token (one decode token plus the drafts, within ``max_num_batched_tokens`` and
``max_model_len``) and sends them in ``SchedulerOutput.scheduled_spec_decode_tokens``; the
KV cache is asked for ``num_lookahead_tokens`` more slots (a draft model writes its drafts'
KV there after the step). When the step comes back with the emitted tokens (the accepted
drafts and one more), ``Speculation.verified``:

- rolls ``num_computed_tokens`` back over the rejected drafts (their KV is stale);
- gives back the request's blocks past what it still needs (``KVCacheManager.free_tail``):
  the rejected drafts' slots return to the pool, and the runner learns the shortened block
  table with the request's next ``CachedRequestData.num_kept_blocks``;
- counts the drafts and acceptances per position (``SpecDecodingStats``).

``take_drafts`` then keeps the step's new drafts: at most what the request may still
produce (``max_tokens``, ``max_model_len``) and, for a structured request, the prefix its
grammar allows (the bitmask of the next step has one row per verified position). Prefix
caching sees accepted tokens only: drafts never enter ``all_token_ids``, which the block
hashes cover.
"""

from __future__ import annotations

import logging

from kvloom.config import SpeculativeConfig
from kvloom.kv_cache.manager import KVCacheManager
from kvloom.metrics.scheduler_stats import SpecDecodingStats
from kvloom.request import Request
from kvloom.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Speculation:
    """Drafts, rollback and block trimming for the scheduler (see the module docstring)."""

    def __init__(self, speculative: SpeculativeConfig, kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.num_spec_tokens = speculative.num_speculative_tokens
        self.num_lookahead_tokens = speculative.num_lookahead_tokens
        self.kv_cache_manager = kv_cache_manager
        self.stats = self._new_stats()
        #: Requests whose block table was shortened since they were last scheduled: blocks kept.
        self.kept_blocks: dict[str, int] = {}

    def _new_stats(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_spec_tokens, num_accepted_tokens_per_pos=[0] * self.num_spec_tokens)

    def verified(self, request: Request, num_drafts: int, num_emitted: int) -> None:
        """The step verified ``num_drafts`` drafts of ``request`` and emitted ``num_emitted``
        tokens (the accepted drafts and one more; 0 if it failed)."""
        num_accepted = max(num_emitted - 1, 0)
        request.num_computed_tokens -= num_drafts - num_accepted
        request.spec_token_ids = []
        # The slots a request still needs: its computed tokens, the next one, the lookahead.
        needed = min(request.num_computed_tokens + max(1, self.num_lookahead_tokens), self.max_model_len)
        kept = self.kv_cache_manager.free_tail(request, needed)
        self.kept_blocks[request.request_id] = kept
        if num_emitted:
            self.stats.observe(num_drafts, num_accepted)

    def take_drafts(
        self, request: Request, drafts: list[int], max_num_tokens: int, structured: StructuredOutputManager | None
    ) -> None:
        """Keep ``drafts`` for the request's next step: no more than it may still emit after
        its next token (``max_num_tokens`` in all), and for a structured request (``structured``
        given) the prefix its grammar accepts."""
        room = min(max_num_tokens - request.num_tokens - 1, self.num_spec_tokens)
        if room <= 0 or not drafts:
            request.spec_token_ids = []
            return
        drafts = drafts[:room]
        if structured is not None:
            drafts = drafts[: structured.valid_draft_prefix(request, drafts)]
        request.spec_token_ids = drafts

    def forget(self, request_id: str) -> None:
        """The request left the running batch (finished or preempted)."""
        self.kept_blocks.pop(request_id, None)

    def take_stats(self) -> SpecDecodingStats:
        """The counts since the last call (the scheduler's stats take them each step when
        stats are on; they are kept either way, a few integers)."""
        stats, self.stats = self.stats, self._new_stats()
        return stats
