"""kvloom's public plugin API, in one module.

Plugin authors import everything from here::

    from kvloom.interfaces import AttentionBackend, Platform, KVLOOM_PLUGIN_API

Every module that an entry point names must declare the API version it was written
against, as a module-level constant::

    KVLOOM_PLUGIN_API = "1.0"

kvloom refuses a plugin whose major version differs from ``PLUGIN_API_VERSION``'s,
with a message naming both versions.
"""

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    AttentionSelectorConfig,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from kvloom.hookspecs import hookimpl
from kvloom.io_processor import IOProcessor, PromptType
from kvloom.lora.request import LoRARequest
from kvloom.lora.resolver import LoRAResolver, LoRAResolverRegistry
from kvloom.metrics.stat_logger_base import StatLoggerBase
from kvloom.platforms.interface import BackendCandidate, DeviceCapability, Platform
from kvloom.plugins import PLUGIN_API_VERSION
from kvloom.worker.worker_base import WorkerBase

KVLOOM_PLUGIN_API = PLUGIN_API_VERSION

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionLayerSpec",
    "AttentionMetadataBuilder",
    "AttentionSelectorConfig",
    "AttentionType",
    "BackendCandidate",
    "CommonAttentionMetadata",
    "DeviceCapability",
    "IOProcessor",
    "KVLOOM_PLUGIN_API",
    "LoRARequest",
    "LoRAResolver",
    "LoRAResolverRegistry",
    "MultipleOf",
    "PLUGIN_API_VERSION",
    "Platform",
    "PromptType",
    "StatLoggerBase",
    "WorkerBase",
    "hookimpl",
]
