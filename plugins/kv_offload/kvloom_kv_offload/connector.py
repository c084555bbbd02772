"""``OffloadingConnector``: KV-cache blocks kept in host memory (vLLM's native CPU offloading,
``--kv-offloading-size GiB --kv-offloading-backend native``), optionally spilled on to disk.

Every full block a request computes is stored to the host tier once (its key: group and
block hash), least recently used blocks making room. When a waiting request's prefix is
past what the device's prefix cache holds, the run of its next blocks found in the host
(or disk) tier is loaded back asynchronously: the request waits while others run, and
computes only the rest once its blocks are in. So prefixes far larger than the device's
block pool are computed once.

Options (``kv_connector_extra_config``): ``cpu_bytes_to_use`` (what ``--kv-offloading-size``
sets) or vLLM's older ``num_cpu_blocks``; ``disk_path`` and ``disk_bytes_to_use`` for a
disk tier below the host tier; vLLM's ``block_size`` (must be the engine's),
``eviction_policy`` (``lru``) and ``spec_name`` (``CPUOffloadingSpec``) are accepted as
they are the only values kvloom has.
"""

from __future__ import annotations

import logging
import time
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
    available_host_memory,
    block_key,
    device_label,
    kv_cache_bytes_per_block,
    kv_layout_fingerprint,
)
from kvloom_kv_offload.host_index import HostIndex
from kvloom_kv_offload.transfers import HostTier, Transfer

logger = logging.getLogger(__name__)


@dataclass
class LoadJob:
    """Blocks of one request to load: from host slots or disk files, into device blocks."""

    request_id: str
    block_ids: list[int]
    slots: list[int | None]
    """A host slot per block, or None for a block read from disk (``disk_keys``)."""
    disk_keys: list[str | None]


@dataclass
class StoreJob:
    """Device blocks of one request to store into host slots."""

    request_id: str
    block_ids: list[int]
    slots: list[int]


@dataclass
class SpillJob:
    """A host block to write to disk before its slot is reused (``drops``: disk blocks
    evicted to make room, deleted)."""

    slot: int
    key: str
    drops: list[str]


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """One step's loads (issued before the forward) and its stores and spills (after it),
    the latter in the order they were decided: a slot a store fills may be spilled and
    filled again within one step."""

    loads: list[LoadJob] = field(default_factory=list)
    writes: list[StoreJob | SpillJob] = field(default_factory=list)


def _host_slots(config: Any) -> tuple[int, int]:
    """(host slots, disk blocks) the extra config asks for."""
    extra = config.kv_transfer.kv_connector_extra_config
    per_block = kv_cache_bytes_per_block(config)
    slots = extra.get("num_cpu_blocks") or int(extra.get("cpu_bytes_to_use", 0)) // per_block
    return int(slots), int(extra.get("disk_bytes_to_use", 0)) // per_block


