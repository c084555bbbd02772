"""The IO processor plugin contract (pre/post-processing around pooling models).

A plugin registers in ``kvloom.io_processor_plugins``; the entry point names an
``IOProcessor`` subclass. It is chosen with ``--io-processor-plugin NAME`` or the model
config's ``io_processor_plugin`` field, and runs parse_data -> pre_process -> encode
-> post_process for ``LLM.encode`` and ``POST /pooling``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvloom.inputs import PromptType  # what pre_process returns; part of the plugin contract
from kvloom.sampling_params import PoolingParams

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.outputs import PoolingRequestOutput

IOProcessorInput = TypeVar("IOProcessorInput")
IOProcessorOutput = TypeVar("IOProcessorOutput")


class IOProcessor(ABC, Generic[IOProcessorInput, IOProcessorOutput]):
    """Turns a request's own input into model prompts and their pooled outputs into its own
    output, around a pooling model.

    kvloom builds one per engine with the ``EngineConfig`` (kept as ``self.config``).
    Offline, ``LLM.encode(data)`` runs ``parse_data`` -> ``pre_process`` ->
    ``merge_pooling_params`` -> pooling of every prompt -> ``post_process``; online,
    ``POST /pooling`` runs ``parse_data`` -> ``pre_process_async`` -> pooling ->
    ``post_process_async``. A ``ValueError`` from ``parse_data`` or pre-processing is the
    caller's error (HTTP 400).
    """

    def __init__(self, config: "EngineConfig") -> None:
        self.config = config

    @abstractmethod
    def parse_data(self, data: object) -> IOProcessorInput:
        """Validate the user's raw input; raise ValueError naming what is wrong."""

    def merge_pooling_params(self, params: PoolingParams | None = None) -> PoolingParams:
        """The ``PoolingParams`` every prompt of the request is pooled with, given the
        caller's (``LLM.encode``'s ``pooling_params``; ``None`` from ``POST /pooling``).
        Default: theirs, or the defaults."""
        return params or PoolingParams()

    @abstractmethod
    def pre_process(
        self, prompt: IOProcessorInput, request_id: str | None = None, **kwargs: Any
    ) -> PromptType | Sequence[PromptType]:
        """Turn the parsed input into one or more model prompts."""

    async def pre_process_async(
        self, prompt: IOProcessorInput, request_id: str | None = None, **kwargs: Any
    ) -> PromptType | Sequence[PromptType]:
        """``pre_process`` for the server (``POST /pooling``); override it for I/O-bound
        work. Default: calls ``pre_process``."""
        return self.pre_process(prompt, request_id, **kwargs)

    @abstractmethod
    def post_process(
        self,
        model_output: Sequence["PoolingRequestOutput"],
        request_id: str | None = None,
        **kwargs: Any,
    ) -> IOProcessorOutput:
        """Turn the pooled outputs (in prompt order) into the plugin's output. For
        ``POST /pooling`` it must be JSON-serialisable (dicts, lists, str, numbers, bool,
        None, dataclasses, pydantic models; a tensor is not: ``.tolist()`` it); anything
        else, and any exception raised here, is a 500 for the client."""

    async def post_process_async(
        self,
        model_output: AsyncGenerator[tuple[int, "PoolingRequestOutput"], None],
        request_id: str | None = None,
        **kwargs: Any,
    ) -> IOProcessorOutput:
        """``post_process`` for the server: ``model_output`` yields ``(prompt index,
        output)`` pairs as the prompts finish. Default: collects them, sorts them by prompt
        index and calls ``post_process``. The result is the response's ``data`` and must be
        JSON-serialisable (see ``post_process``)."""
        # Outputs may arrive in any order: sort by prompt index first.
        collected = sorted([(i, item) async for i, item in model_output], key=lambda x: x[0])
        return self.post_process([item for _, item in collected], request_id=request_id, **kwargs)
