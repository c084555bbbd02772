"""POST /v1/completions: prompt(s) in, n choices per prompt out, streamed or whole. Each
prompt is one engine request (with n); choice ``prompt_index * n + i`` is sequence i of
prompt ``prompt_index``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from kvloom.entrypoints.openai.errors import APIError, internal_error
from kvloom.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
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
from kvloom.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    """What has been produced for one choice so far."""

    text: str = ""
    num_tokens: int = 0
    text_offset: int = 0  # where the next logprob token starts in the choice's text
    started: bool = False
    logprobs: CompletionLogProbs = field(default_factory=CompletionLogProbs)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        lora_request = await self.resolve_model_or_lora(request.model)
        self.check_priority(request.priority)
        self.check_num_sequences(len(request.prompts()), request.n, "prompt")
        prompts = [await self.tokenize_async(p) for p in request.prompts()]
        max_tokens = [self.max_tokens_for(p, request.max_tokens, "prompt", "max_tokens") for p in prompts]
        # echo with logprobs reports the prompt tokens' logprobs as well.
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(request.logprobs, prompt_logprobs or 0)

        params = [self.sampling_params(request, m, request.logprobs, prompt_logprobs) for m in max_tokens]
        request_id = random_id("cmpl")
        outputs = await self.generate(request_id, prompts, params, lora_request, request.priority, request.cache_salt)
        if request.stream:
            return EventStream(self._stream(request, request_id, prompts, outputs), outputs)
        return await self._collect(request, request_id, prompts, outputs)

    # ------------------------------------------------------------ shared formatting

    def _append_logprobs(
        self,
        choice: _Choice,
        token_ids: list[int],
        logprobs: SampleLogprobs | PromptLogprobs,
        out: CompletionLogProbs,
    ) -> None:
        """Append one entry per token to ``out``; positions without logprobs (the first
        prompt token) get None."""
        for token_id, step in zip(token_ids, logprobs):
            if step is None:
                token = self.token_str(token_id, None)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                chosen = step[token_id]
                token = self.token_str(token_id, chosen.decoded_token)
                out.token_logprobs.append(chosen.logprob)
                out.top_logprobs.append(
                    {self.token_str(tid, lp.decoded_token): lp.logprob for tid, lp in step.items()}
                )
            out.tokens.append(token)
            out.text_offset.append(choice.text_offset)
            choice.text_offset += len(token)

    def _delta(
        self,
        request: CompletionRequest,
        prompt: Prompt,
        choice: _Choice,
        completion: CompletionOutput,
        prompt_logprobs: PromptLogprobs | None,
    ) -> tuple[str, CompletionLogProbs | None]:
        """The text and logprobs one output of a sequence adds to its choice (echo on its
        first one, with the prompt's logprobs when asked for)."""
        text = completion.text
        logprobs = CompletionLogProbs() if request.logprobs is not None else None
        if not choice.started:
            choice.started = True
            if request.echo:
                echoed = self.prompt_text(prompt)
                text = echoed + text
                if logprobs is not None and prompt_logprobs is not None:
                    prompt_logprobs = list(prompt_logprobs)
                    if len(prompt_logprobs) == len(prompt.token_ids) - 1:
                        prompt_logprobs.insert(0, None)  # the first token has no logprob
                    self._append_logprobs(choice, prompt.token_ids, prompt_logprobs, logprobs)
                else:
                    choice.text_offset += len(echoed)
        if logprobs is not None and completion.logprobs is not None:
            self._append_logprobs(choice, completion.token_ids, completion.logprobs, logprobs)
        choice.num_tokens += len(completion.token_ids)
        choice.text += text
        if completion.finish_reason is not None:
            choice.finish_reason = str(completion.finish_reason)
            choice.stop_reason = completion.stop_reason
        return text, logprobs

    def _usage(self, prompts: list[Prompt], choices: list[_Choice]) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion_tokens = sum(c.num_tokens for c in choices)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    # ------------------------------------------------------------ whole response

    @staticmethod
    def _sequences(
        output: RequestOutput, prompt_index: int, n: int, prompt_logprobs: list[PromptLogprobs | None]
    ) -> list[tuple[int, CompletionOutput]]:
        """(choice index, sequence output) of each sequence in ``output``. The prompt's
        logprobs arrive once per prompt (the engine computes them for its first sequence
        only) and are kept in ``prompt_logprobs`` for every choice's echo."""
        if output.prompt_logprobs is not None:
            prompt_logprobs[prompt_index] = output.prompt_logprobs
        return [(prompt_index * n + c.index, c) for c in output.outputs]

    async def _collect(
        self, request: CompletionRequest, request_id: str, prompts: list[Prompt], outputs: PromptOutputs
    ) -> CompletionResponse:
        n = request.n
        choices = [_Choice() for _ in range(len(prompts) * n)]
        prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)
        kv_transfer_params = None  # the connector's reply for the first prompt, as vLLM reports it
        async with aclosing(outputs):
            async for p, output in outputs:
                if p == 0 and output.kv_transfer_params is not None:
                    kv_transfer_params = output.kv_transfer_params
                for index, completion in self._sequences(output, p, n, prompt_logprobs):
                    choice = choices[index]
                    _, logprobs = self._delta(request, prompts[p], choice, completion, prompt_logprobs[p])
                    if logprobs is not None:
                        _extend(choice.logprobs, logprobs)
        return CompletionResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            choices=[
                CompletionResponseChoice(
                    index=i,
                    text=c.text,
                    logprobs=c.logprobs if request.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=self._usage(prompts, choices),
            kv_transfer_params=kv_transfer_params,
        )

    # ------------------------------------------------------------ server-sent events

    async def _stream(
        self, request: CompletionRequest, request_id: str, prompts: list[Prompt], outputs: PromptOutputs
    ) -> AsyncIterator[str]:
        n = request.n
        model = self.models.response_name(request.model)
        created = unix_time()  # one for every chunk of the stream, as vLLM
        choices = [_Choice() for _ in range(len(prompts) * n)]
        prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)
        templates: dict[int, ChunkTemplate] = {}  # a text-only chunk's JSON, per choice

        def text_only(index: int) -> ChunkTemplate:
            choice = CompletionResponseChoice(index=index, text=ChunkTemplate.TEXT)
            chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
            return ChunkTemplate(chunk.model_dump_json())

        try:
            async with aclosing(outputs):
                async for p, output in outputs:
                    for index, completion in self._sequences(output, p, n, prompt_logprobs):
                        choice = choices[index]
                        text, logprobs = self._delta(request, prompts[p], choice, completion, prompt_logprobs[p])
                        finished = completion.finish_reason is not None
                        if not finished and logprobs is None:
                            if text:  # the common chunk: its template, filled
                                if index not in templates:
                                    templates[index] = text_only(index)
                                yield templates[index].sse(text)
                            continue  # nothing to tell the client yet
                        if not text and not finished and not logprobs.tokens:
                            continue
                        chunk = CompletionStreamResponse(
                            id=request_id,
                            created=created,
                            model=model,
                            choices=[
                                CompletionResponseChoice(
                                    index=index,
                                    text=text,
                                    logprobs=logprobs,
                                    finish_reason=choice.finish_reason if finished else None,
                                    stop_reason=choice.stop_reason if finished else None,
                                )
                            ],
                        )
                        yield sse(chunk.model_dump_json())
            if request.stream_options is not None and request.stream_options.include_usage:
                usage = self._usage(prompts, choices)
                final = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
                yield sse(final.model_dump_json())
        except APIError as error:
            yield sse(json.dumps(error.body()))
        except Exception:  # a failure formatting the stream: the client learns no detail
            logger.exception("Streaming completion %s failed", request_id)
            yield sse(json.dumps(internal_error(request_id).body()))
        yield SSE_DONE


def _extend(into: CompletionLogProbs, more: CompletionLogProbs) -> None:
    into.tokens.extend(more.tokens)
    into.token_logprobs.extend(more.token_logprobs)
    into.top_logprobs.extend(more.top_logprobs)
    into.text_offset.extend(more.text_offset)
