"""The models a server answers to: the base model and its LoRA adapters (vLLM's
``OpenAIServingModels``).

Adapters come from ``--lora-modules name=path`` (ids 1, 2, ... in the order given, loaded
when the server starts), from ``POST /v1/load_lora_adapter``, or from the LoRA resolver
plugins (``kvloom.lora_resolvers``), asked in order when a request names an unknown
model. The last two change the server while it runs, so they need
``KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from http import HTTPStatus
from typing import TYPE_CHECKING

from kvloom.entrypoints.openai.errors import APIError
from kvloom.entrypoints.openai.protocol import ModelCard, ModelList
from kvloom.lora.request import LoRARequest
from kvloom.lora.resolver import LoRAResolverRegistry

if TYPE_CHECKING:
    from kvloom.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

RUNTIME_LORA_ENV = "KVLOOM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


class OpenAIServingModels:
    def __init__(self, engine: "AsyncLLM") -> None:
        self.engine = engine
        config = engine.config
        self.base_model_name = config.model.served_model_name
        #: Every name of the base model (``--served-model-name a b``), the reported one first.
        self.base_model_names = list(config.model.served_model_names or [self.base_model_name])
        self.model_root = config.model.model
        self.max_model_len = config.model.max_model_len
        self.enable_lora = config.lora.enable_lora
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in config.lora.lora_modules.items():
            self.lora_requests[name] = self._new_request(name, path)
        self._lock = asyncio.Lock()

    def _new_request(self, name: str, path: str) -> LoRARequest:
        request = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=path,
                              base_model_name=self.base_model_name)  # fmt: skip
        self._next_id += 1
        return request

    async def load_static_loras(self) -> None:
        """Load the --lora-modules adapters (at startup, so a bad one stops the server)."""
        for request in self.lora_requests.values():
            await self.engine.add_lora(request)

    # ------------------------------------------------------------------ lookup
    def is_base_model(self, name: str | None) -> bool:
        return name is None or name in self.base_model_names

    def response_name(self, requested: str | None) -> str:
        """The ``model`` a response reports (vLLM's rule): the first served name for the base
        model whichever of its names the request used, else the adapter's name."""
        return self.base_model_name if self.is_base_model(requested) else str(requested)

    def known(self, name: str | None) -> LoRARequest | None:
        """The adapter a known model name selects (None = the base model); 404 otherwise."""
        if self.is_base_model(name):
            return None
        assert name is not None
        if name in self.lora_requests:
            return self.lora_requests[name]
        raise self._not_found(name)

    async def resolve(self, name: str | None) -> LoRARequest | None:
        """Like ``known``, but an unknown name is offered to the LoRA resolvers first
        (when runtime updating is allowed); the adapter a resolver finds is loaded."""
        if self.is_base_model(name) or name in self.lora_requests:
            return self.known(name)
        assert name is not None
        resolvers = LoRAResolverRegistry.get_supported_resolvers()
        if not (self.enable_lora and runtime_lora_updating_allowed() and resolvers):
            raise self._not_found(name)
        async with self._lock:  # two requests for a new adapter load it once
            if name in self.lora_requests:
                return self.lora_requests[name]
            for resolver_name in resolvers:
                resolver = LoRAResolverRegistry.get_resolver(resolver_name)
                try:
                    found = await resolver.resolve_lora(self.base_model_name, name)
                except ValueError as exc:
                    raise APIError(f"LoRA adapter {name}: resolver {resolver_name} refused it: {exc}",
                                   param="model", code="invalid_lora_adapter") from None  # fmt: skip
                if found is None:
                    continue
                logger.info("LoRA resolver %s found adapter %s at %s", resolver_name, name, found.lora_path)
                return await self._load(name, found.lora_path)
        raise self._not_found(name, resolvers)

    def _not_found(self, name: str, resolvers: list[str] | None = None) -> APIError:
        available = ", ".join([*self.base_model_names, *self.lora_requests])
        asked = f" (LoRA adapter not found by the resolvers: {', '.join(resolvers)})" if resolvers else ""
        return APIError(f"The model `{name}` does not exist{asked}. Available models: {available}",
                        status=HTTPStatus.NOT_FOUND, param="model", code="model_not_found")  # fmt: skip

    # ------------------------------------------------------------------ runtime updates
    async def _load(self, name: str, path: str) -> LoRARequest:
        request = self._new_request(name, path)
        try:
            await self.engine.add_lora(request)
        except ValueError as exc:
            raise APIError(str(exc), param="lora_path", code="invalid_lora_adapter") from None
        self.lora_requests[name] = request
        return request

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        if not self.enable_lora:
            raise APIError("LoRA is not enabled: start the server with --enable-lora", param="lora_name")
        if self.is_base_model(name) or name in self.lora_requests:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                           code="lora_adapter_exists")  # fmt: skip
        async with self._lock:
            return await self._load(name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        request = self.lora_requests.get(name)
        if request is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", status=HTTPStatus.NOT_FOUND,
                           param="lora_name", code="lora_adapter_not_found")  # fmt: skip
        await self.engine.remove_lora(request.lora_int_id)
        del self.lora_requests[name]

    def model_list(self) -> ModelList:
        cards = [ModelCard(id=name, root=self.model_root, max_model_len=self.max_model_len)
                 for name in self.base_model_names]  # fmt: skip
        for name, lora in self.lora_requests.items():
            cards.append(ModelCard(id=name, root=lora.lora_path, parent=self.base_model_name,
                                   max_model_len=self.max_model_len))  # fmt: skip
        return ModelList(data=cards)
