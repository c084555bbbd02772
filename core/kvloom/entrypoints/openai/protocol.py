"""Request and response bodies of the OpenAI-compatible API, with OpenAI's field names.

Requests are strict (a string where a number belongs is an error, not a coercion) and
forbid unknown fields, so a typo is a 400 naming the field rather than a silently ignored
option. Ranges mirror ``kvloom.sampling_params.SamplingParams``. vLLM's extensions
(top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, cache_salt,
priority, ...) sit next to OpenAI's fields, as vLLM users pass them through
``extra_body``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvloom.sampling_params import (
    _MAX_SEED,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RequestOutputKind,
    SamplingParams,
)

MAX_LOGPROBS = 20


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class OpenAIResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------- errors and shared parts


class ErrorInfo(OpenAIResponse):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIResponse):
    error: ErrorInfo


class UsageInfo(OpenAIResponse):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


def _stop_strings(value: Any) -> Any:
    """``stop`` is a string or a list of at most MAX_STOP_STRINGS strings (or null), each
    of at most MAX_STOP_STRING_LENGTH characters."""
    if value is None:
        return value
    strings = [value] if isinstance(value, str) else value
    if not (isinstance(strings, list) and all(isinstance(s, str) for s in strings)):
        raise ValueError("must be a string or a list of strings")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(strings)} stop strings are too many (allowed: at most {MAX_STOP_STRINGS})")
    for s in strings:
        if len(s) > MAX_STOP_STRING_LENGTH:
            raise ValueError(f"a stop string has {len(s)} characters (allowed: 1..{MAX_STOP_STRING_LENGTH})")
    return value


def _logit_bias(value: Any) -> Any:
    """OpenAI's ``logit_bias``: {"token id": bias}, bias in [-100, 100]."""
    if value is None:
        return value
    if not isinstance(value, dict):
        raise ValueError('must be an object mapping token ids to biases ({"50256": -100})')
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"{len(value)} entries are too many (allowed: at most {MAX_LOGIT_BIAS_ENTRIES})")
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise ValueError(f"key {key[:20]!r} is not a token id (a decimal number, 0 <= id < the vocabulary size)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"the bias of token {key} must be a number in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] "
                             f"(got {bias!r:.30})")  # fmt: skip
    return value


class SamplingRequest(OpenAIRequest):
    """The fields completions and chat completions share."""

    model: str | None = Field(None, description="Served model or LoRA adapter name (default: the served model).")
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-_MAX_SEED, le=_MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables top-k; at most the vocabulary size.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1)
    priority: int = 0

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        return _stop_strings(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> Any:
        return _logit_bias(value)

    @model_validator(mode="after")
    def _check_stream_options(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """SamplingParams of one prompt's engine request, all n choices of it (the engine
        fans n out, see ``serving_engine``)."""
        values: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "seed": self.seed,
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            "output_kind": RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        return SamplingParams(**values)


# ----------------------------------------------------------------- /v1/completions


def _check_prompt(value: Any) -> Any:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    message = "must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(message + " (and not empty)")
    if all(isinstance(p, str) for p in value):
        return value
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in value):
        return value
    raise ValueError(message)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None
    # vLLM extension: logprobs of the prompt tokens (echo=True with logprobs implies it).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return _check_prompt(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("is not supported by kvloom")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n is supported (got best_of={self.best_of}, n={self.n})")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch: each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionLogProbs(OpenAIResponse):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------- /v1/chat/completions


class ChatContentPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessageParam(OpenAIRequest):
    # Extra keys (tool_calls, ...) pass through to the chat template unchanged.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        def is_text_part(part: Any) -> bool:
            return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)

        if isinstance(value, list) and all(is_text_part(part) for part in value):
            return value
        raise ValueError("must be a string or a list of text parts ({'type': 'text', 'text': ...}); "
                         "kvloom serves text-only models")

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.tools:
            raise ValueError("tools: tool calling is not supported by kvloom")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: tool calling is not supported by kvloom")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported by kvloom")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class ChatMessage(OpenAIResponse):
    role: str
    content: str | None = None


class ChatCompletionLogProb(OpenAIResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIResponse):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIResponse):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIResponse):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------- models, tokenizer


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvloom"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeCompletionRequest(OpenAIRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIRequest):
    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(OpenAIResponse):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]  # token ids: checked against the vocabulary by the server


class DetokenizeResponse(OpenAIResponse):
    prompt: str


# ----------------------------------------------------------------- LoRA adapters (vLLM's bodies)


class LoadLoRAAdapterRequest(OpenAIRequest):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIRequest):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# ----------------------------------------------------------------- embeddings and pooling

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(OpenAIRequest):
    """POST /v1/embeddings (OpenAI's fields, plus vLLM's ``normalize`` and
    ``add_special_tokens``)."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: EmbeddingInput) -> EmbeddingInput:
        if isinstance(value, list) and not value:
            raise ValueError("must not be an empty list")
        return value

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding: a text or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(v, int) for v in value):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]


class PoolingRequest(EmbeddingRequest):
    """POST /pooling without an IO processor plugin: vLLM's shape, embeddings as ``data``."""


class EmbeddingData(OpenAIResponse):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIResponse):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(OpenAIResponse):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIResponse):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class IOProcessorRequest(OpenAIRequest):
    """POST /pooling with an IO processor plugin: the plugin parses ``data``."""

    model_config = ConfigDict(extra="forbid", strict=False)

    model: str | None = None
    data: Any


class IOProcessorResponse(OpenAIResponse):
    request_id: str | None = None
    created_at: int = Field(default_factory=lambda: int(time.time()))
    data: Any
