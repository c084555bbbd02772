"""POST /v1/embeddings (OpenAI's API) and POST /pooling (vLLM's), for pooling models.

``/pooling`` takes ``{"input": ...}`` like ``/v1/embeddings`` and answers vLLM's pooling
shape; when the server runs an IO processor plugin it takes ``{"data": ...}`` instead and
runs the plugin: ``parse_data`` -> ``pre_process_async`` -> one engine request per prompt
-> ``post_process_async`` (outputs handed over as they finish, with their prompt index).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import numpy as np

from kvloom.entrypoints.openai.errors import APIError
from kvloom.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    IOProcessorRequest,
    IOProcessorResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    UsageInfo,
)
from kvloom.entrypoints.openai.serving_engine import OpenAIServing, random_id
from kvloom.lora.request import LoRARequest
from kvloom.model_limits import params_problems, prompt_problems
from kvloom.outputs import PoolingRequestOutput
from kvloom.pooling.io_processors import as_prompt_list
from kvloom.sampling_params import PoolingParams

if TYPE_CHECKING:
    from kvloom.engine.async_llm import AsyncLLM
    from kvloom.entrypoints.openai.limits import ServerLimits
    from kvloom.entrypoints.openai.serving_models import OpenAIServingModels
    from kvloom.io_processor import IOProcessor


def encode_vector(vector: Any, encoding_format: str) -> list[float] | str:
    """A pooled vector as floats, or as base64 of little-endian float32 (OpenAI's format)."""
    array = np.asarray(vector.float().numpy() if hasattr(vector, "numpy") else vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array.tolist()


class OpenAIServingPooling(OpenAIServing):
    def __init__(
        self,
        engine: "AsyncLLM",
        models: "OpenAIServingModels | None" = None,
        io_processor: "IOProcessor | None" = None,
        limits: "ServerLimits | None" = None,
    ) -> None:
        super().__init__(engine, models, limits)
        self.io_processor = io_processor

    def _require_pooling_model(self) -> None:
        if self.config.model.runner != "pooling":
            raise APIError(f"The model {self.model_name} generates text and has no pooling (embedding) API; "
                           "serve an embedding model or start the server with --runner pooling",
                           status=HTTPStatus.BAD_REQUEST, code="unsupported_model")  # fmt: skip

    async def _encode_each(
        self, request_id: str, prompts: Sequence[Any], params: PoolingParams, lora: LoRARequest | None
    ) -> AsyncIterator[tuple[int, PoolingRequestOutput]]:
        """Run one engine request per prompt; yield (prompt index, final output) as each
        finishes, through the same merge as generation (``OpenAIServing.merged``): leaving
        early aborts the rest, engine errors become API errors."""
        streams = await self.admit(request_id, list(prompts), [params] * len(prompts), lora)
        async with aclosing(self.merged(streams, request_id)) as outputs:
            async for index, output in outputs:
                if output.finished:
                    yield index, output

    async def _prompts(self, request: EmbeddingRequest) -> list[dict[str, Any]]:
        inputs = request.inputs()
        self.check_num_sequences(len(inputs), 1, "input")
        prompts = []
        for item in inputs:
            prompt = await self.tokenize_async(item, add_special_tokens=request.add_special_tokens, param="input")
            problems = prompt_problems(prompt.token_ids, self.model_limits, pooling=True,
                                       names={"prompt": "input", "prompt_token_ids": "input"})  # fmt: skip
            too_long = len(prompt.token_ids) > self.max_model_len
            self.raise_first(problems, code="context_length_exceeded" if too_long else None)
            prompts.append({"prompt_token_ids": prompt.token_ids})
        return prompts

    async def _pool(self, request: EmbeddingRequest, prefix: str) -> tuple[str, list[Any], UsageInfo]:
        self._require_pooling_model()
        lora = await self.resolve_model_or_lora(request.model)
        prompts = await self._prompts(request)
        params = PoolingParams(normalize=request.normalize, dimensions=request.dimensions)
        self.raise_first(params_problems(params, self.model_limits))
        request_id = random_id(prefix)
        vectors: list[Any] = [None] * len(prompts)
        async for index, output in self._encode_each(request_id, prompts, params, lora):
            vectors[index] = output.outputs.data
        num_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        return request_id, vectors, UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        request_id, vectors, usage = await self._pool(request, "embd")
        fmt = request.encoding_format
        data = [EmbeddingData(index=i, embedding=encode_vector(v, fmt)) for i, v in enumerate(vectors)]
        return EmbeddingResponse(id=request_id, model=self.models.response_name(request.model), data=data, usage=usage)

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        request_id, vectors, usage = await self._pool(request, "pool")
        data = [PoolingData(index=i, data=encode_vector(v, request.encoding_format)) for i, v in enumerate(vectors)]
        return PoolingResponse(id=request_id, model=self.models.response_name(request.model), data=data, usage=usage)

    async def create_io_processor_pooling(self, request: IOProcessorRequest) -> IOProcessorResponse:
        processor = self.io_processor
        if processor is None:
            raise APIError('data: this server runs no IO processor plugin (start it with --io-processor-plugin NAME); '
                           'send {"input": ...} instead', param="data")  # fmt: skip
        lora = await self.resolve_model_or_lora(request.model)
        request_id = random_id("pool")
        try:
            parsed = processor.parse_data(request.data)
            prompts = as_prompt_list(await processor.pre_process_async(parsed, request_id=request_id))
        except ValueError as exc:
            raise APIError(f"data: {exc}", param="data") from None
        self.check_num_sequences(len(prompts), 1, "data")
        params = processor.merge_pooling_params(None)
        result = await processor.post_process_async(
            self._encode_each(request_id, prompts, params, lora), request_id=request_id
        )
        return IOProcessorResponse(request_id=request_id, data=result)
