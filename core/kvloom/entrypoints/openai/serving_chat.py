"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, n
assistant replies out, streamed as ``chat.completion.chunk`` deltas or whole. One engine
request (with n) serves the whole response; choice i is its sequence i. Tool calling
(``tools``, ``tool_choice``) is in ``tool_calls``. With ``--reasoning-parser`` the reasoning
goes to ``reasoning`` (and ``reasoning_content``), the answer to ``content``; tool calls
are found in the answer."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvloom.entrypoints.openai.errors import APIError, internal_error
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    NamedToolChoice,
    UsageInfo,
    unix_time,
)
from kvloom.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChunkTemplate,
    EventStream,
    OpenAIServing,
    Prompt,
    PromptOutputs,
    random_id,
    sse,
)
from kvloom.entrypoints.openai.tool_calls import ToolStream, as_tool_calls, parse_calls, tool_grammar, tool_mode
from kvloom.outputs import CompletionOutput, SampleLogprobs
from kvloom.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from kvloom.reasoning.registry import reasoning_parser_for
from kvloom.sampling_params import SamplingParams
from kvloom.structured_output.registry import validate_structured_outputs
from kvloom.tool_parsers.base import ToolParser

if TYPE_CHECKING:
    from kvloom.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    logprobs: list[ChatCompletionLogProbsContent] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServingChat(OpenAIServing):
    #: The role of the reply (``--response-role``).
    response_role: str = "assistant"
    #: ``--enable-auto-tool-choice``'s parser (``--tool-call-parser``); None: auto tool
    #: choice is refused.
    tool_parser_cls: type[ToolParser] | None = None

    def __init__(self, engine: "AsyncLLM", *args: Any, **kwargs: Any) -> None:
        super().__init__(engine, *args, **kwargs)
        #: ``--reasoning-parser``'s parser (None: the output is all content).
        self.reasoning_parser: ReasoningParser | None = reasoning_parser_for(self.config, self.tokenizer)

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        run = await self.start(request)
        if request.stream:
            return EventStream(self._stream(run), run.outputs)
        return await self.collect(run)

    async def start(self, request: ChatCompletionRequest, id_prefix: str = "chatcmpl") -> "ChatRun":
        """Check ``request``, render and tokenize its messages and admit it into the engine
        (a 400 for anything wrong, before any output)."""
        lora_request = await self.resolve_model_or_lora(request.model)
        self.check_priority(request.priority)
        self.check_num_sequences(1, request.n, "n")
        try:
            mode = tool_mode(request, self.tool_parser_cls is not None)
        except ValueError as exc:
            raise APIError(str(exc), param="tool_choice") from None
        prompt = await self.render(request)
        max_tokens_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens_for(prompt, request.requested_max_tokens(), "messages", max_tokens_param)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs, None, names={"logprobs": "top_logprobs"})
        if mode in ("required", "named"):
            params = self._with_tool_grammar(request, mode, params)
        request_id = random_id(id_prefix)
        outputs = await self.generate(request_id, [prompt], [params], lora_request, request.priority, request.cache_salt)
        return ChatRun(request, request_id, prompt, outputs, mode)

    async def render(self, request: ChatCompletionRequest) -> Prompt:
        """The prompt of ``request``: its messages (and tools) through the chat template, tokenized."""
        template_kwargs = dict(request.chat_template_kwargs or {})
        if request.tools:
            template_kwargs["tools"] = [t.model_dump(exclude_none=True) for t in request.tools]
        return await self.chat_prompt_async(request.template_messages(), request.add_generation_prompt,
                                            request.add_special_tokens, request.continue_final_message,
                                            template_kwargs or None)  # fmt: skip

    def _with_tool_grammar(self, request: ChatCompletionRequest, mode: str, params: SamplingParams) -> SamplingParams:
        """``params`` constrained to the tool-call grammar of ``mode``."""
        if params.structured_outputs is not None:
            raise APIError("tool_choice: a required or named tool choice cannot be combined with response_format, "
                           "structured_outputs or guided_*", param="tool_choice")  # fmt: skip
        grammar = tool_grammar(request, mode)
        try:
            validate_structured_outputs(grammar, self.structured_outputs_backend)
        except ValueError as exc:
            raise APIError(f"tools: a function's parameters are not a usable JSON schema: "
                           f"{str(exc).removeprefix('structured_outputs.json: ')}", param="tools") from None
        return params.model_copy(update={"structured_outputs": grammar})

    def _tool_parser(self, mode: str | None) -> ToolParser | None:
        if mode != "auto":
            return None
        assert self.tool_parser_cls is not None
        return self.tool_parser_cls(self.tokenizer)

    # ------------------------------------------------------------ shared formatting

    def _logprobs(
        self, token_ids: list[int], logprobs: SampleLogprobs, top: int
    ) -> list[ChatCompletionLogProbsContent]:
        content = []
        for token_id, step in zip(token_ids, logprobs):
            chosen = step[token_id]
            token = self.token_str(token_id, chosen.decoded_token)
            ranked = sorted(
                ((lp.rank, tid, lp) for tid, lp in step.items() if lp.rank is not None and lp.rank <= top),
                key=lambda entry: entry[0],
            )
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=chosen.logprob,
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        ChatCompletionLogProb(token=t, logprob=lp.logprob, bytes=list(t.encode("utf-8")))
                        for _, tid, lp in ranked
                        for t in [self.token_str(tid, lp.decoded_token)]
                    ],
                )
            )
        return content

    def _delta(
        self, request: ChatCompletionRequest, choice: _Choice, completion: CompletionOutput
    ) -> tuple[str, list[ChatCompletionLogProbsContent] | None]:
        """The text and logprobs one output of a sequence adds to its choice."""
        logprobs = None
        if request.logprobs and completion.logprobs is not None:
            logprobs = self._logprobs(completion.token_ids, completion.logprobs, request.top_logprobs or 0)
            choice.logprobs.extend(logprobs)
        choice.text += completion.text
        choice.num_tokens += len(completion.token_ids)
        if completion.finish_reason is not None:
            choice.finish_reason = str(completion.finish_reason)
            choice.stop_reason = completion.stop_reason
        return completion.text, logprobs

    @staticmethod
    def _usage(prompt: Prompt, choices: list[_Choice]) -> UsageInfo:
        completion_tokens = sum(c.num_tokens for c in choices)
        return UsageInfo(
            prompt_tokens=len(prompt.token_ids),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt.token_ids) + completion_tokens,
        )

    # ------------------------------------------------------------ reasoning

    def split_reasoning(self, text: str, prompt_token_ids: list[int]) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a whole output."""
        if self.reasoning_parser is None:
            return None, text
        return self.reasoning_parser.extract_reasoning(text, prompt_token_ids)

    def reasoning_streams(self, n: int, prompt_token_ids: list[int]) -> list[ReasoningStream] | None:
        """One splitter per streamed choice (None without a reasoning parser)."""
        if self.reasoning_parser is None:
            return None
        return [self.reasoning_parser.stream(prompt_token_ids) for _ in range(n)]

    @staticmethod
    def split_delta(splitter: ReasoningStream, text: str, finished: bool) -> ReasoningDelta:
        """What ``text`` (and, once the choice ``finished``, the held-back rest) adds."""
        delta = splitter.feed(text)
        if finished:
            rest = splitter.finish()
            delta = ReasoningDelta(delta.reasoning + rest.reasoning, delta.content + rest.content)
        return delta

    def _message(self, request: ChatCompletionRequest, reasoning: str | None, content: str | None,
                 tool_calls: Any = None) -> ChatMessage:  # fmt: skip
        """The reply; once it reasoned, an empty answer is null content (vLLM's shape)."""
        if reasoning is not None and not content:
            content = None
        if not request.include_reasoning:
            reasoning = None
        return ChatMessage(role=self.response_role, content=content, reasoning=reasoning, reasoning_content=reasoning,
                           tool_calls=tool_calls)  # fmt: skip

    # ------------------------------------------------------------ whole response

    async def collect(self, run: "ChatRun") -> ChatCompletionResponse:
        """The whole response of an admitted request."""
        request, request_id, prompt, outputs, mode = run.request, run.request_id, run.prompt, run.outputs, run.mode
        choices = [_Choice() for _ in range(request.n)]
        kv_transfer_params = None
        async with aclosing(outputs):
            async for _, output in outputs:
                kv_transfer_params = output.kv_transfer_params or kv_transfer_params
                for completion in output.outputs:
                    self._delta(request, choices[completion.index], completion)
        messages = []
        parser = self._tool_parser(mode)
        for c in choices:
            reasoning, answer = self.split_reasoning(c.text, prompt.token_ids)
            message = self._message(request, reasoning, answer)
            if mode is not None:
                calls, content = parse_calls(answer, mode, request, parser)
                if calls:
                    message = self._message(request, reasoning, content, as_tool_calls(calls))
                    if c.finish_reason == "stop" and mode != "named":  # OpenAI: a forced function 'stop's
                        c.finish_reason = "tool_calls"
            messages.append(message)
        return ChatCompletionResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            choices=[
                ChatCompletionResponseChoice(
                    index=i,
                    message=messages[i],
                    logprobs=ChatCompletionLogProbs(content=c.logprobs) if request.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=self._usage(prompt, choices),
            kv_transfer_params=kv_transfer_params,
        )

    # ------------------------------------------------------------ server-sent events

    @staticmethod
    def chunk_json(chunk: ChatCompletionStreamResponse) -> str:
        """A chunk as OpenAI sends it: each delta carries only what it sets ({"role": ...} or
        {"content": ...})."""
        data = chunk.model_dump(mode="json")
        for i, choice in enumerate(chunk.choices):
            data["choices"][i]["delta"] = choice.delta.model_dump(mode="json", exclude_none=True)
        return json.dumps(data)

    async def _stream(self, run: "ChatRun") -> AsyncIterator[str]:
        templates: dict[int, ChunkTemplate] = {}  # a content-only chunk's JSON, per choice
        try:
            async for chunk in self.stream_chunks(run):
                content = _content_only(chunk)
                if content is None:
                    yield sse(self.chunk_json(chunk))
                    continue
                index = chunk.choices[0].index
                if index not in templates:
                    chunk.choices[0].delta.content = ChunkTemplate.TEXT
                    templates[index] = ChunkTemplate(self.chunk_json(chunk))
                yield templates[index].sse(content)
        except APIError as error:
            yield sse(json.dumps(error.body()))
        except Exception:  # a failure formatting the stream: the client learns no detail
            logger.exception("Streaming chat completion %s failed", run.request_id)
            yield sse(json.dumps(internal_error(run.request_id).body()))
        yield SSE_DONE

    async def stream_chunks(self, run: "ChatRun") -> AsyncIterator[ChatCompletionStreamResponse]:
        """The chunks of an admitted request's stream, as they come (the usage chunk last,
        when ``stream_options.include_usage`` asks); an engine failure is raised."""
        request, request_id, prompt, outputs, mode = run.request, run.request_id, run.prompt, run.outputs, run.mode
        model = self.models.response_name(request.model)

        created = unix_time()  # one for every chunk of the stream, as vLLM

        def chunk(choice: ChatCompletionResponseStreamChoice) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])

        choices = [_Choice() for _ in range(request.n)]
        named = request.tool_choice.function.name if isinstance(request.tool_choice, NamedToolChoice) else None
        tools = [ToolStream(mode, self._tool_parser(mode), named) for _ in range(request.n)] if mode else None
        splitters = self.reasoning_streams(request.n, prompt.token_ids)
        # Like OpenAI: every choice opens with the assistant role and empty content.
        for index in range(request.n):
            yield chunk(ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(role=self.response_role,
                                                                                           content="")))  # fmt: skip
        async with aclosing(outputs):
            async for _, output in outputs:
                for completion in output.outputs:  # one chunk per choice with news
                    index = completion.index
                    choice = choices[index]
                    text, logprobs = self._delta(request, choice, completion)
                    finished = completion.finish_reason is not None
                    reasoning = None
                    if splitters is not None:  # the reasoning first; the answer goes on below
                        part = self.split_delta(splitters[index], text, finished)
                        text = part.content
                        reasoning = part.reasoning if part.reasoning and request.include_reasoning else None
                    calls = None
                    if tools is not None:  # tool calls: content until a call starts, calls as deltas
                        text, calls = tools[index].feed(text)
                        if finished:
                            rest, end_calls = tools[index].finish(request)
                            text = (text or "") + (rest or "") or None
                            calls = (calls or []) + (end_calls or []) or None
                            if tools[index].called and choice.finish_reason == "stop":
                                choice.finish_reason = "tool_calls"
                    if not text and not finished and not logprobs and not calls and not reasoning:
                        continue
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=index,
                        delta=DeltaMessage(content=text if text else None, reasoning=reasoning,
                                           reasoning_content=reasoning, tool_calls=calls),
                        logprobs=ChatCompletionLogProbs(content=logprobs) if logprobs is not None else None,
                        finish_reason=choice.finish_reason if finished else None,
                        stop_reason=choice.stop_reason if finished else None,
                    ))  # fmt: skip
        if request.stream_options is not None and request.stream_options.include_usage:
            yield ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                               usage=self._usage(prompt, choices))  # fmt: skip


def _content_only(chunk: ChatCompletionStreamResponse) -> str | None:
    """The content of a chunk that carries nothing else (one choice, not finished, no role,
    reasoning, tool calls or logprobs): the chunk of almost every streamed token."""
    if len(chunk.choices) != 1 or chunk.usage is not None:
        return None
    choice = chunk.choices[0]
    delta = choice.delta
    if (choice.finish_reason is not None or choice.logprobs is not None or delta.content is None or delta.role
            or delta.reasoning is not None or delta.reasoning_content is not None or delta.tool_calls is not None):  # fmt: skip
        return None
    return delta.content


@dataclass
class ChatRun:
    """A chat request admitted into the engine: what its response is made of (``collect``,
    ``stream_chunks``)."""

    request: ChatCompletionRequest
    request_id: str
    prompt: Prompt
    outputs: PromptOutputs
    mode: str | None
    """Its tool-call mode (``tool_calls.tool_mode``)."""
