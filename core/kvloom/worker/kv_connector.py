"""The KV connector's part of the model runner: the connector's worker side, called around
each step's forward and, through the forward context, around each attention layer.

The runner calls it at four points: ``register`` once the KV cache is allocated;
``begin`` at the start of every step (also one that computes nothing, so that
asynchronous loads go on): the step's metadata is bound and the loads start; per layer,
inside the forward, ``wait_for_layer_load`` before the layer's attention and
``save_kv_layer`` after it (the ``Attention`` layer calls them through
``ForwardContext.kv_connector``); ``end`` after the forward: saves are waited for, and the
finished transfers and failed blocks are collected into the step's ``KVConnectorReport``,
which ``attach`` puts into its ``ModelRunnerOutput``.

A step run as a full CUDA graph runs no per-layer code: ``before_graph`` waits for every
layer's loads before the replay, and ``end`` saves every layer after it. Models whose
attention layers are not ``Attention`` (MLA) are handled the same way on every step.

Failures stay with their requests. A synchronous load that fails (the connector raised,
or reported failed blocks) fails the requests that load in the step (``RequestFailures``:
``FinishReason.ERROR``); found before the forward, they are left out of it. An
asynchronous load that cannot proceed is reported finished with its blocks invalid, and
the scheduler applies ``kv_load_failure_policy``. A failed save is logged and counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvloom.attention.layer import Attention
from kvloom.attention.mla_layer import MLAAttention
from kvloom.config import EngineConfig
from kvloom.kv_transfer.base import KVCacheGroupSpec, KVConnectorBase, KVConnectorOutput, KVConnectorRole
from kvloom.kv_transfer.blocks import KVLayerCache, block_dim_of
from kvloom.kv_transfer.factory import make_connector
from kvloom.kv_transfer.output import KVConnectorReport
from kvloom.metrics.scheduler_stats import KVTransferStats
from kvloom.outputs import ModelRunnerOutput, PendingModelRunnerOutput
from kvloom.scheduler.output import KVTransferStep, SchedulerOutput
from kvloom.worker.request_failures import RequestFailures

logger = logging.getLogger(__name__)

#: How long a step that computes nothing waits when a connector runs (its transfers are
#: what the engine waits for): the busy loop polls instead of spinning.
IDLE_STEP_WAIT_S = 0.001


class WorkerConnector:
    """The connector's worker side around the runner's steps (module docstring); inactive
    (every call does nothing) without ``kv_transfer_config``."""

    def __init__(self, config: EngineConfig, failures: RequestFailures) -> None:
        self.config = config
        self.failures = failures
        self.connector: KVConnectorBase | None = None
        self.name = ""
        self.layer_names: list[str] = []
        self.layerwise = True
        self._step: KVTransferStep | None = None
        self._whole_step = False  # its layers' loads and saves run around the forward
        self._async_pending: dict[str, list[int]] = {}  # asynchronous loads not reported yet
        self._load_error: str | None = None
        self._caches: dict[str, torch.Tensor] = {}
        self._stats = KVTransferStats()
        self._report: KVConnectorReport | None = None

    def register(self, attn_layers: list[Attention | MLAAttention], kv_caches: list[torch.Tensor]) -> None:
        """Build the connector's worker side and hand it the allocated KV cache."""
        if self.config.kv_transfer is None:
            return
        names = [layer.prefix for layer in attn_layers]
        if len(set(names)) != len(names) or "" in names:
            raise ValueError(f"kv_transfer_config: the KV connector needs a unique name on every attention layer; "
                             f"this model's are {names[:4]}...")  # fmt: skip
        block_size = self.config.cache.block_size
        self.connector = make_connector(self.config, KVConnectorRole.WORKER, (KVCacheGroupSpec(tuple(names), block_size),))
        self.name = type(self.connector).NAME
        self.layer_names = names
        self.layerwise = all(type(layer) is Attention for layer in attn_layers)
        caches = {}
        for layer, tensor in zip(attn_layers, kv_caches):
            dim = block_dim_of(layer.backend.get_kv_cache_shape, block_size, layer.num_kv_heads, layer.head_size)
            caches[layer.prefix] = KVLayerCache(layer.prefix, tensor, dim)
            self._caches[layer.prefix] = tensor
        self.connector.register_kv_caches(caches)

    @property
    def layer_hooks(self) -> WorkerConnector | None:
        """What the forward context carries for the ``Attention`` layers (None: no per-layer calls)."""
        return self if self.connector is not None and self.layerwise else None

    # ------------------------------------------------------------------ the step

    def begin(self, scheduler_output: SchedulerOutput) -> None:
        """Bind the step's metadata and start its loads (before anything of the step runs)."""
        step = scheduler_output.kv_connector_metadata
        if self.connector is None or step is None:
            return
        self._step, self._load_error = step, None
        self._whole_step = not self.layerwise
        self._async_pending.update(step.async_loads)
        if step.metadata is None:
            self._load_error = "the scheduler side failed to build the step's metadata"
        else:
            self.connector.bind_connector_metadata(step.metadata)
            self._call_load(self.connector.start_load_kv)
        if self._load_error is not None:  # found before the forward: those requests stay out of it
            self._fail_sync_loads()
        elif self._whole_step:
            self.before_graph()

    def before_graph(self) -> None:
        """The step runs as one CUDA graph (or its layers have no hooks): wait for every
        layer's loads now; ``end`` saves every layer."""
        if self._step is None or self._load_error is not None:
            return
        self._whole_step = True
        for name in self.layer_names:
            self.wait_for_layer_load(name)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Per layer, before its attention (``Attention.run_backend``)."""
        if self._step is not None and self._load_error is None and self.connector is not None:
            self._call_load(self.connector.wait_for_layer_load, layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Per layer, after its attention wrote the step's KV."""
        if self._step is not None and self._step.metadata is not None and self.connector is not None:
            try:
                self.connector.save_kv_layer(layer_name, kv_layer, attn_metadata)
            except Exception:
                self._save_failed("save_kv_layer")

    def end(self, scheduler_output: SchedulerOutput) -> None:
        """The forward has run: finish the step's saves and collect what it reports."""
        connector, step = self.connector, self._step
        if connector is None or step is None:
            return
        if step.metadata is not None:
            if self._whole_step:
                for name in self.layer_names:
                    self.save_kv_layer(name, self._caches[name], None)
            try:
                connector.wait_for_save()
            except Exception:
                self._save_failed("wait_for_save")
        output = KVConnectorOutput()
        try:
            sending, recving = connector.get_finished(set(scheduler_output.finished_req_ids))
            output.finished_sending, output.finished_recving = set(sending or ()), set(recving or ())
            output.invalid_block_ids = set(connector.get_block_ids_with_load_errors())
        except Exception as exc:
            logger.exception("KV connector %s raised reporting its transfers", self.name)
            self._load_error = f"get_finished raised {type(exc).__name__}: {exc}"
        if self._load_error is not None:  # every load of the step, and every one still pending, failed
            self._fail_sync_loads()
            output.finished_recving |= set(self._async_pending)
            output.invalid_block_ids |= {b for blocks in self._async_pending.values() for b in blocks}
        elif output.invalid_block_ids:
            self._fail_sync_loads(output.invalid_block_ids)
        for request_id in output.finished_recving:
            self._async_pending.pop(request_id, None)
        try:
            self._stats.merge(connector.get_stats())
        except Exception:
            logger.exception("KV connector %s raised in get_stats", self.name)
        connector.clear_connector_metadata()
        self._step = None
        stats, self._stats = self._stats, KVTransferStats()
        self._report = KVConnectorReport(output, stats)
        if scheduler_output.total_num_scheduled_tokens == 0 and not (output.finished_recving or output.finished_sending):
            time.sleep(IDLE_STEP_WAIT_S)

    def attach(self, pending: PendingModelRunnerOutput | None) -> PendingModelRunnerOutput | None:
        """``pending`` carrying the last step's report into its ``ModelRunnerOutput`` (None,
        a step whose sampling comes later: the report waits for it)."""
        if pending is None or self._report is None:
            return pending
        report, self._report = self._report, None
        return _WithReport(pending, report)

    def shutdown(self) -> None:
        if self.connector is not None:
            try:
                self.connector.shutdown()
            except Exception:
                logger.exception("KV connector %s raised in shutdown", self.name)

    # ------------------------------------------------------------------ failures

    def _call_load(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            logger.exception("KV connector %s raised loading KV", self.name)
            self._load_error = f"{getattr(fn, '__name__', 'loading')} raised {type(exc).__name__}: {exc}"

    def _fail_sync_loads(self, blocks: set[int] | None = None) -> None:
        """Fail the requests of the step whose synchronous loads failed (those with a block
        in ``blocks``, or all of them)."""
        if self._step is None:
            return
        why = self._load_error or "it reported blocks that failed to load"
        for request_id, loaded in self._step.sync_loads.items():
            if request_id not in self.failures and (blocks is None or not blocks.isdisjoint(loaded)):
                self.failures.add(request_id, f"loading its KV through KV connector {self.name} failed ({why})")
                self._stats.failed_loads += 1

    def _save_failed(self, method: str) -> None:
        logger.exception("KV connector %s raised in %s: the step's KV is not saved", self.name, method)
        self._stats.failed_saves += 1


class _WithReport(PendingModelRunnerOutput):
    """A step's pending output that carries the KV connector's report."""

    def __init__(self, pending: PendingModelRunnerOutput, report: KVConnectorReport) -> None:
        self._pending = pending
        self._report = report

    def get_output(self) -> ModelRunnerOutput:
        output = self._pending.get_output()
        output.kv_connector_output = self._report
        return output
