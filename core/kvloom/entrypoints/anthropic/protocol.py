"""Bodies of Anthropic's Messages API, their conversion to chat (messages, tools, tool
choice) and back (content blocks, stop reasons), and Anthropic's error body
``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

import json
import uuid
from http import HTTPStatus
from typing import Any, Literal

from pydantic import Field

from kvloom.entrypoints.openai.protocol import OpenAIRequest, OpenAIResponse
from kvloom.sampling_params import MAX_STOP_STRINGS

#: The paths of Anthropic's API, whose errors are Anthropic's body.
ANTHROPIC_PATH = "/v1/messages"

#: Anthropic's error types by HTTP status.
ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(HTTPStatus(status), "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicMessage(OpenAIRequest):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(OpenAIRequest):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(OpenAIRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(OpenAIRequest):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
    """``{"type": "enabled" | "disabled"}``: the chat template's ``enable_thinking``."""


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    metadata: dict[str, Any] | None = None
    # vLLM's sampling extensions, as on chat completions.
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    vllm_xargs: dict[str, Any] | None = None


class MessageUsage(OpenAIResponse):
    input_tokens: int
    output_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class MessageResponse(OpenAIResponse):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    """``thinking``, ``text`` and ``tool_use`` blocks."""
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


def _text(value: Any, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"{where}: must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(value):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            kind = block.get("type") if isinstance(block, dict) else None
            raise ValueError(f"{where}[{i}]: blocks of type {kind!r:.40} are not supported here by kvloom (it serves "
                             "text-only models: send text blocks {'type': 'text', 'text': ...})")  # fmt: skip
        texts.append(block["text"])
    return "".join(texts)


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages of a request (a ``ValueError`` naming the bad block)."""
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _text(request.system, "system")})
    for i, message in enumerate(request.messages):
        where = f"messages[{i}].content"
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise ValueError(f"{at}: a tool_use block needs a string id and name")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and message.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ValueError(f"{at}.tool_use_id: must be a string")
                content = block.get("content", "")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": _text(content, f"{at}.content")})  # fmt: skip
            elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # earlier reasoning is not part of the prompt (chat templates drop it too)
            else:
                raise ValueError(f"{at}: a {kind!r:.40} block is not supported in a {message.role} message by kvloom "
                                 "(text, tool_use in assistant and tool_result in user messages; text-only models)")
        messages.extend(results)  # a tool's answer comes before the user's words that follow it
        if texts or calls or not results:
            entry: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    return messages


def chat_tools(request: CountTokensRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as chat fields."""
    fields: dict[str, Any] = {}
    if request.tools:
        fields["tools"] = [{"type": "function", "function": {k: v for k, v in (("name", t.name),
                            ("description", t.description), ("parameters", t.input_schema)) if v is not None}}
                           for t in request.tools]  # fmt: skip
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise ValueError("tool_choice.name: needed with type 'tool'")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


def template_kwargs(request: CountTokensRequest) -> dict[str, Any] | None:
    """``thinking`` as the chat template's ``enable_thinking`` (Qwen3's switch)."""
    kind = (request.thinking or {}).get("type")
    return {"enable_thinking": kind == "enabled"} if kind in ("enabled", "disabled") else None


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return ("end_turn", None) if finish_reason is not None else (None, None)


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_input(arguments: str) -> Any:
    """A call's arguments as the object Anthropic's ``input`` is (``{}`` for no arguments)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_raw_arguments": arguments}  # not JSON: still shown, under a name that says so
    return value if isinstance(value, dict) else {"value": value}
