"""The KV connector's part of the scheduler: the connector's scheduler side, called by the
scheduler at a few points, with the bookkeeping the connector contract needs.

The scheduler calls it where a waiting request is admitted (``lookup``, then
``after_alloc``), when a step's output is built (``build_step``), when the model runner's
output comes back (``update_from_output``) and when a request ends (``free_request``).

* **Lookup.** After the local prefix-cache lookup, ``get_num_new_matched_tokens`` says
  how many more tokens the connector supplies. Synchronous ones are loaded in the step
  that computes the rest; their blocks are cached at once, as computed ones are.
  Asynchronous ones get their blocks, uncached, and the request waits
  (``WAITING_FOR_REMOTE_KVS``, keeping its place in the queue) until the worker side
  reports it in ``finished_recving``; then its loaded blocks are cached and it is admitted
  again with them, computing only the rest.
* **Failures.** A connector call that raises, or answers what it may not, fails the
  request it concerns (the scheduler finishes it with ``FinishReason.ERROR``). Blocks
  that failed to load asynchronously follow ``kv_load_failure_policy``: ``fail`` fails the
  request, ``recompute`` keeps the blocks before the first failed one and computes the
  rest. A failed synchronous load surfaces in the step whose forward read it: the model
  runner's part fails the request.
* **Request ends.** ``request_finished`` may keep a request's blocks (an asynchronous save
  or send) until the worker side reports it in ``finished_sending``; a request aborted while
  its KV is loading keeps its blocks until the load is reported. The engine keeps stepping
  while any of that is pending (``has_pending``).
* **Block hashes.** Connectors key blocks by hash: with prefix caching off, the hashes are
  computed here, with the same algorithm.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvloom.kv_cache.hashing import get_hash_function, update_block_hashes
from kvloom.kv_transfer.base import KVConnectorBase, KVConnectorStep, ScheduledKVRequest
from kvloom.metrics.scheduler_stats import KVTransferStats
from kvloom.request import Request, RequestStatus
from kvloom.scheduler.output import KVTransferStep

if TYPE_CHECKING:
    from kvloom.kv_cache.coordinator import KVCacheBlocks
    from kvloom.kv_cache.manager import KVCacheManager
    from kvloom.kv_transfer.output import KVConnectorReport

logger = logging.getLogger(__name__)


@dataclass
class Found:
    """What a waiting request starts from: the local prefix-cache hits, the tokens the
    connector supplies and how."""

    blocks: KVCacheBlocks
    """Local cache hits to take (empty for a request that holds its blocks already)."""
    num_hits: int
    """Tokens whose KV is in the cache: the local hits, or what the blocks a request holds
    after its asynchronous load contain."""
    num_external: int = 0
    """Tokens the connector supplies after them."""
    load_async: bool = False
    """Whether they arrive asynchronously (the request then waits for them)."""
    holds_blocks: bool = False
    """Whether the request comes back with its blocks (its asynchronous load is done)."""


def record_local_lookup(kv: KVCacheManager, request: Request, found: Found) -> None:
    """Count an admitted request's prefix-cache lookup (once: not again when it comes back
    with the blocks its asynchronous load filled)."""
    if kv.enable_caching and not request.skip_prefix_cache_reading and not found.holds_blocks:
        kv.record_prefix_cache_query(request.num_tokens, found.num_hits)


class NoConnector:
    """The scheduler's part when no KV connector runs: the local prefix cache alone."""

    connector = None

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv = kv_cache_manager

    def lookup(self, request: Request) -> Found:
        return Found(*self.kv.get_computed_blocks(request))

    def after_alloc(self, request: Request, found: Found) -> None:
        record_local_lookup(self.kv, request, found)

    def build_step(self, step: Any, finished_req_ids: set[str], requests: dict[str, Request]) -> None:
        return None

    def _block_table(self, request_id: str) -> tuple[list[int], ...]:
        return self.kv.get_block_ids(request_id)

    def update_from_output(self, report: KVConnectorReport | None) -> None:
        return None

    def free_request(self, request: Request) -> None:
        self.kv.free(request)

    def has_pending(self) -> bool:
        return False

    def take_stats(self) -> None:
        return None


def scheduler_part(
    connector: KVConnectorBase | None, kv_cache_manager: KVCacheManager, hash_algo: str
) -> SchedulerConnector | NoConnector:
    """The scheduler's part for ``connector`` (its scheduler side), or for none."""
    return NoConnector(kv_cache_manager) if connector is None else SchedulerConnector(connector, kv_cache_manager,
                                                                                        hash_algo)  # fmt: skip


