"""Bodies of OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``):
the request, its ``input`` items turned into chat messages, and the response object."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kvloom.entrypoints.openai.protocol import FunctionDefinition, OpenAIRequest, OpenAIResponse, unix_time

#: The most input items one request may hold.
MAX_INPUT_ITEMS = 2048


class ResponsesFunctionTool(OpenAIRequest):
    """A function tool, in the Responses API's flat shape (chat's ``FunctionDefinition``
    fields beside ``type``, which comes first so that another tool type is the error named)."""

    type: Literal["function"]
    name: str = FunctionDefinition.model_fields["name"]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    name: str


class ResponsesReasoning(OpenAIRequest):
    effort: str | None = None
    """Accepted; the model decides how long it reasons."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Asks for the reasoning item's ``summary`` (kvloom's summary is the reasoning itself)."""


class ResponsesText(OpenAIRequest):
    format: dict[str, Any] | None = None
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "name", "schema", "strict"}``."""


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(max_length=MAX_INPUT_ITEMS)
    """A text (one user message), or a list of items: messages (``role``, ``content``),
    ``function_call`` and ``function_call_output`` items; ``reasoning`` items are dropped."""
    instructions: str | None = None
    """A system message before the input (not carried over to later responses)."""
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[ResponsesFunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    """Keep the response (for ``previous_response_id`` and ``GET /v1/responses/{id}``)."""
    previous_response_id: str | None = None
    reasoning: ResponsesReasoning | None = None
    text: ResponsesText | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    # vLLM's sampling extensions, as on chat completions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    vllm_xargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _text_of(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            shown = f"type {kind!r:.40}" if isinstance(kind, str) else "a part without a text type"
            raise ValueError(f"{where}[{i}]: {shown} is not supported by kvloom (it serves text-only models: send "
                             "{'type': 'input_text', 'text': ...})")  # fmt: skip
        texts.append(part["text"])
    return "".join(texts)


def _text_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key}: must be a string")
    return value


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (a ``ValueError`` naming the item)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise ValueError("input: must not be an empty list")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: must be an object (a message or a function call item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role: must be 'user', 'assistant', 'system' or 'developer'")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), f"{where}.content")})  # fmt: skip
        elif kind == "function_call":
            call = {"id": _text_field(item, "call_id", where), "type": "function",
                    "function": {"name": _text_field(item, "name", where),
                                 "arguments": _text_field(item, "arguments", where)}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            continue  # earlier reasoning is not part of the prompt (chat templates drop it too)
        else:
            raise ValueError(f"{where}.type: {kind!r:.40} is not supported by kvloom (allowed: message, "
                             "function_call, function_call_output, reasoning)")  # fmt: skip
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue its conversation."""
    items = [item for item in output if item.get("type") in ("message", "function_call")]
    converted = [dict(item) for item in items]
    for item in converted:
        if item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": part["text"]} for part in item["content"]]
    return input_messages(converted) if converted else []


def chat_tool(tool: ResponsesFunctionTool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                "strict": tool.strict}  # fmt: skip
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def chat_response_format(text: ResponsesText | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = text.format if text is not None else None
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return dict(fmt)


class ResponseUsage(OpenAIResponse):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(OpenAIResponse):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=unix_time)
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None

    def output_text(self) -> str:
        """The text of the output's message items, joined (what clients' ``output_text`` is)."""
        return "".join(part["text"] for item in self.output if item["type"] == "message" for part in item["content"])

