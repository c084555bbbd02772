"""``ExampleConnector``: KV-cache blocks written to and read from a folder (vLLM's example
connector, once named ``SharedStorageConnector``).

A producer (``kv_producer`` / ``kv_both``) writes every full block its requests compute
as a file named by the block's key (KV-cache group and chained hash) under
``shared_storage_path``/<layout fingerprint>; a consumer (``kv_consumer`` / ``kv_both``)
looks a waiting request's next blocks up there and loads the run of them that exists.
Two engines that share the folder share prefixes: a decode instance computes only what
its prefill instance did not write. Saves happen per layer during the forward (copied to
the host) and are written to files when the step ends; files appear atomically.

Options (``kv_connector_extra_config``): ``shared_storage_path`` (required),
``load_async`` (default false: blocks are read before the forward and copied in layer by
layer; true: read on a thread while the request waits and other requests run).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvloom.interfaces import (
    KVBlockFileError,
    KVBlockFiles,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorRole,
    KVConnectorStep,
    KVLayerCache,
    KVTransferStats,
    block_key,
    device_label,
    kv_layout_fingerprint,
)

logger = logging.getLogger(__name__)

#: The tier name of this connector's hits in the stats.
TIER = "storage"


@dataclass
class BlockJob:
    """Blocks of one request to move: their keys and the device blocks they go to or come from."""

    request_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class StorageMetadata(KVConnectorMetadata):
    """One step's loads and saves."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)


