"""KV connectors for kvloom's own tests, named by ``kv_connector_module_path``
(``tests.kv_transfer.memory_connector``).

``MemoryConnector`` keeps saved blocks in a dict of this process (``STORE``), so two
in-process engines share them like a folder. It loads synchronously, or asynchronously
with ``{"load_async": true}`` in its extra config, and fails on request:
``kv_transfer_params`` ``{"fail_in": METHOD}`` makes that method raise for that request
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``request_finished``, the
worker side's ``start_load_kv``), ``{"fail_in": "load_blocks"}`` reports its loaded blocks
failed instead of loading them. The ``Broken*`` subclasses break the contract for the
conformance kit to catch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvloom.interfaces import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorStep,
    KVLayerCache,
    KVTransferStats,
    block_key,
)

#: Saved blocks: key -> one tensor per layer.
STORE: dict[str, list[torch.Tensor]] = {}
MODULE = __name__


def transfer_config(name: str = "MemoryConnector", role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    return {"kv_connector": name, "kv_role": role, "kv_connector_module_path": MODULE,
            "kv_connector_extra_config": extra}  # fmt: skip


@dataclass
class Job:
    request_id: str
    keys: list[str]
    block_ids: list[int]
    fail: bool = False


@dataclass
class Meta(KVConnectorMetadata):
    loads: list[Job] = field(default_factory=list)
    saves: list[Job] = field(default_factory=list)
    fail_start: bool = False


def _fails(request: KVConnectorRequest, method: str) -> bool:
    return (request.kv_transfer_params or {}).get("fail_in") == method


class MemoryConnector(KVConnectorBase):
    NAME = "MemoryConnector"
    extra_config_keys = ("load_async",)

    def __init__(self, config: Any, role: Any, kv_cache_groups: Any) -> None:
        super().__init__(config, role, kv_cache_groups)
        self.block_size = kv_cache_groups[0].block_size
        self.load_async = bool(self.transfer_config.kv_connector_extra_config.get("load_async", False))
        self._loads: list[Job] = []
        self._saved: dict[str, int] = {}
        self.layers: dict[str, KVLayerCache] = {}
        self._done: set[str] = set()
        self._errors: set[int] = set()

    # scheduler side
    def get_num_new_matched_tokens(self, request: KVConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if _fails(request, "get_num_new_matched_tokens"):
            raise RuntimeError("lookup failed on purpose")
        first = num_computed_tokens // self.block_size
        last = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        n = 0
        while first + n < last and block_key(0, request.block_hashes[first + n]) in STORE:
            n += 1
        return n * self.block_size, n > 0 and self.load_async

    def update_state_after_alloc(self, request: KVConnectorRequest, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:  # fmt: skip
        if _fails(request, "update_state_after_alloc"):
            raise RuntimeError("update_state_after_alloc failed on purpose")
        if num_external_tokens:
            first = request.num_computed_tokens // self.block_size
            n = num_external_tokens // self.block_size
            keys = [block_key(0, h) for h in request.block_hashes[first : first + n]]
            self._loads.append(Job(request.request_id, keys, block_ids[0][first : first + n],
                                   _fails(request, "load_blocks")))  # fmt: skip

    def build_connector_meta(self, step: KVConnectorStep) -> Meta:
        meta = Meta(loads=self._loads, fail_start=any(_fails(r.request, "start_load_kv") for r in step.requests)
                    or any(j.request_id.startswith("fail-start") for j in self._loads))  # fmt: skip
        self._loads = []
        for scheduled in step.requests:
            request = scheduled.request
            done = self._saved.get(request.request_id, scheduled.num_computed_tokens // self.block_size)
            full = min(scheduled.num_tokens_after_step // self.block_size, len(request.block_hashes))
            if full > done:
                keys = [block_key(0, h) for h in request.block_hashes[done:full]]
                meta.saves.append(Job(request.request_id, keys, scheduled.block_ids[0][done:full]))
                self._saved[request.request_id] = full
        for request_id in step.finished_req_ids:
            self._saved.pop(request_id, None)
        return meta

    def request_finished(self, request: KVConnectorRequest, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        if _fails(request, "request_finished"):
            raise RuntimeError("request_finished failed on purpose")
        return False, {"saved_by": "memory"} if request.kv_transfer_params else None

    def take_stats(self) -> KVTransferStats:
        return KVTransferStats()

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, KVLayerCache]) -> None:
        self.layers = kv_caches

    def start_load_kv(self) -> None:
        meta = self.connector_metadata
        if not isinstance(meta, Meta):
            return
        if meta.fail_start:
            raise RuntimeError("start_load_kv failed on purpose")
        for job in meta.loads:
            if job.fail:
                self._errors.update(job.block_ids)
            else:
                ids = torch.tensor(job.block_ids, dtype=torch.int64)
                for i, layer in enumerate(self.layers.values()):
                    layer.scatter(ids, torch.stack([STORE[k][i] for k in job.keys]))
            if self.load_async:
                self._done.add(job.request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self.connector_metadata
        if not isinstance(meta, Meta):
            return
        for job in meta.saves:
            ids = torch.tensor(job.block_ids, dtype=torch.int64)
            blocks = [layer.gather(ids).clone() for layer in self.layers.values()]
            for row, key in enumerate(job.keys):
                STORE.setdefault(key, [b[row] for b in blocks])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._done = self._done, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors


class BrokenClaimsConnector(MemoryConnector):
    """Claims one block more than it has (and never the tail rule)."""

    NAME = "BrokenClaimsConnector"

    def get_num_new_matched_tokens(self, request: KVConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        found, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return found + self.block_size, load_async


class BrokenDataConnector(MemoryConnector):
    """Loads every block but its first element right."""

    NAME = "BrokenDataConnector"

    def start_load_kv(self) -> None:
        super().start_load_kv()
        meta = self.connector_metadata
        for job in meta.loads if isinstance(meta, Meta) else ():
            ids = torch.tensor(job.block_ids[:1], dtype=torch.int64)
            for layer in self.layers.values():
                block = layer.gather(ids)
                block.view(-1)[0] += 1.0
                layer.scatter(ids, block)
