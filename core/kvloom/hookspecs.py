"""pluggy hook specifications for general plugins.

A ``kvloom.general_plugins`` entry point names either a plain callable ``register()``
(vLLM's convention; called once per process, must be re-entrant) or a module/class that
implements any of the hooks below with ``@kvloom.interfaces.hookimpl``. pluggy checks
each hook implementation against these specs, so a misspelt hook or argument is an error
at load time rather than a silently ignored function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.lora.resolver import _LoRAResolverRegistry
    from kvloom.models.registry import _ModelRegistry

PROJECT_NAME = "kvloom"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class GeneralPluginSpec:
    @hookspec
    def kvloom_register_models(self, model_registry: "_ModelRegistry") -> None:
        """Register out-of-tree model architectures (``model_registry.register_model``)."""

    @hookspec
    def kvloom_register_lora_resolvers(self, resolver_registry: "_LoRAResolverRegistry") -> None:
        """Register LoRA resolvers programmatically (besides ``kvloom.lora_resolvers``)."""

    @hookspec
    def kvloom_update_engine_config(self, config: "EngineConfig") -> None:
        """Adjust the resolved engine config in place: called once per ``EngineConfig``, by
        ``create_engine_config`` when an engine starts, after the platform's
        ``check_and_update_config``; the engine that starts runs with what the hook left."""
