"""Request and response bodies of the OpenAI-compatible API, with OpenAI's field names.

Requests are strict about the fields kvloom knows (a string where a number belongs is an
error, not a coercion) and tolerant as vLLM is about the rest, since the official clients
and frameworks send fields of newer API versions (``store``, ``metadata``,
``parallel_tool_calls``, ...):

* an unknown field is accepted and ignored; the server logs a warning naming it
  (``ignored_fields``);
* ``null`` for any optional field means its default;
* a field of a feature kvloom has not built (tools, images and audio, structured output,
  ...) that asks for the feature is a 400 naming the field (``NOT_BUILT_*``): ignoring it
  would answer something else than what was asked.

Ranges mirror ``kvloom.sampling_params.SamplingParams``. vLLM's extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, cache_salt, priority,
chat_template_kwargs, ...) sit next to OpenAI's fields, as vLLM users pass them through
``extra_body``.
"""

from __future__ import annotations

import json
import time
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

from kvloom.sampling_params import (
    _MAX_SEED,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RequestOutputKind,
    StructuredOutputsParams,
)

MAX_LOGPROBS = 20
#: Keys of ``structured_outputs`` that are options, not a constraint.
STRUCTURED_OUTPUT_OPTIONS = frozenset({"disable_any_whitespace"})


def _nullable(annotation: Any) -> bool:
    if annotation is Any or annotation is None:
        return True
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _nullable(typing.get_args(annotation)[0])
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)