class OffloadingConnector(KVConnectorBase):
    """Host (and disk) tiers below the device's KV cache (module docstring)."""

    NAME = "OffloadingConnector"
    extra_config_keys = ("cpu_bytes_to_use", "num_cpu_blocks", "disk_path", "disk_bytes_to_use", "block_size",
                         "eviction_policy", "spec_name")  # fmt: skip

    @classmethod
    def validate_config(cls, config: Any) -> list[str]:
        reasons = super().validate_config(config)
        extra = config.kv_transfer.kv_connector_extra_config
        for key in ("cpu_bytes_to_use", "num_cpu_blocks", "disk_bytes_to_use", "block_size"):
            if key in extra and (not isinstance(extra[key], int) or isinstance(extra[key], bool) or extra[key] < 1):
                reasons.append(f"kv_connector_extra_config.{key}: must be a positive integer, got {extra[key]!r}")
        if reasons:
            return reasons
        slots, disk_blocks = _host_slots(config)
        if slots < 1:
            reasons.append(f"kv_connector_extra_config.cpu_bytes_to_use: holds no KV-cache block of "
                           f"{kv_cache_bytes_per_block(config)} bytes (set cpu_bytes_to_use or --kv-offloading-size)")  # fmt: skip
        available, host_bytes = available_host_memory(), slots * kv_cache_bytes_per_block(config)
        if host_bytes > available:
            # Checked before the engine starts: past this the kernel's OOM killer ends it with no word.
            reasons.append(f"kv_connector_extra_config.cpu_bytes_to_use (--kv-offloading-size): the host tier "
                           f"needs {host_bytes / 2**30:.1f} GiB, the host has {available / 2**30:.1f} GiB available "
                           "(allowed: at most that, less what the engine itself takes)")  # fmt: skip
        if extra.get("block_size", config.cache.block_size) != config.cache.block_size:
            reasons.append(f"kv_connector_extra_config.block_size: kvloom offloads the engine's blocks "
                           f"({config.cache.block_size} tokens), got {extra['block_size']}")  # fmt: skip
        if extra.get("eviction_policy", "lru") != "lru":
            reasons.append(f"kv_connector_extra_config.eviction_policy: {extra['eviction_policy']!r} is not "
                           "supported by kvloom yet (allowed: lru)")  # fmt: skip
        if extra.get("spec_name", "CPUOffloadingSpec") != "CPUOffloadingSpec":
            reasons.append(f"kv_connector_extra_config.spec_name: {extra['spec_name']!r} is not supported by "
                           "kvloom yet (allowed: CPUOffloadingSpec)")  # fmt: skip
        if ("disk_path" in extra) != (disk_blocks > 0):
            reasons.append("kv_connector_extra_config: disk_path and disk_bytes_to_use go together (a disk tier)")
        return reasons

    def __init__(self, config: Any, role: KVConnectorRole, kv_cache_groups: Any) -> None:
        super().__init__(config, role, kv_cache_groups)
        self.block_size = kv_cache_groups[0].block_size
        self.num_slots, disk_blocks = _host_slots(config)
        disk_path = self.transfer_config.kv_connector_extra_config.get("disk_path")
        self.disk_root = Path(disk_path) / kv_layout_fingerprint(config) if disk_path else None
        # Scheduler side.
        self.index = HostIndex(self.num_slots, disk_blocks)
        self._loads: list[LoadJob] = []
        self._stored: dict[str, int] = {}  # request id -> its blocks handled by stores so far
        self._stats = KVTransferStats()
        # Worker side.
        self.tier: HostTier | None = None
        self.disk: KVBlockFiles | None = None
        self._loading: list[Transfer] = []
        self._storing: list[Transfer] = []
        self._errors: set[int] = set()
        self._worker_stats = KVTransferStats()
        self.load_kind = self.store_kind = self.disk_kind = ""  # transfer types, once the cache is registered
        if role == KVConnectorRole.SCHEDULER:
            logger.info("OffloadingConnector: %d host blocks (%.2f GiB)%s", self.num_slots,
                        self.num_slots * kv_cache_bytes_per_block(config) / 2**30,
                        f", a disk tier of {disk_blocks} blocks in {self.disk_root}" if disk_blocks else "")  # fmt: skip

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: KVConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        first = num_computed_tokens // self.block_size
        last = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        found = 0
        while first + found < last and self.index.tier_of(block_key(0, request.block_hashes[first + found])):
            found += 1
        return found * self.block_size, found > 0

    def update_state_after_alloc(self, request: KVConnectorRequest, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:  # fmt: skip
        if not num_external_tokens:
            return
        first = request.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        job = LoadJob(request.request_id, block_ids[0][first : first + count], [], [])
        for block_hash in request.block_hashes[first : first + count]:
            key = block_key(0, block_hash)
            tier = self.index.tier_of(key)
            self.index.touch(key)
            self._stats.count_hit(tier or "cpu", self.block_size)
            job.slots.append(self.index.slot_of(key) if tier == "cpu" else None)
            job.disk_keys.append(key if tier == "disk" else None)
        self._loads.append(job)

    def build_connector_meta(self, step: KVConnectorStep) -> OffloadMetadata:
        meta = OffloadMetadata(loads=self._loads)
        self._loads = []
        for request_id in step.finished_req_ids:
            self._stored.pop(request_id, None)
        for scheduled in step.requests:
            request = scheduled.request
            # A new request's cached blocks were stored when computed (or came from here).
            done = scheduled.num_computed_tokens // self.block_size if scheduled.is_new else 0
            done = self._stored.get(request.request_id, done)
            full = min(scheduled.num_tokens_after_step // self.block_size, len(request.block_hashes))
            if full <= done:
                continue
            self._stored[request.request_id] = full
            keys, rows = [], []
            for i in range(done, full):
                key = block_key(0, request.block_hashes[i])
                if self.index.tier_of(key) == "cpu":
                    self.index.touch(key)
                else:
                    keys.append(key)
                    rows.append(i)
            if keys:
                self._place(meta, request.request_id, keys, [scheduled.block_ids[0][i] for i in rows])
        return meta

    def _place(self, meta: OffloadMetadata, request_id: str, keys: list[str], block_ids: list[int]) -> None:
        """Store ``keys`` (at device ``block_ids``), in order: a spill that evicting takes
        follows the stores decided before it."""
        job = StoreJob(request_id, [], [])
        for key, block_id in zip(keys, block_ids):
            placement = self.index.store([key])
            if placement.spills:
                if job.slots:
                    meta.writes.append(job)
                    job = StoreJob(request_id, [], [])
                for slot, spilled in placement.spills:
                    meta.writes.append(SpillJob(slot, spilled, placement.disk_drops))
            job.block_ids.append(block_id)
            job.slots.append(placement.slots[0])
        if job.slots:
            meta.writes.append(job)

    def take_stats(self) -> KVTransferStats:
        stats, self._stats = self._stats, KVTransferStats()
        return stats

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, KVLayerCache]) -> None:
        self.tier = HostTier(kv_caches, self.num_slots)
        if self.tier.block_nbytes != kv_cache_bytes_per_block(self.config):
            raise ValueError(f"OffloadingConnector: the KV cache has {self.tier.block_nbytes} bytes per block, the "
                             f"config says {kv_cache_bytes_per_block(self.config)}")  # fmt: skip
        if self.disk_root is not None:
            layout = [(str(c.tensor.dtype), c.block_shape) for c in kv_caches.values()]
            self.disk = KVBlockFiles(self.disk_root, layout)
        label = device_label(self.tier.device)
        # vLLM's transfer types; a CPU engine's cache and host tier both live on the CPU.
        self.load_kind, self.store_kind = (f"CPU_to_{label}", f"{label}_to_CPU") if label != "CPU" else \
            ("host_to_device", "device_to_host")  # fmt: skip
        self.disk_kind = f"disk_to_{label}"

    def _meta(self) -> OffloadMetadata | None:  # the step's, on the worker side
        meta = self.connector_metadata
        assert meta is None or isinstance(meta, OffloadMetadata)
        return meta

    def start_load_kv(self) -> None:
        tier = self.tier
        assert tier is not None
        tier.fence_stores()  # this step may write blocks the last step's stores still read
        meta = self._meta()
        for job in meta.loads if meta is not None else ():
            self._load(job)

    def _load(self, job: LoadJob) -> None:
        """Issue a request's load: its host blocks asynchronously, its disk blocks now; the
        request is reported once the host copy has landed."""
        assert self.tier is not None
        from_host = [(b, s) for b, s in zip(job.block_ids, job.slots) if s is not None]
        from_disk = [(b, k) for b, k in zip(job.block_ids, job.disk_keys) if k is not None]
        if from_host:
            blocks, slots = zip(*from_host)
            self._loading.append(self.tier.load(job.request_id, list(slots), list(blocks)))
        else:
            self._loading.append(Transfer(job.request_id, 0, 0, time.perf_counter()))
        if from_disk:
            self._load_from_disk(from_disk)

    def _load_from_disk(self, blocks: list[tuple[int, str]]) -> None:
        """Read disk blocks (on the host, now) and copy them into the device cache."""
        assert self.tier is not None and self.disk is not None
        start, nbytes, ok = time.perf_counter(), 0, []
        host = [torch.empty((len(blocks), *c.block_shape), dtype=c.tensor.dtype) for c in self.tier.layers.values()]
        for block_id, key in blocks:
            try:
                nbytes += self.disk.read(key, [h[len(ok)] for h in host])
            except KVBlockFileError as exc:
                logger.warning("OffloadingConnector: %s", exc)
                self._errors.add(block_id)
                continue
            ok.append(block_id)
        if ok:
            ids = torch.tensor(ok, dtype=torch.int64, device=self.tier.device)
            for h, cache in zip(host, self.tier.layers.values()):
                cache.scatter(ids, h[: len(ok)])
            self._worker_stats.count_transfer(self.disk_kind, len(ok), nbytes, time.perf_counter() - start)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits for get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None  # blocks are stored once the step's forward is queued (wait_for_save)

    def wait_for_save(self) -> None:
        meta, tier = self._meta(), self.tier
        if meta is None or tier is None:
            return
        for job in meta.writes:
            if isinstance(job, StoreJob):
                self._storing.append(tier.store(job.request_id, job.block_ids, job.slots))
                continue
            assert self.disk is not None
            tier.wait_stores()  # the slot's block is in host memory before it goes to disk
            start = time.perf_counter()
            nbytes = self.disk.write(job.key, tier.read_slot(job.slot))
            self._worker_stats.count_transfer("CPU_to_disk", 1, nbytes, time.perf_counter() - start)
            for key in job.drops:
                self.disk.path(key).unlink(missing_ok=True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        loaded = self._collect(self._loading, self.load_kind)
        self._collect(self._storing, self.store_kind)
        return None, {t.request_id for t in loaded} or None

    def _collect(self, transfers: list[Transfer], kind: str) -> list[Transfer]:
        done = [t for t in transfers if t.done()]
        if done:
            transfers[:] = [t for t in transfers if not t.done()]
            for t in done:
                if t.blocks:
                    self._worker_stats.count_transfer(kind, t.blocks, t.nbytes, t.seconds())
        return done

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def get_stats(self) -> KVTransferStats:
        stats, self._worker_stats = self._worker_stats, KVTransferStats()
        return stats

    def shutdown(self) -> None:
        if self.tier is not None:
            self.tier.wait_stores()
