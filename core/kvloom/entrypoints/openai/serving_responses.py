"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over chat.

A request becomes a chat completion (``instructions`` a system message, ``input`` items
messages, function tools, ``text.format`` the response format) run by the server's chat
serving class, so reasoning (``--reasoning-parser``: a ``reasoning`` output item), tool
calls (``function_call`` items) and structured outputs behave as on
``/v1/chat/completions``. A stream sends OpenAI's events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``, ...,
``response.completed``). Responses are kept in memory (``store``, the default) for
``previous_response_id`` and GET: the latest ``MAX_STORED_RESPONSES`` of this API server
process.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from kvloom.entrypoints.openai.errors import APIError, from_validation_error, internal_error, renamed_fields
from kvloom.entrypoints.openai.protocol import ChatCompletionRequest, UsageInfo
from kvloom.entrypoints.openai.protocol_responses import (
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    chat_response_format,
    chat_tool,
    input_messages,
    output_messages,
)
from kvloom.entrypoints.openai.routers.shared import server_context
from kvloom.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from kvloom.entrypoints.openai.serving_engine import EventStream

logger = logging.getLogger(__name__)

router = APIRouter()

#: Responses kept for ``previous_response_id`` and GET (the oldest are dropped first).
MAX_STORED_RESPONSES = 1000