class OpenAIRequest(BaseModel):
    """A request body: strict types, unknown fields ignored (and remembered, see
    ``ignored_fields``), ``null`` for a field that cannot be null means its default."""

    model_config = ConfigDict(extra="ignore", strict=True)
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _tolerate(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        ignored: list[str] = []
        if isinstance(data, dict):
            fields = cls.model_fields
            if cls.model_config.get("extra") != "allow":
                ignored = [key for key in data if key not in fields]
            data = {key: value for key, value in data.items()
                    if not (value is None and key in fields and not _nullable(fields[key].annotation))}  # fmt: skip
        instance = handler(data)
        if isinstance(instance, OpenAIRequest):
            instance._ignored = ignored
        return instance

    def ignored_fields(self) -> list[str]:
        """The unknown fields of the body, nested ones as ``parent.field``."""
        names = list(self._ignored)
        for name in type(self).model_fields:
            value = getattr(self, name)
            children = value if isinstance(value, list) else [value]
            for index, child in enumerate(children):
                if isinstance(child, OpenAIRequest):
                    where = f"{name}[{index}]" if isinstance(value, list) else name
                    names.extend(f"{where}.{inner}" for inner in child.ignored_fields())
        return names


def check_not_built(request: BaseModel, table: dict[str, tuple[str, tuple[Any, ...]]]) -> None:
    """A 400 (``ValueError`` 'field: ...') for the first field of ``table`` that asks for
    a feature kvloom has not built: a value other than null, empty, false or one of the
    field's harmless values."""
    for name, (feature, harmless) in table.items():
        value = getattr(request, name)
        if value is None or value is False or value == [] or value == {} or value in harmless:
            continue
        raise ValueError(f"{name}: {feature} is not supported by kvloom yet")


#: Fields of both endpoints whose features kvloom has not built: field -> (feature, values
#: that do not ask for it).
NOT_BUILT_SAMPLING: dict[str, tuple[str, tuple[Any, ...]]] = {
    "logits_processors": ("custom logits processors", ()),
    "bad_words": ("bad_words", ()),
}


class OpenAIResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")


def unix_time() -> int:
    """Now, in whole seconds since the epoch: the ``created`` of OpenAI's objects."""
    return int(time.time())


class ResponseHead(OpenAIResponse):
    """The fields a response object opens with, in OpenAI's order: ``id``, ``object`` (each
    response narrows it to its own literal), ``created`` and ``model``."""

    id: str
    object: str
    created: int = Field(default_factory=unix_time)
    model: str


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
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* aliases (``structured_outputs_params``).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    vllm_xargs: dict[str, Any] | None = None
    """Arguments of logits processor plugins, ``{processor name: value}`` (vLLM's field; the
    engine's ``SamplingParams.extra_args``)."""
    kv_transfer_params: dict[str, Any] | None = None
    """For the engine's KV connector (vLLM's field): how a proxy links a prefill to its decode."""
    # Features not built yet: accepted as fields so that asking for them is a 400 naming them.
    logits_processors: Any = None
    bad_words: Any = None

    @field_validator("vllm_xargs")
    @classmethod
    def _check_vllm_xargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from kvloom.sample.logits_processors import parse_extra_args

        try:
            parse_extra_args(value, "vllm_xargs")
        except ValueError as exc:  # the error's location already names the field
            raise ValueError(str(exc).removeprefix("vllm_xargs.")) from None
        return value

    @model_validator(mode="after")
    def _check_not_built_sampling(self) -> "SamplingRequest":
        check_not_built(self, NOT_BUILT_SAMPLING)
        return self

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

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's constraint and the field that asked for it (``None, None``: none).
        At most one of response_format (other than text), structured_outputs and the
        guided_* fields may ask; a malformed one is a ``ValueError`` naming the field."""
        asked: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format: type 'json_schema' needs json_schema.schema, a JSON schema "
                                     "object")  # fmt: skip
                asked.append(("response_format", {"json": schema}))
            elif kind == "json_object":
                asked.append(("response_format", {"json_object": True}))
            elif kind == "structural_tag":
                asked.append(("response_format", {"structural_tag": {k: v for k, v in fmt.items() if k != "type"}}))
            elif kind != "text":
                raise ValueError(f"response_format: type must be 'text', 'json_object', 'json_schema' or "
                                 f"'structural_tag' (got {kind!r:.40})")  # fmt: skip
        # structured_outputs may carry only options (disable_any_whitespace) for the
        # constraint another field asks for, as in vLLM.
        options = {k: v for k, v in (self.structured_outputs or {}).items() if k in STRUCTURED_OUTPUT_OPTIONS}
        if self.structured_outputs and len(options) < len(self.structured_outputs):
            asked.append(("structured_outputs", dict(self.structured_outputs)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                asked.append((name, {kind: value}))
        if not asked:
            return None, None
        if len(asked) > 1:
            raise ValueError(f"{asked[1][0]}: only one of response_format, structured_outputs and guided_* may "
                             f"constrain the output (also given: {asked[0][0]})")  # fmt: skip
        field, values = asked[0]
        try:
            return StructuredOutputsParams(**{**options, **values}), field
        except (TypeError, ValueError) as exc:
            message = str(exc).removeprefix("structured_outputs: ").removeprefix("structured_outputs.")
            raise ValueError(f"{field}: {message}") from None

    def sampling_values(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                        defaults: dict[str, Any] | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> dict[str, Any]:  # fmt: skip
        """The fields of the ``SamplingParams`` of one prompt's engine request, all n
        choices of it (the engine fans n out, see ``serving_engine``). ``defaults``: the
        values of the fields the request leaves unset (the model's generation config,
        ``--generation-config``)."""
        defaults = defaults or {}
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
            "structured_outputs": structured_outputs,
            "extra_args": self.vllm_xargs,
            "kv_transfer_params": self.kv_transfer_params,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                values[name] = value
        return values


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
            raise ValueError("suffix (fill-in-the-middle) is not supported by kvloom yet")
        return value

    prompt_embeds: Any = None

    @model_validator(mode="after")
    def _check_best_of(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n (or null) is supported, as in vLLM V1, which removed "
                             f"best_of (got best_of={self.best_of}, n={self.n})")  # fmt: skip
        check_not_built(self, {"prompt_embeds": ("prompt_embeds", ())})
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


class CompletionResponse(ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = Field(None, exclude_if=lambda v: v is None)
    """The KV connector's reply (vLLM's field; present when it gave one): what a proxy hands
    the decode instance."""


class CompletionStreamResponse(ResponseHead):
    object: Literal["text_completion"] = "text_completion"
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
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type {kind[:40]!r} are not supported by kvloom yet "
                                     "(it serves text-only models: send text parts {'type': 'text', 'text': ...})")
        raise ValueError("must be a string or a list of text parts ({'type': 'text', 'text': ...}); "
                         "kvloom serves text-only models")

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        # Assistant tool calls: chat templates (HF's convention) read the arguments as a
        # mapping, where OpenAI sends a JSON string.
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_template_tool_call(call) for call in calls]
        return message


def _template_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call  # not JSON: the template gets the string
        return {**call, "function": {**function, "arguments": arguments}}
    return call


#: Chat fields whose features kvloom has not built (see ``NOT_BUILT_SAMPLING``).
NOT_BUILT_CHAT: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("function calling", ()),
    "function_call": ("function calling (function_call other than 'none' or 'auto')", ("none", "auto")),
    "audio": ("audio output", ()),
    "modalities": ("output modalities other than text", (["text"],)),
    "chat_template": ("a chat template per request (start the server with --chat-template)", ()),
    "echo": ("echo for chat completions", ()),
    "documents": ("documents (RAG chat templates)", ()),
    "mm_processor_kwargs": ("multimodal inputs", ()),
}

#: ``chat_template_kwargs`` keys that would change how kvloom calls the template rather than
#: what the template sees.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


class FunctionDefinition(OpenAIRequest):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (none: no arguments)."""
    strict: bool | None = None