class ExampleConnector(KVConnectorBase):
    """KV blocks shared through a folder (module docstring)."""

    NAME = "ExampleConnector"
    aliases = ("SharedStorageConnector",)
    extra_config_keys = ("shared_storage_path", "load_async")

    @classmethod
    def validate_config(cls, config: Any) -> list[str]:
        reasons = super().validate_config(config)
        extra = config.kv_transfer.kv_connector_extra_config
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            reasons.append("kv_connector_extra_config.shared_storage_path: required, the folder the engines share")
        if not isinstance(extra.get("load_async", False), bool):
            reasons.append("kv_connector_extra_config.load_async: must be true or false")
        return reasons

    def __init__(self, config: Any, role: KVConnectorRole, kv_cache_groups: Any) -> None:
        super().__init__(config, role, kv_cache_groups)
        transfer = self.transfer_config
        self.root = Path(transfer.kv_connector_extra_config["shared_storage_path"]) / kv_layout_fingerprint(config)
        self.load_async = bool(transfer.kv_connector_extra_config.get("load_async", False))
        self.block_size = kv_cache_groups[0].block_size
        self.is_producer, self.is_consumer = transfer.is_kv_producer, transfer.is_kv_consumer
        # The folder: the scheduler side asks it which blocks exist (its layout is the worker's).
        self.files = KVBlockFiles(self.root, [])
        # Scheduler side: the step's loads, and how many blocks of each request went to saving.
        self._loads: list[BlockJob] = []
        self._saved: dict[str, int] = {}
        self._stats = KVTransferStats()
        # Worker side.
        self.layers: dict[str, KVLayerCache] = {}
        self._lock = threading.Lock()  # the loader thread reports errors and counts too
        self._sync_loaded: dict[str, list[torch.Tensor]] = {}  # layer -> host blocks of this step's loads
        self._sync_ids: torch.Tensor | None = None
        self._pending_saves: dict[str, torch.Tensor] = {}  # layer -> host copies of this step's saves
        self._errors: set[int] = set()
        self._loader: ThreadPoolExecutor | None = None
        self._async: dict[str, Future[None]] = {}
        self._worker_stats = KVTransferStats()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: KVConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.is_consumer:
            return 0, False
        first = num_computed_tokens // self.block_size
        last = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        found = 0
        for i in range(first, last):
            if not self.files.exists(block_key(0, request.block_hashes[i])):
                break
            found += 1
        return found * self.block_size, found > 0 and self.load_async

    def update_state_after_alloc(self, request: KVConnectorRequest, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:  # fmt: skip
        if num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        keys = [block_key(0, h) for h in request.block_hashes[first : first + count]]
        self._loads.append(BlockJob(request.request_id, keys, block_ids[0][first : first + count]))
        self._stats.count_hit(TIER, num_external_tokens)

    def build_connector_meta(self, step: KVConnectorStep) -> StorageMetadata:
        meta = StorageMetadata(loads=self._loads)
        self._loads = []
        for request_id in step.finished_req_ids:
            self._saved.pop(request_id, None)
        if self.is_producer:
            for scheduled in step.requests:
                request = scheduled.request
                # A new request's cached blocks were saved when they were computed (or came from here).
                done = scheduled.num_computed_tokens // self.block_size if scheduled.is_new else 0
                done = self._saved.get(request.request_id, done)
                full = min(scheduled.num_tokens_after_step // self.block_size, len(request.block_hashes))
                if full > done:
                    keys = [block_key(0, h) for h in request.block_hashes[done:full]]
                    meta.saves.append(BlockJob(request.request_id, keys, scheduled.block_ids[0][done:full]))
                    self._saved[request.request_id] = full
        return meta

    def take_stats(self) -> KVTransferStats:
        stats, self._stats = self._stats, KVTransferStats()
        return stats

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, KVLayerCache]) -> None:
        self.layers = kv_caches
        layout = [(str(c.tensor.dtype), c.block_shape) for c in kv_caches.values()]
        self.files = KVBlockFiles(self.root, layout)
        self.device = next(iter(kv_caches.values())).tensor.device

    def _meta(self) -> StorageMetadata | None:  # the step's, on the worker side
        meta = self.connector_metadata
        assert meta is None or isinstance(meta, StorageMetadata)
        return meta

    def start_load_kv(self) -> None:
        meta = self._meta()
        self._sync_loaded, self._sync_ids = {}, None
        if meta is None or not meta.loads:
            return
        if self.load_async:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvloom-storage-load")
            for job in meta.loads:
                self._async[job.request_id] = self._loader.submit(self._load_now, [job])
            return
        loaded = self._read([job for job in meta.loads])
        if loaded is not None:
            self._sync_ids, self._sync_loaded = loaded

    def _read(self, jobs: list[BlockJob]) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]] | None:
        """Read the jobs' files into host tensors, one ``[n, *block_shape]`` per layer; a
        block whose file cannot be read is left out and its device block reported."""
        start = time.perf_counter()
        host = {name: torch.empty((sum(len(j.keys) for j in jobs), *c.block_shape), dtype=c.tensor.dtype)
                for name, c in self.layers.items()}  # fmt: skip
        ids: list[int] = []
        nbytes = 0
        for job in jobs:
            for key, block_id in zip(job.keys, job.block_ids):
                row = len(ids)
                try:
                    nbytes += self.files.read(key, [host[name][row] for name in self.layers])
                except KVBlockFileError as exc:
                    logger.warning("ExampleConnector: %s", exc)
                    with self._lock:
                        self._errors.add(block_id)
                    continue
                ids.append(block_id)
        if not ids:
            return None
        rows = len(ids)
        with self._lock:
            self._worker_stats.count_transfer(f"storage_to_{device_label(self.device)}", rows, nbytes,
                                              time.perf_counter() - start)  # fmt: skip
        return torch.tensor(ids, dtype=torch.int64, device=self.device), {n: h[:rows] for n, h in host.items()}

    def _load_now(self, jobs: list[BlockJob]) -> None:
        """An asynchronous load, on the loader thread: read, then copy into the cache (the
        request waits: nothing else uses its blocks). A failure fails all its blocks."""
        try:
            loaded = self._read(jobs)
            if loaded is None:
                return
            ids, host = loaded
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for name, cache in self.layers.items():
                    cache.scatter(ids, host[name])
            if stream is not None:
                stream.synchronize()
        except Exception:
            logger.exception("ExampleConnector: an asynchronous load failed")
            with self._lock:
                self._errors.update(b for job in jobs for b in job.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._sync_ids is not None:
            self.layers[layer_name].scatter(self._sync_ids, self._sync_loaded[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        meta = self._meta()
        if meta is None or not meta.saves:
            return
        ids = torch.tensor([b for job in meta.saves for b in job.block_ids], dtype=torch.int64, device=self.device)
        self._pending_saves[layer_name] = self.layers[layer_name].gather(ids).to("cpu")

    def wait_for_save(self) -> None:
        meta = self._meta()
        pending, self._pending_saves = self._pending_saves, {}
        if meta is None or not meta.saves or not pending:
            return
        start, nbytes, row, written = time.perf_counter(), 0, 0, 0
        for job in meta.saves:
            for key in job.keys:
                if not self.files.exists(key):
                    nbytes += self.files.write(key, [pending[name][row] for name in self.layers])
                    written += 1
                row += 1
        if written:
            with self._lock:
                self._worker_stats.count_transfer(f"{device_label(self.device)}_to_storage", written, nbytes,
                                                  time.perf_counter() - start)  # fmt: skip

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {request_id for request_id, future in self._async.items() if future.done()}
        for request_id in done:
            del self._async[request_id]
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def get_stats(self) -> KVTransferStats:
        with self._lock:
            stats, self._worker_stats = self._worker_stats, KVTransferStats()
        return stats

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None

