"""kvloom: an LLM inference and serving engine built as a minimal core plus plugins."""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# vLLM's habit: the library logs (model load, KV cache, speed) without the application
# configuring logging; KVLOOM_CONFIGURE_LOGGING=0 turns this off (kvloom.logger).
from kvloom.logger import configure_logging_on_import as _configure_logging_on_import  # noqa: E402

_configure_logging_on_import()

# Heavy modules load on first use so that `kvloom --help` and plugin discovery stay fast.
_LAZY = {
    "LLM": "kvloom.entrypoints.llm",
    "SamplingParams": "kvloom.sampling_params",
    "StructuredOutputsParams": "kvloom.sampling_params",
    "PoolingParams": "kvloom.sampling_params",
    "RequestOutputKind": "kvloom.sampling_params",
    "RequestOutput": "kvloom.outputs",
    "CompletionOutput": "kvloom.outputs",
    "PoolingRequestOutput": "kvloom.outputs",
    "ScoringRequestOutput": "kvloom.outputs",
    "ScoringOutput": "kvloom.outputs",
    "EngineArgs": "kvloom.engine.arg_utils",
    "LoRARequest": "kvloom.lora.request",
    "ModelRegistry": "kvloom.models.registry",
    "AsyncLLM": "kvloom.engine.async_llm",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from kvloom.engine.arg_utils import EngineArgs  # noqa: F401
    from kvloom.engine.async_llm import AsyncLLM  # noqa: F401
    from kvloom.entrypoints.llm import LLM  # noqa: F401
    from kvloom.lora.request import LoRARequest  # noqa: F401
    from kvloom.models.registry import ModelRegistry  # noqa: F401
    from kvloom.outputs import (  # noqa: F401
        CompletionOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from kvloom.sampling_params import PoolingParams, RequestOutputKind, SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvloom' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["__version__", *_LAZY]
