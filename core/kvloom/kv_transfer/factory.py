"""Which connector class ``kv_transfer_config`` names, whether it can run the engine, and
building it.

A connector is found by ``kv_connector``: a plugin of the ``kvloom.kv_connectors`` group
whose ``NAME`` (or one of its ``aliases``, vLLM's old names) it is, or, with
``kv_connector_module_path``, the class of that name in that module (vLLM's way to run a
connector that is no plugin). A name no installed connector has is an error naming the
package to install for kvloom's own connectors, or saying that kvloom has no such connector
yet for vLLM's others. The connector's ``validate_config`` reasons, a role it cannot play
and more than one worker rank are refused when the config is resolved; a model of several
KV-cache groups is refused when the connector is built, unless the connector serves them.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from kvloom.kv_cache.spec import engine_kv_cache_config
from kvloom.kv_transfer.base import KVCacheGroupSpec, KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)

#: kvloom's own connectors and the distribution of each: what an error tells the user to install.
FIRST_PARTY_CONNECTORS: dict[str, str] = {
    "ExampleConnector": "kvloom-kv-shared-storage",
    "SharedStorageConnector": "kvloom-kv-shared-storage",
    "OffloadingConnector": "kvloom-kv-offload",
    "P2pNcclConnector": "kvloom-kv-p2p",
}

#: vLLM's other connectors: asking for one is answered as "not supported yet", not "unknown".
VLLM_CONNECTORS: tuple[str, ...] = (
    "NixlConnector", "LMCacheConnectorV1", "LMCacheMPConnector", "MooncakeConnector", "MultiConnector",
    "DecodeBenchConnector", "SimpleCPUOffloadConnector", "MoRIIOConnector", "FlexKVConnectorV1",
)  # fmt: skip


def _installed() -> dict[str, type[KVConnectorBase]]:
    from kvloom import plugins

    return plugins.kv_connectors()


def connector_class(transfer: KVTransferConfig) -> type[KVConnectorBase]:
    """The class ``transfer.kv_connector`` names (see the module docstring); a
    ``ValueError`` naming ``kv_transfer_config.kv_connector`` otherwise."""
    name = transfer.kv_connector
    if name is None:
        raise ValueError("kv_transfer_config.kv_connector: required (the connector's name, e.g. ExampleConnector)")
    if transfer.kv_connector_module_path is not None:
        return _from_module(transfer.kv_connector_module_path, name)
    installed = _installed()
    if name in installed:
        return installed[name]
    for cls in installed.values():
        if name in cls.aliases:
            logger.warning("kv_connector %r is vLLM's old name of %s: use %s", name, cls.NAME, cls.NAME)
            return cls
    listed = ", ".join(sorted(installed)) or "none"
    if name in FIRST_PARTY_CONNECTORS:
        package = FIRST_PARTY_CONNECTORS[name]
        raise ValueError(f"kv_transfer_config.kv_connector: {name!r} needs the package {package} (pip install "
                         f"{package}; installed KV connectors: {listed})")  # fmt: skip
    if name in VLLM_CONNECTORS:
        raise ValueError(f"kv_transfer_config.kv_connector: {name!r} is not supported by kvloom yet (installed KV "
                         f"connectors: {listed})")  # fmt: skip
    raise ValueError(f"kv_transfer_config.kv_connector: {name!r} is not a KV connector kvloom knows (installed: "
                     f"{listed}; or kv_connector_module_path naming the module of the class)")  # fmt: skip


def _from_module(module_path: str, name: str) -> type[KVConnectorBase]:
    try:
        module = importlib.import_module(module_path)
    except Exception as exc:
        raise ValueError(f"kv_transfer_config.kv_connector_module_path: cannot import {module_path!r} "
                         f"({type(exc).__name__}: {exc})") from None  # fmt: skip
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"kv_transfer_config.kv_connector: module {module_path!r} has no KV connector class "
                         f"{name!r} (a subclass of kvloom.interfaces.KVConnectorBase)")  # fmt: skip
    return cls


def check_transfer_config(config: EngineConfig) -> None:
    """Refuse a ``kv_transfer_config`` the engine cannot run (a ``ValueError`` naming the
    field): its connector's reasons, several KV-cache groups it does not serve, more than
    one worker rank."""
    transfer = config.kv_transfer
    if transfer is None or transfer.kv_connector is None:
        return
    cls = connector_class(transfer)
    reasons = list(cls.validate_config(config))
    num_groups = engine_kv_cache_config(config).num_groups
    if num_groups > 1 and not cls.supports_hybrid_kv_cache:
        reasons.append(f"the model has {num_groups} KV-cache groups (sliding-window or hybrid layers), which "
                       f"{cls.NAME} cannot save or load")  # fmt: skip
    if config.parallel.world_size > 1:
        reasons.append("KV connectors run with one worker rank for now (tensor- and pipeline-parallel size 1): "
                       "the transfers of several ranks are not combined yet")  # fmt: skip
    if reasons:
        raise ValueError(f"kv_transfer_config: connector {cls.NAME} cannot run this engine: " + "; ".join(reasons))


def make_connector(
    config: EngineConfig, role: KVConnectorRole, kv_cache_groups: tuple[KVCacheGroupSpec, ...]
) -> KVConnectorBase:
    """Build the connector of ``config.kv_transfer`` in ``role``; a model of several
    KV-cache groups is refused unless the connector serves them."""
    assert config.kv_transfer is not None
    cls = connector_class(config.kv_transfer)
    if len(kv_cache_groups) > 1 and not cls.supports_hybrid_kv_cache:
        raise ValueError(f"kv_transfer_config.kv_connector: {cls.NAME} handles models of one KV-cache group; this "
                         f"model has {len(kv_cache_groups)} (a hybrid KV cache), which {cls.NAME} cannot "
                         "save or load")  # fmt: skip
    return cls(config, role, kv_cache_groups)


def scheduler_side(config: EngineConfig) -> KVConnectorBase | None:
    """The scheduler side of ``config``'s connector (None without one). The scheduler
    knows no layer names: its group specs carry the block size only."""
    if config.kv_transfer is None:
        return None
    return make_connector(config, KVConnectorRole.SCHEDULER, (KVCacheGroupSpec((), config.cache.block_size),))


def check_kv_transfer_params(connector: KVConnectorBase | None, params: dict[str, Any]) -> str | None:
    """Why a request's ``kv_transfer_params`` are refused: the engine runs no connector, or
    ``connector`` refuses them (or raised checking them); None if they are fine."""
    if connector is None:
        return "this engine runs no KV connector (start it with --kv-transfer-config)"
    try:
        return connector.validate_kv_transfer_params(params)
    except Exception as exc:
        logger.exception("KV connector %s raised in validate_kv_transfer_params", connector.NAME)
        return f"KV connector {connector.NAME} failed checking them ({type(exc).__name__}: {exc})"
