"""What a KV connector's worker side reports after a step, on its way to the scheduler.

A leaf module (it imports nothing of kvloom but the stats): the model runner's outputs
(``kvloom.outputs``) carry it, and the contract (``kvloom.kv_transfer.base``) names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.metrics.scheduler_stats import KVTransferStats


@dataclass
class KVConnectorOutput:
    """What the worker side reported after one step (``update_connector_output``)."""

    finished_sending: set[str] = field(default_factory=set)
    """Requests whose asynchronous saves or sends completed: their blocks are freed now."""
    finished_recving: set[str] = field(default_factory=set)
    """Requests whose asynchronous loads completed (successfully or not)."""
    invalid_block_ids: set[int] = field(default_factory=set)
    """Device blocks that failed to load."""


@dataclass
class KVConnectorReport:
    """The KV connector's worker side after one step (``kvloom.worker.kv_connector``)."""

    output: KVConnectorOutput
    #: Its transfer counts since the last step.
    stats: KVTransferStats | None = None