class ChatTool(OpenAIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """none: no call; auto (the default with tools): the model may call (needs the
    server's --enable-auto-tool-choice and --tool-call-parser); required: at least one
    call; a named function: that call. required and named calls are grammar-enforced."""
    include_reasoning: bool = True
    """With --reasoning-parser: whether the reply carries the reasoning (vLLM's field)."""
    # Features not built yet (NOT_BUILT_CHAT).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    chat_template: Any = None
    echo: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        check_not_built(self, NOT_BUILT_CHAT)
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt to be false (the reply continues "
                             "the last message instead of starting a new one)")  # fmt: skip
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            names = [t.function.name for t in self.tools or []]
            if not names:
                raise ValueError("tool_choice: 'required' or a named function needs tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: no tool is named {self.tool_choice.function.name!r:.80} (tools: "
                                 f"{', '.join(names)})")  # fmt: skip
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set through chat_template_kwargs "
                             "(use the request's own fields)")  # fmt: skip
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class FunctionCall(OpenAIResponse):
    name: str
    arguments: str
    """The arguments as a JSON string (OpenAI's shape)."""


class ToolCall(OpenAIResponse):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIResponse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIResponse):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIResponse):
    role: str
    content: str | None = None
    reasoning: str | None = Field(None, exclude_if=lambda v: v is None)
    """The model's reasoning (with --reasoning-parser; vLLM's field)."""
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    """The same, under the name DeepSeek's API and older vLLM use."""
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda v: v is None)
    """Present when the reply calls tools."""


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


class ChatCompletionResponse(ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = Field(None, exclude_if=lambda v: v is None)
    """The KV connector's reply (vLLM's field; present when it gave one): what a proxy hands
    the decode instance."""


class DeltaMessage(OpenAIResponse):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------- models, tokenizer


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
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


class EmbeddingResponse(ResponseHead):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(OpenAIResponse):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(ResponseHead):
    object: Literal["list"] = "list"
    data: list[PoolingData]
    usage: UsageInfo


class IOProcessorRequest(OpenAIRequest):
    """POST /pooling with an IO processor plugin: the plugin parses ``data``."""

    model_config = ConfigDict(extra="forbid", strict=False)

    model: str | None = None
    data: Any


class IOProcessorResponse(OpenAIResponse):
    request_id: str | None = None
    created_at: int = Field(default_factory=unix_time)
    data: Any
