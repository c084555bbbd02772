"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, n
assistant replies out, streamed as ``chat.completion.chunk`` deltas or whole. One engine
request (with n) serves the whole response; choice i is its sequence i."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

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
    UsageInfo,
)
from kvloom.entrypoints.openai.serving_engine import (
    SSE_DONE,
    EventStream,
    OpenAIServing,
    Prompt,
    PromptOutputs,
    random_id,
    sse,
)
from kvloom.outputs import CompletionOutput, SampleLogprobs

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

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        lora_request = await self.resolve_model_or_lora(request.model)
        self.check_priority(request.priority)
        self.check_sampling_fields(request)
        self.check_num_sequences(1, request.n, "n")
        prompt = await self.chat_prompt_async(request.template_messages(), request.add_generation_prompt,
                                              request.add_special_tokens, request.continue_final_message,
                                              request.chat_template_kwargs)  # fmt: skip
        max_tokens_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens_for(prompt, request.requested_max_tokens(), "messages", max_tokens_param)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs, None)
        request_id = random_id("chatcmpl")
        outputs = await self.generate(request_id, [prompt], [params], lora_request, request.priority, request.cache_salt)
        if request.stream:
            return EventStream(self._stream(request, request_id, prompt, outputs), outputs)
        return await self._collect(request, request_id, prompt, outputs)

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

    # ------------------------------------------------------------ whole response

    async def _collect(
        self, request: ChatCompletionRequest, request_id: str, prompt: Prompt, outputs: PromptOutputs
    ) -> ChatCompletionResponse:
        choices = [_Choice() for _ in range(request.n)]
        async with aclosing(outputs):
            async for _, output in outputs:
                for completion in output.outputs:
                    self._delta(request, choices[completion.index], completion)
        return ChatCompletionResponse(
            id=request_id,
            model=request.model or self.model_name,
            choices=[
                ChatCompletionResponseChoice(
                    index=i,
                    message=ChatMessage(role=self.response_role, content=c.text),
                    logprobs=ChatCompletionLogProbs(content=c.logprobs) if request.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=self._usage(prompt, choices),
        )

    # ------------------------------------------------------------ server-sent events

    def _chunk(self, request_id: str, model: str, choice: ChatCompletionResponseStreamChoice) -> str:
        chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=[choice])
        data = chunk.model_dump(mode="json")
        # A delta carries only what it sets (OpenAI's shape: {"role": ...} or {"content": ...}).
        data["choices"][0]["delta"] = {k: v for k, v in data["choices"][0]["delta"].items() if v is not None}
        return sse(json.dumps(data))

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, prompt: Prompt, outputs: PromptOutputs
    ) -> AsyncIterator[str]:
        model = request.model or self.model_name
        choices = [_Choice() for _ in range(request.n)]
        try:
            # Like OpenAI: every choice opens with the assistant role and empty content.
            for index in range(request.n):
                yield self._chunk(request_id, model, ChatCompletionResponseStreamChoice(
                    index=index, delta=DeltaMessage(role=self.response_role, content="")))  # fmt: skip
            async with aclosing(outputs):
                async for _, output in outputs:
                    for completion in output.outputs:  # one chunk per choice with news
                        index = completion.index
                        choice = choices[index]
                        text, logprobs = self._delta(request, choice, completion)
                        finished = completion.finish_reason is not None
                        if not text and not finished and not logprobs:
                            continue
                        yield self._chunk(
                            request_id,
                            model,
                            ChatCompletionResponseStreamChoice(
                                index=index,
                                delta=DeltaMessage(content=text if text else None),
                                logprobs=ChatCompletionLogProbs(content=logprobs) if logprobs is not None else None,
                                finish_reason=choice.finish_reason if finished else None,
                                stop_reason=choice.stop_reason if finished else None,
                            ),
                        )
            if request.stream_options is not None and request.stream_options.include_usage:
                usage = self._usage(prompt, choices)
                final = ChatCompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage)
                yield sse(final.model_dump_json())
        except APIError as error:
            yield sse(json.dumps(error.body()))
        except Exception:  # a failure formatting the stream: the client learns no detail
            logger.exception("Streaming chat completion %s failed", request_id)
            yield sse(json.dumps(internal_error(request_id).body()))
        yield SSE_DONE
