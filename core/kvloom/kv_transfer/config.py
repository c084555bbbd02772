"""``KVTransferConfig``: which KV connector an engine runs, as vLLM's JSON says it.

``--kv-transfer-config '{"kv_connector": "ExampleConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'`` and
``LLM(kv_transfer_config=KVTransferConfig(...))`` (or a dict) take vLLM's fields as written;
an unknown field or a bad value is an error naming it and the allowed values. vLLM's
``--kv-offloading-size GiB`` / ``--kv-offloading-backend native`` build the same config
for the CPU-offloading connector (``offloading_transfer_config``).

This module imports no torch: ``EngineArgs`` validates the flag with it, and the CLI
builds its flags from ``EngineArgs`` without loading the engine.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")
LoadFailurePolicy = Literal["recompute", "fail"]

#: vLLM's name of the CPU-offloading connector, which ``--kv-offloading-size`` selects.
OFFLOADING_CONNECTOR = "OffloadingConnector"
#: ``--kv-offloading-backend`` values: kvloom runs ``native`` (vLLM also names ``lmcache``).
OFFLOADING_BACKENDS: tuple[str, ...] = ("native", "lmcache")


class KVTransferConfig(BaseModel):
    """The KV connector of an engine (vLLM's ``KVTransferConfig``, field for field)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    kv_connector: str | None = None
    """The connector's name: an entry point of the ``kvloom.kv_connectors`` group
    (``ExampleConnector``, ``OffloadingConnector``, ``P2pNcclConnector``, ...), or a class
    of ``kv_connector_module_path``."""
    kv_role: KVRole | None = None
    """``kv_producer`` (saves KV for others), ``kv_consumer`` (loads KV others saved) or
    ``kv_both``; required with ``kv_connector``."""
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    """The connector's own options (e.g. ``shared_storage_path``); each connector checks its keys."""
    kv_connector_module_path: str | None = None
    """A Python module to import ``kv_connector`` from, for a connector that is not an
    installed plugin (vLLM's escape hatch)."""
    kv_load_failure_policy: LoadFailurePolicy = "fail"
    """What a failed load does: ``fail`` finishes the request with an error; ``recompute``
    computes the KV that did not arrive (asynchronous loads; see docs/kv_connectors.md)."""
    engine_id: str | None = None
    """This engine's id in transfers (a proxy names the prefill engine by it); default: a fresh one."""
    kv_buffer_device: str = "cuda"
    """Where transfer buffers live (vLLM's field; kvloom's connectors use the KV cache's device)."""
    kv_buffer_size: float = Field(1e9, gt=0)
    """Transfer buffer bytes (vLLM's field; read by connectors that buffer)."""
    kv_rank: int | None = Field(None, ge=0)
    """This instance's rank among the ``kv_parallel_size`` transfer peers: 0 for the prefill
    instance, 1 for the decode instance of a 1P1D pair."""
    kv_parallel_size: int = Field(1, ge=1)
    """How many instances transfer KV among themselves (2 for P2P 1P1D)."""
    kv_ip: str = "127.0.0.1"
    """The address of the transfer rendezvous (P2P: where rank 0 listens)."""
    kv_port: int = Field(14579, ge=1, le=65535)
    """The port of the transfer rendezvous."""

    @field_validator("kv_connector", "kv_connector_module_path")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a non-empty name")
        return value.strip() if value is not None else None

    @model_validator(mode="after")
    def _role_with_connector(self) -> KVTransferConfig:
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(f"kv_role: required with kv_connector (allowed: {', '.join(KV_ROLES)})")
        return self

    @property
    def is_kv_producer(self) -> bool:
        """Whether this engine saves KV for others (``kv_producer`` or ``kv_both``)."""
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """Whether this engine loads KV others saved (``kv_consumer`` or ``kv_both``)."""
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        """``kv_connector_extra_config[key]``, or ``default``."""
        return self.kv_connector_extra_config.get(key, default)


def parse_kv_transfer_config(value: Any) -> KVTransferConfig | None:
    """A ``KVTransferConfig`` from what a user passes: one, a dict, or its JSON text; a
    ``ValueError`` whose message names each bad field as ``kv_transfer_config.FIELD``."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"kv_transfer_config: not a JSON object: {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_config: must be a JSON object (a dict), got {type(value).__name__}")
    try:
        return KVTransferConfig(**value)
    except ValidationError as exc:
        raise ValueError(describe_errors(exc)) from None


def describe_errors(exc: ValidationError) -> str:
    """One message naming each bad field of a ``KVTransferConfig``."""
    problems = []
    for error in exc.errors():
        loc = ".".join(str(part) for part in error["loc"])
        msg = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            msg = f"unknown field (allowed: {', '.join(KVTransferConfig.model_fields)})"
        problems.append(f"kv_transfer_config.{loc}: {msg}" if loc else f"kv_transfer_config.{msg}")
    return "; ".join(problems)


def offloading_transfer_config(
    transfer: KVTransferConfig | None, size_gib: float | None, backend: str
) -> KVTransferConfig | None:
    """The connector config of vLLM's ``--kv-offloading-size`` (GiB of host memory) and
    ``--kv-offloading-backend``: ``OffloadingConnector``, ``kv_both``, with
    ``cpu_bytes_to_use`` in its extra config. Without a size, ``transfer`` as it is."""
    if size_gib is None:
        return transfer
    if backend != "native":
        raise ValueError(f"kv_offloading_backend: {backend!r} is not supported by kvloom yet (allowed: native)")
    if transfer is not None and transfer.kv_connector not in (None, OFFLOADING_CONNECTOR):
        raise ValueError(f"kv_offloading_size: offloading runs the {OFFLOADING_CONNECTOR}, but kv_transfer_config "
                         f"names {transfer.kv_connector!r}; give one of the two")  # fmt: skip
    extra = dict(transfer.kv_connector_extra_config) if transfer is not None else {}
    extra["cpu_bytes_to_use"] = int(size_gib * 2**30)
    fields = transfer.model_dump() if transfer is not None else {}
    fields.update(kv_connector=OFFLOADING_CONNECTOR, kv_role=fields.get("kv_role") or "kv_both",
                  kv_connector_extra_config=extra)  # fmt: skip
    return KVTransferConfig(**fields)
