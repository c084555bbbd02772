"""The LoRA resolver plugin contract.

Resolvers register in ``kvloom.lora_resolvers`` (the entry point names a ``LoRAResolver``
subclass, constructed with no arguments). When a request names an adapter the server
does not know, resolvers are tried in registration order until one returns a
``LoRARequest``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvloom.lora.request import LoRARequest


class LoRAResolver(ABC):
    """Finds LoRA adapters by name for the server, when a request names an unknown model.

    Built once with no arguments when kvloom loads its plugins; asked only when the server
    runs with ``--enable-lora`` and ``KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1``. The server
    keeps the ``lora_path`` of the answer: it loads the adapter from there under the
    requested name (with its own id) and serves every later request for that name from it.
    """

    @abstractmethod
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """Find adapter ``lora_name`` for ``base_model_name``; None if this resolver has
        no such adapter. Raise ``ValueError`` with a clear message when the adapter exists
        but is invalid (wrong peft_type, base model, rank too large)."""


class _LoRAResolverRegistry:
    """Named resolvers, in registration order."""

    def __init__(self) -> None:
        self._resolvers: dict[str, LoRAResolver] = {}

    def register_resolver(self, name: str, resolver: LoRAResolver) -> None:
        if not isinstance(resolver, LoRAResolver):
            raise TypeError(f"LoRA resolver {name!r} must be a LoRAResolver instance, got {type(resolver)!r}")
        if name in self._resolvers:
            raise ValueError(f"LoRA resolver {name!r} is registered twice")
        self._resolvers[name] = resolver

    def get_supported_resolvers(self) -> list[str]:
        return list(self._resolvers)

    def get_resolver(self, name: str) -> LoRAResolver:
        if name not in self._resolvers:
            raise KeyError(f"LoRA resolver {name!r} is not registered (have: {', '.join(self._resolvers) or 'none'})")
        return self._resolvers[name]

    def resolvers(self) -> list[LoRAResolver]:
        return list(self._resolvers.values())

    def clear(self) -> None:
        self._resolvers.clear()


#: The process-wide registry (vLLM's name for it).
LoRAResolverRegistry = _LoRAResolverRegistry()
