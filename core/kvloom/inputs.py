"""What an entry point hands to the engine.

``PromptType``: what a prompt may be, for every entry point (``LLM``, ``LLMEngine``,
``AsyncLLM``, IO processor plugins): one definition, as vLLM's ``vllm.inputs.PromptType``.
``RequestInput``: one request as the public ``add_request`` / ``generate`` / ``encode``
build it from their arguments; the front end (``Frontend.add_request``,
``InputProcessor.process``) takes it whole. A leaf module, so that the engine and the
plugin contract import it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvloom.lora.request import LoRARequest
from kvloom.sampling_params import PoolingParams, SamplingParams

#: Text, ``{"prompt_token_ids": [...]}`` (with an optional ``"prompt"`` text), or ``{"prompt": str}``.
PromptType = str | dict[str, Any]


@dataclass(frozen=True, slots=True)
class RequestInput:
    """One request, before it is validated and tokenized (the arguments of vLLM's
    ``LLMEngine.add_request``)."""

    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    """``SamplingParams`` to generate, ``PoolingParams`` to pool."""
    arrival_time: float | None = None
    """``time.time()`` when it arrived; None: when the front end takes it."""
    lora_request: LoRARequest | None = None
    priority: int = 0
    """Under ``--scheduling-policy priority``: lower runs first."""
    cache_salt: str | None = None
    """Keeps the request's prefix-cache blocks apart from requests with another salt."""