class SchedulerConnector:
    """The connector's scheduler side with the bookkeeping around it (module docstring)."""

    def __init__(self, connector: KVConnectorBase, kv_cache_manager: KVCacheManager, hash_algo: str) -> None:
        self.connector = connector
        self.name = type(connector).NAME
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.hash_fn = kv_cache_manager.hash_fn or get_hash_function(hash_algo)
        self.fail_on_load_error = connector.transfer_config.kv_load_failure_policy == "fail"
        self._loading: dict[str, tuple[int, int]] = {}  # async loads in flight: id -> (hits, external)
        self._received: dict[str, set[int]] = {}  # loads reported done: id -> its failed blocks
        self._holding: dict[str, int] = {}  # loaded, to be admitted again with their blocks: id -> tokens
        self._kept: dict[str, Request] = {}  # ended, blocks kept until their transfer is reported
        self._sync_loads: dict[str, list[int]] = {}  # this step's synchronous loads
        self._async_loads: dict[str, list[int]] = {}  # this step's new asynchronous loads
        self._stats = KVTransferStats()

    # ------------------------------------------------------------------ admission

    def lookup(self, request: Request) -> Found | str | None:
        """Where a waiting request starts: ``Found``; None while its KV is still arriving
        or the connector asks to be asked later (it keeps its place); a message when it
        fails (the connector raised, its load failed under the ``fail`` policy, or it
        answered what it may not)."""
        request_id = request.request_id
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if request_id not in self._received:
                return None
            failure = self._finish_load(request)
            if failure is not None:
                return failure
        if request_id in self._holding:
            return Found(self.kv.empty_blocks(), self._holding[request_id], holds_blocks=True)
        computed_blocks, num_hits = self.kv.get_computed_blocks(request)
        if request.skip_prefix_cache_reading:  # it needs every prompt position computed
            return Found(computed_blocks, num_hits)
        update_block_hashes(request, self.block_size, self.hash_fn)
        try:
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hits)
        except Exception as exc:
            return self._raised("get_num_new_matched_tokens", request, exc)
        if num_external is None:
            return None
        limit = request.num_tokens - 1 - num_hits
        if not isinstance(num_external, int) or not 0 <= num_external <= limit:
            return (f"KV connector {self.name}: get_num_new_matched_tokens answered {num_external!r} tokens, "
                    f"outside 0..{limit} (the request has {request.num_tokens} tokens, {num_hits} cached)")  # fmt: skip
        return Found(computed_blocks, num_hits, num_external, bool(load_async) and num_external > 0)

    def after_alloc(self, request: Request, found: Found) -> str | None:
        """The request's blocks are allocated: tell the connector; an asynchronous load makes
        it wait (``WAITING_FOR_REMOTE_KVS``). A message when the connector raised."""
        request_id = request.request_id
        record_local_lookup(self.kv, request, found)
        if found.holds_blocks:
            del self._holding[request_id]
            return None
        block_ids = self.kv.get_block_ids(request_id)
        request.num_computed_tokens = found.num_hits  # the connector's tokens follow the local hits
        try:
            self.connector.update_state_after_alloc(request, block_ids, found.num_external)
        except Exception as exc:
            return self._raised("update_state_after_alloc", request, exc)
        self._stats.queries += request.num_tokens
        if not found.num_external:
            return None
        self._stats.hits += found.num_external
        first, end = found.num_hits // self.block_size, -(-(found.num_hits + found.num_external) // self.block_size)
        loaded = block_ids[0][first:end]
        if found.load_async:
            self._loading[request_id] = (found.num_hits, found.num_external)
            self._async_loads[request_id] = loaded
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        else:
            self._sync_loads[request_id] = loaded
        return None

    def _finish_load(self, request: Request) -> str | None:
        """Its asynchronous load was reported: cache what arrived and admit it again with
        its blocks, or fail it (``fail`` policy, a block missing)."""
        request_id = request.request_id
        failed = self._received.pop(request_id)
        num_hits, num_external = self._loading.pop(request_id)
        num_tokens = num_hits + num_external
        if failed:
            self._stats.failed_loads += 1
            block_ids = self.kv.get_block_ids(request_id)[0]
            first_bad = min((i for i, b in enumerate(block_ids) if b in failed), default=len(block_ids))
            logger.warning("Request %s: %d block(s) failed to load through KV connector %s (policy %s)",
                           request_id, len(failed), self.name, "fail" if self.fail_on_load_error else "recompute")  # fmt: skip
            if self.fail_on_load_error:
                return f"KV connector {self.name}: {len(failed)} KV-cache block(s) of the request failed to load"
            num_tokens = max(num_hits, min(num_tokens, first_bad * self.block_size))
        self.kv.cache_blocks(request, num_tokens)
        # Admitted like a request whose prefix cache hits it already holds: allocate_slots
        # counts them from ``num_hits`` (0 computed so far).
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._holding[request_id] = num_tokens
        return None

    def _raised(self, method: str, request: Request, exc: Exception) -> str:
        logger.exception("KV connector %s raised in %s for request %s", self.name, method, request.request_id)
        return f"KV connector {self.name} failed in {method} ({type(exc).__name__}: {exc})"

    # ------------------------------------------------------------------ the step

    def build_step(self, plan: Any, finished_req_ids: set[str], requests: dict[str, Request]) -> KVTransferStep:
        """The connector's metadata for the scheduler's step ``plan`` (its new and running
        requests, their token counts) with the step's loads; a connector that raises loses
        the step's loads (they fail), not the step."""
        num_scheduled = plan.num_scheduled_tokens
        scheduled = [
            ScheduledKVRequest(requests[r.req_id], r.num_computed_tokens, num_scheduled[r.req_id], is_new,
                               functools.partial(self._block_table, r.req_id))
            for is_new, group in ((True, plan.new_reqs), (False, plan.cached_reqs))
            for r in group
        ]
        finished = set(finished_req_ids)
        step = KVConnectorStep(scheduled, finished, {r for r in finished if r in requests})
        try:
            metadata = self.connector.build_connector_meta(step)
        except Exception:
            logger.exception("KV connector %s raised in build_connector_meta: the loads of this step fail", self.name)
            metadata = None
        data = KVTransferStep(metadata, self._sync_loads, self._async_loads)
        self._sync_loads, self._async_loads = {}, {}
        return data

    def _block_table(self, request_id: str) -> tuple[list[int], ...]:
        return self.kv.get_block_ids(request_id)

    def update_from_output(self, report: KVConnectorReport | None) -> None:
        """Apply the worker side's report of a step: loads and sends that completed,
        blocks that failed to load, transfer counts."""
        if report is None:
            return
        output = report.output
        try:
            self.connector.update_connector_output(output)
        except Exception:
            logger.exception("KV connector %s raised in update_connector_output", self.name)
        invalid = output.invalid_block_ids
        for request_id in output.finished_recving:
            if request_id in self._loading:
                failed = set()
                if invalid:
                    failed = invalid.intersection(self.kv.get_block_ids(request_id)[0])
                self._received[request_id] = failed
            if request_id in self._kept and request_id not in output.finished_sending:
                self._release(request_id)  # aborted while it was loading
        for request_id in output.finished_sending:
            if request_id in self._kept:
                self._release(request_id)
        self._stats.merge(report.stats)

    # ------------------------------------------------------------------ request ends

    def free_request(self, request: Request) -> dict[str, Any] | None:
        """Free an ended request's blocks now, or once its transfer is reported; its output
        ``kv_transfer_params``."""
        request_id = request.request_id
        self._holding.pop(request_id, None)
        loaded = self._received.pop(request_id, None) is not None
        keep, params = False, None
        try:
            keep, params = self.connector.request_finished(request, self.kv.get_block_ids(request_id))
        except Exception:
            logger.exception("KV connector %s raised in request_finished for request %s", self.name, request_id)
        if self._loading.pop(request_id, None) is not None and not loaded:  # its load still writes into its blocks
            keep = True
        if keep:
            self._kept[request_id] = request
        else:
            self.kv.free(request)
        return params

    def _release(self, request_id: str) -> None:
        self.kv.free(self._kept.pop(request_id))

    def has_pending(self) -> bool:
        """Whether transfers are still to be reported (loads in flight, blocks kept)."""
        return bool(self._loading or self._kept)

    def take_stats(self) -> KVTransferStats:
        """The lookups and transfers since the last call."""
        stats, self._stats = self._stats, KVTransferStats()
        try:
            stats.merge(self.connector.take_stats())
        except Exception:
            logger.exception("KV connector %s raised in take_stats", self.name)
        return stats

