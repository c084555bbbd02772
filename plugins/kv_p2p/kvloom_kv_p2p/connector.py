"""``P2pNcclConnector``: disaggregated prefill and decode, one prefill instance
(``kv_producer``, ``kv_rank`` 0) and one decode instance (``kv_consumer``, ``kv_rank`` 1)
moving KV blocks over a ``torch.distributed`` group of their own (``kvloom_kv_p2p.link``).

A proxy sends a request to the prefill instance with ``kv_transfer_params``
``{"do_remote_decode": true}`` (and ``max_tokens`` 1). When it ends, the prefill instance
keeps its blocks and answers ``kv_transfer_params`` for the decode instance
(``do_remote_prefill``, ``remote_block_ids``, ``remote_request_id``, ...). The proxy sends
the request with those to the decode instance, which finds the prompt's full blocks
there past its own prefix-cache hits (all but the last token's block), pulls them
asynchronously (the request waits, ``WAITING_FOR_REMOTE_KVS``, while others run) and
computes only the rest. The prefill instance frees the blocks once sent, or after
``abort_request_timeout_s`` if never pulled. A pull that fails follows
``kv_load_failure_policy`` (the request fails, or its KV is computed).

Options (``kv_connector_extra_config``): ``abort_request_timeout_s`` (default 120: how
long the prefill instance holds blocks nobody pulls), ``timeout_s`` (default 30:
connecting and each transfer).
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvloom.interfaces import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorRole,
    KVConnectorStep,
    KVLayerCache,
    KVTransferStats,
    kv_layout_fingerprint,
)
from kvloom_kv_p2p.link import ConsumerLink, ProducerLink
from kvloom_kv_p2p.params import check_params, remote_blocks

logger = logging.getLogger(__name__)

#: The tier name of this connector's hits in the stats.
TIER = "remote"
#: ``kv_rank`` of each role in a 1P1D pair.
RANKS = {"kv_producer": 0, "kv_consumer": 1}
DEFAULTS = {"abort_request_timeout_s": 120.0, "timeout_s": 30.0}


@dataclass
class Pull:
    """Blocks of one request to pull: the producer's, into ours (none: a release)."""

    request_id: str
    remote_request_id: str
    remote_block_ids: list[int]
    block_ids: list[int]


@dataclass
class P2pMetadata(KVConnectorMetadata):
    """One step's work: prefills whose blocks to hold for the consumer (producer), pulls to
    start (consumer)."""

    offers: list[tuple[str, list[int]]] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)