#: Chat's field names in errors -> the Responses API's.
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """A response's output items as they are made, and the stream events that make them
    (``events``, taken by the caller): a reasoning item, then the message, then a
    ``function_call`` item per call, each opened when its first text arrives and closed
    before the next one opens."""

    def __init__(self, summary: bool) -> None:
        self.summary = summary
        self.items: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # a streamed call's index -> its item

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, fields))

    def _start(self, item: dict[str, Any]) -> dict[str, Any]:
        self.close()
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=_shell(item))
        return item

    def reasoning(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = self._start({"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                "status": "completed", "_text": ""})  # fmt: skip
            if self.summary:
                self._emit("response.reasoning_summary_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                           summary_index=0, part={"type": "summary_text", "text": ""})  # fmt: skip
        item["_text"] += text
        index = len(self.items) - 1
        self._emit("response.reasoning_text.delta", item_id=item["id"], output_index=index, content_index=0, delta=text)
        if self.summary:
            self._emit("response.reasoning_summary_text.delta", item_id=item["id"], output_index=index,
                       summary_index=0, delta=text)  # fmt: skip

    def text(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            item = self._start({"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "completed",
                                "content": [], "_text": ""})  # fmt: skip
            self._emit("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                       content_index=0, part=_output_text(""))  # fmt: skip
        item["_text"] += text
        self._emit("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                   delta=text, logprobs=[])  # fmt: skip

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        item = self._calls.get(index)
        if item is None:
            item = self._start({"id": _new_id("fc"), "type": "function_call", "status": "completed",
                                "call_id": call_id or _new_id("call"), "name": name or "", "arguments": ""})  # fmt: skip
            self._calls[index] = item
        item["arguments"] += arguments
        self._emit("response.function_call_arguments.delta", item_id=item["id"], output_index=self.items.index(item),
                   delta=arguments)  # fmt: skip

    def close(self) -> None:
        """Finish the open item (its done events)."""
        item, self._open = self._open, None
        if item is None:
            return
        index = self.items.index(item)
        if item["type"] == "reasoning":
            text = item.pop("_text")
            item["content"] = [{"type": "reasoning_text", "text": text}]
            self._emit("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=text)  # fmt: skip
            if self.summary:
                item["summary"] = [{"type": "summary_text", "text": text}]
                self._emit("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                           summary_index=0, text=text)  # fmt: skip
                self._emit("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                           summary_index=0, part=item["summary"][0])  # fmt: skip
        elif item["type"] == "message":
            item["content"] = [_output_text(item.pop("_text"))]
            self._emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=item["content"][0]["text"], logprobs=[])  # fmt: skip
            self._emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=item["content"][0])  # fmt: skip
        else:
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"])  # fmt: skip
        self._emit("response.output_item.done", output_index=index, item=item)


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _shell(item: dict[str, Any]) -> dict[str, Any]:
    """An item as its ``output_item.added`` event shows it: nothing written yet."""
    shell = {k: v for k, v in item.items() if not k.startswith("_")}
    if shell["type"] == "reasoning":
        shell["status"] = "in_progress"
    elif shell["type"] == "message":
        shell["status"] = "in_progress"
    else:
        shell.update(status="in_progress", arguments="")
    return shell


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self._store: OrderedDict[str, tuple[ResponseObject, list[dict[str, Any]]]] = OrderedDict()

    # ------------------------------------------------------------ store

    def retrieve(self, response_id: str) -> ResponseObject:
        stored = self._store.get(response_id)
        if stored is None:
            raise APIError(f"No response with id {response_id!r:.80} is stored (this server keeps the latest "
                           f"{MAX_STORED_RESPONSES} responses made with store=true)", status=HTTPStatus.NOT_FOUND,
                           param="response_id", code="response_not_found")  # fmt: skip
        return stored[0]

    def _remember(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        self._store[response.id] = (response, conversation + output_messages(response.output))
        while len(self._store) > MAX_STORED_RESPONSES:
            self._store.popitem(last=False)

    def _history(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        if request.previous_response_id is None:
            return []
        stored = self._store.get(request.previous_response_id)
        if stored is None:
            raise APIError(f"previous_response_id: no response with id {request.previous_response_id!r:.80} is stored "
                           f"(this server keeps the latest {MAX_STORED_RESPONSES} responses made with store=true)",
                           status=HTTPStatus.NOT_FOUND, param="previous_response_id",
                           code="previous_response_not_found")  # fmt: skip
        return list(stored[1])

    # ------------------------------------------------------------ create

    def _chat_request(self, request: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + conversation
        choice: Any = request.tool_choice
        if choice is not None and not isinstance(choice, str):
            choice = {"type": "function", "function": {"name": choice.name}}
        body = {"model": request.model, "messages": messages, "max_completion_tokens": request.max_output_tokens,
                "temperature": request.temperature, "top_p": request.top_p, "stream": request.stream,
                "stream_options": {"include_usage": True} if request.stream else None,
                "tools": [chat_tool(t) for t in request.tools] if request.tools else None, "tool_choice": choice,
                "response_format": chat_response_format(request.text), "user": request.user, "top_k": request.top_k,
                "min_p": request.min_p, "repetition_penalty": request.repetition_penalty, "seed": request.seed,
                "vllm_xargs": request.vllm_xargs, "chat_template_kwargs": request.chat_template_kwargs}  # fmt: skip
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:
            raise renamed_fields(from_validation_error(exc, ChatCompletionRequest), _FIELD_NAMES) from None

    async def create_response(self, request: ResponsesRequest) -> ResponseObject | AsyncIterator[str]:
        try:
            conversation = self._history(request) + input_messages(request.input)
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(":", 1)[0]) from None
        try:
            run = await self.chat.start(self._chat_request(request, conversation))
        except APIError as error:
            raise renamed_fields(error, _FIELD_NAMES) from None
        response_id = _new_id("resp")
        summary = request.reasoning is not None and request.reasoning.summary is not None
        if request.stream:
            return EventStream(self._stream(request, run, response_id, conversation, summary), run.outputs)
        completion = await self.chat.collect(run)
        output = _Output(summary)
        (choice,) = completion.choices
        if choice.message.reasoning:  # (an empty reasoning makes no item, as in a stream)
            output.reasoning(choice.message.reasoning)
        if choice.message.content or not choice.message.tool_calls:
            output.text(choice.message.content or "")
        for i, call in enumerate(choice.message.tool_calls or []):
            output.call(i, call.id, call.function.name, call.function.arguments)
        output.close()
        response = self._response(request, response_id, output, choice.finish_reason, completion.usage)
        if request.store:
            self._remember(response, conversation)
        return response

    def _response(self, request: ResponsesRequest, response_id: str, output: _Output, finish_reason: str | None,
                  usage_info: UsageInfo | None, status: str | None = None) -> ResponseObject:  # fmt: skip
        usage = None
        if usage_info is not None:
            usage = ResponseUsage(input_tokens=usage_info.prompt_tokens, output_tokens=usage_info.completion_tokens,
                                  total_tokens=usage_info.total_tokens)  # fmt: skip
        incomplete = finish_reason == "length"
        tool_choice: Any = request.tool_choice if request.tool_choice is not None else "auto"
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        return ResponseObject(
            id=response_id, status=status or ("incomplete" if incomplete else "completed"),
            model=self.chat.models.response_name(request.model), output=output.items, usage=usage,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            temperature=request.temperature, top_p=request.top_p,
            tools=[t.model_dump(exclude_none=True) for t in request.tools or []], tool_choice=tool_choice,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id,
            reasoning=request.reasoning.model_dump() if request.reasoning is not None else None,
            text={"format": (request.text.format if request.text is not None and request.text.format else
                             {"type": "text"})},
            store=request.store, metadata=request.metadata or {}, user=request.user,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        )  # fmt: skip

    # ------------------------------------------------------------ stream

    async def _stream(self, request: ResponsesRequest, run: ChatRun, response_id: str,
                      conversation: list[dict[str, Any]], summary: bool) -> AsyncIterator[str]:  # fmt: skip
        sequence = 0

        def event(kind: str, fields: dict[str, Any]) -> str:
            nonlocal sequence
            data = json.dumps({"type": kind, "sequence_number": sequence, **fields})
            sequence += 1
            return f"event: {kind}\ndata: {data}\n\n"

        output = _Output(summary)
        started = self._response(request, response_id, output, None, None, status="in_progress")
        yield event("response.created", {"response": started.model_dump(mode="json")})
        yield event("response.in_progress", {"response": started.model_dump(mode="json")})
        finish_reason = None
        usage = None
        try:
            async for chunk in self.chat.stream_chunks(run):
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.reasoning:
                        output.reasoning(delta.reasoning)
                    if delta.content:
                        output.text(delta.content)
                    for call in delta.tool_calls or []:
                        function = call.function
                        output.call(call.index, call.id, function.name if function else None,
                                    (function.arguments if function else None) or "")  # fmt: skip
                    finish_reason = choice.finish_reason or finish_reason
                for kind, fields in output.events:
                    yield event(kind, fields)
                output.events.clear()
            if not any(item["type"] in ("message", "function_call") for item in output.items):
                output.text("")  # no answer is an empty message, as in a whole response
            output.close()
            for kind, fields in output.events:
                yield event(kind, fields)
            output.events.clear()
        except APIError as error:
            yield event("error", {"code": error.code, "message": error.message, "param": error.param})
            return
        except Exception:
            logger.exception("Streaming response %s failed", response_id)
            error = internal_error(response_id)
            yield event("error", {"code": error.code, "message": error.message, "param": None})
            return
        response = self._response(request, response_id, output, finish_reason, usage)
        if request.store:
            self._remember(response, conversation)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield event(kind, {"response": response.model_dump(mode="json")})


@router.post("/v1/responses")
async def create_response(raw: Request) -> Response:
    return await server_context(raw.app).serve(raw, ResponsesRequest, raw.app.state.serving_responses.create_response)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(raw: Request, response_id: str) -> Response:
    response = raw.app.state.serving_responses.retrieve(response_id)
    return Response(response.model_dump_json(), media_type="application/json")