class P2pNcclConnector(KVConnectorBase):
    """One prefill and one decode instance over ``torch.distributed`` (module docstring)."""

    NAME = "P2pNcclConnector"
    extra_config_keys = tuple(DEFAULTS)

    @classmethod
    def validate_config(cls, config: Any) -> list[str]:
        reasons = super().validate_config(config)
        transfer = config.kv_transfer
        if transfer.kv_role not in RANKS:
            reasons.append(f"kv_role: {transfer.kv_role!r} is not supported by {cls.NAME} (allowed: kv_producer for "
                           "the prefill instance, kv_consumer for the decode instance)")  # fmt: skip
        elif transfer.kv_rank is not None and transfer.kv_rank != RANKS[transfer.kv_role]:
            reasons.append(f"kv_rank: a {transfer.kv_role} is rank {RANKS[transfer.kv_role]} of the pair, got "
                           f"{transfer.kv_rank}")  # fmt: skip
        if transfer.kv_parallel_size != 2:
            reasons.append(f"kv_parallel_size: {cls.NAME} pairs one prefill and one decode instance (allowed: 2), got "
                           f"{transfer.kv_parallel_size}")  # fmt: skip
        for key, default in DEFAULTS.items():
            value = transfer.kv_connector_extra_config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                reasons.append(f"kv_connector_extra_config.{key}: must be a positive number of seconds, got {value!r}")
        return reasons

    def __init__(self, config: Any, role: KVConnectorRole, kv_cache_groups: Any) -> None:
        super().__init__(config, role, kv_cache_groups)
        transfer = self.transfer_config
        extra = {key: float(transfer.kv_connector_extra_config.get(key, d)) for key, d in DEFAULTS.items()}
        self.hold_s, self.timeout_s = extra["abort_request_timeout_s"], extra["timeout_s"]
        self.block_size = kv_cache_groups[0].block_size
        self.is_producer = transfer.kv_role == "kv_producer"
        self.layout = kv_layout_fingerprint(config)
        self.engine_id = transfer.engine_id or f"kvloom-{uuid.uuid4().hex[:12]}"
        # Scheduler side.
        self._offers: list[tuple[str, list[int]]] = []
        self._pulls: list[Pull] = []
        self._pulled: set[str] = set()  # consumer: requests whose remote KV was asked for (once per request)
        self._stats = KVTransferStats()
        # Worker side.
        self.link: ProducerLink | ConsumerLink | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the loader thread reports pulls done and blocks failed
        self._pulled_now: set[str] = set()
        self._errors: set[int] = set()

    # ------------------------------------------------------------------ scheduler side

    def validate_kv_transfer_params(self, params: dict[str, Any]) -> str | None:
        return check_params(params, self.transfer_config, self.layout)

    def get_num_new_matched_tokens(self, request: KVConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None:
            return 0, False
        usable = min(len(remote), (request.num_tokens - 1) // self.block_size)  # one token is computed here
        count = usable * self.block_size - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _remote(self, request: KVConnectorRequest) -> list[int] | None:
        """The producer's block ids of a decode request not pulled yet (None: not one)."""
        params = request.kv_transfer_params
        if self.is_producer or not params or not params.get("do_remote_prefill") or request.request_id in self._pulled:
            return None
        return remote_blocks(params, request.block_hashes)

    def update_state_after_alloc(self, request: KVConnectorRequest, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:  # fmt: skip
        remote = self._remote(request)
        if remote is None:
            return
        self._pulled.add(request.request_id)
        assert request.kv_transfer_params is not None
        remote_id = str(request.kv_transfer_params["remote_request_id"])
        first = request.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        # Nothing to load (its prefix was cached here): still a pull, of no blocks, so that
        # the producer frees them now rather than after abort_request_timeout_s.
        self._pulls.append(Pull(request.request_id, remote_id, remote[first : first + count],
                                block_ids[0][first : first + count]))  # fmt: skip
        if num_external_tokens:
            self._stats.count_hit(TIER, num_external_tokens)

    def build_connector_meta(self, step: KVConnectorStep) -> P2pMetadata:
        meta = P2pMetadata(self._offers, self._pulls)
        self._offers, self._pulls = [], []
        return meta

    def request_finished(self, request: KVConnectorRequest,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        self._pulled.discard(request.request_id)
        params = request.kv_transfer_params
        if not self.is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        if request.num_computed_tokens < request.num_prompt_tokens:
            return False, None  # aborted or failed before its prefill ended: nothing to hand over
        num_blocks = min(request.num_prompt_tokens // self.block_size, len(request.block_hashes))
        remote = block_ids[0][:num_blocks]
        transfer = self.transfer_config
        reply = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                 "remote_block_ids": remote, "remote_host": transfer.kv_ip, "remote_port": transfer.kv_port,
                 "remote_request_id": request.request_id, "remote_kv_layout": self.layout,
                 "remote_block_hash": request.block_hashes[num_blocks - 1].hex() if num_blocks else None}  # fmt: skip
        if num_blocks:
            self._offers.append((request.request_id, remote))
        return bool(num_blocks), reply

    def take_stats(self) -> KVTransferStats:
        stats, self._stats = self._stats, KVTransferStats()
        return stats

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, KVLayerCache]) -> None:
        transfer = self.transfer_config
        link = ProducerLink if self.is_producer else ConsumerLink
        self.link = link(transfer.kv_ip, transfer.kv_port, kv_caches, self.layout, self.timeout_s)

    def _meta(self) -> P2pMetadata | None:  # the step's, on the worker side
        meta = self.connector_metadata
        assert meta is None or isinstance(meta, P2pMetadata)
        return meta

    def start_load_kv(self) -> None:
        meta, link = self._meta(), self.link
        if meta is None or link is None:
            return
        if isinstance(link, ProducerLink):
            for request_id, block_ids in meta.offers:
                link.offer(request_id, block_ids, self.hold_s)
            return
        if not meta.pulls:
            return
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvloom-p2p-consumer")
        ready = None
        if link.device.type == "cuda":  # the blocks may be written by work queued for their previous request
            ready = torch.cuda.Event()
            ready.record()
        for pull in meta.pulls:
            self._loader.submit(self._pull, link, pull, ready)

    def _pull(self, link: ConsumerLink, pull: Pull, ready: Any) -> None:
        """On the loader thread: pull, then report the request done (its blocks failed
        first, if they did). A release (no blocks) is not reported: nothing waits for it."""
        failed = False
        try:
            link.pull(pull.remote_request_id, pull.remote_block_ids, pull.block_ids, ready)
        except Exception as exc:  # noqa: BLE001 (whatever went wrong, the request's blocks did not arrive)
            failed = True
            what = f"pulling its {len(pull.block_ids)} block(s)" if pull.block_ids else "releasing its blocks"
            logger.warning("P2pNcclConnector: request %s: %s from the prefill instance failed: %s", pull.request_id,
                           what, exc)  # fmt: skip
        if pull.block_ids:
            with self._lock:
                if failed:
                    self._errors.update(pull.block_ids)
                self._pulled_now.add(pull.request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits for get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None  # nothing is saved: the producer keeps the blocks until they are pulled

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if isinstance(self.link, ProducerLink):
            return self.link.take_finished() or None, None
        with self._lock:
            done, self._pulled_now = self._pulled_now, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def get_stats(self) -> KVTransferStats | None:
        return self.link.take_stats() if self.link is not None else None

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if isinstance(self.link, ProducerLink):
            self.link.shutdown()
