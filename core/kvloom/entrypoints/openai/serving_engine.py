"""What every OpenAI endpoint shares: the engine handle, model-name resolution (the served
model or a LoRA adapter), prompt tokenization and length checks, running engine requests,
and token strings for logprobs.

n > 1 is the engine's business: each prompt is one engine request with
``SamplingParams(n=...)``, which the engine fans out into n sequences (child i of a seeded
request samples with seed + i, see ``kvloom.engine.parallel_sampling``) and merges back:
every ``RequestOutput`` carries the sequences with something new, each with its
``CompletionOutput.index``. Several prompts are several engine requests whose streams are
merged as outputs arrive (``merge_async_iterators``); choice ``prompt_index * n + index``
of a response is sequence ``index`` of prompt ``prompt_index``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from kvloom.entrypoints.openai.errors import APIError, from_validation_error
from kvloom.entrypoints.openai.protocol import SamplingRequest
from kvloom.entrypoints.openai.serving_models import OpenAIServingModels
from kvloom.lora.request import LoRARequest
from kvloom.outputs import RequestOutput
from kvloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvloom.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Prompt:
    """One tokenized prompt. ``text`` is what the user sent (or the rendered chat
    template); None for a token-id prompt until someone needs it (echo)."""

    token_ids: list[int]
    text: str | None = None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: str) -> str:
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"

#: (prompt index, RequestOutput) pairs as the engine produces them.
PromptOutputs = AsyncIterator[tuple[int, RequestOutput]]


async def merge_async_iterators(*iterators: AsyncGenerator[T, None]) -> AsyncIterator[tuple[int, T]]:
    """(iterator index, item) from all ``iterators`` as items arrive (vLLM's helper of the
    same name). A single iterator is iterated directly; several each have one pending
    ``__anext__`` task, awaited together.

    Leaving early (the consumer closes or is cancelled, or an iterator raises) stops every
    iterator not exhausted: a pending task is cancelled, which throws ``CancelledError``
    into its generator (even if the task has not started); a generator waiting with an
    item nobody will take, and the single iterator, are closed. An engine stream's
    ``finally`` then aborts its request."""
    if len(iterators) == 1:
        (iterator,) = iterators
        try:
            async for item in iterator:
                yield 0, item
        finally:
            await iterator.aclose()
        return
    loop = asyncio.get_running_loop()
    pending: dict[asyncio.Task[T], int] = {loop.create_task(it.__anext__()): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[loop.create_task(iterators[index].__anext__())] = index
                yield index, item
    finally:
        unread: list[AsyncGenerator[T, None]] = []
        for task, index in pending.items():
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                unread.append(iterators[index])
        for iterator in unread:
            await iterator.aclose()


class OpenAIServing:
    def __init__(self, engine: "AsyncLLM", models: OpenAIServingModels | None = None) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_name = self.config.model.served_model_name
        self.max_model_len = self.config.model.max_model_len
        # The base model and its LoRA adapters; the server shares one among its endpoints.
        self.models = models if models is not None else OpenAIServingModels(engine)

    @property
    def lora_requests(self) -> dict[str, LoRARequest]:
        return self.models.lora_requests

    # ------------------------------------------------------------ checks

    def resolve_model(self, requested: str | None) -> LoRARequest | None:
        """The LoRA adapter a known model name selects (None = the base model); 404 if unknown."""
        return self.models.known(requested)

    async def resolve_model_or_lora(self, requested: str | None) -> LoRARequest | None:
        """``resolve_model``, but an unknown name may be found (and loaded) by a LoRA resolver."""
        return await self.models.resolve(requested)

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise APIError(
                f"priority: {priority} needs the server to run with --scheduling-policy priority "
                "(it uses fcfs; allowed value: 0)",
                param="priority",
            )

    def require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(
                f"{param}: the server runs without a tokenizer (--skip-tokenizer-init); send token ids instead",
                param=param,
            )
        return self.tokenizer

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True, param: str = "prompt") -> Prompt:
        if isinstance(prompt, str):
            tokenizer = self.require_tokenizer(param)
            return Prompt(list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens)), prompt)
        if any(t < 0 for t in prompt):
            raise APIError(f"{param}: token ids must be non-negative", param=param)
        return Prompt(list(prompt))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The chat template applied to ``messages`` (a 400 when it cannot be)."""
        tokenizer = self.require_tokenizer("messages")
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError(f"messages: the model {self.model_name} has no chat template; use /v1/completions",
                           param="messages")  # fmt: skip
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as exc:  # jinja's TemplateError, or the template's own raise_exception
            raise APIError(f"messages: the chat template rejected them: {exc}", param="messages") from None

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool) -> Prompt:
        text = self.render_chat(messages, add_generation_prompt)
        # The template already wrote the special tokens (BOS, role markers).
        return self.tokenize(text, add_special_tokens=False, param="messages")

    def prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""
        return prompt.text

    def max_tokens_for(self, prompt: Prompt, requested: int | None, param: str, max_tokens_param: str) -> int:
        """Check the prompt against max_model_len; the max_tokens this prompt may use."""
        n_prompt, limit = len(prompt.token_ids), self.max_model_len
        if n_prompt == 0:
            raise APIError(f"{param}: the prompt is empty (it has no tokens)", param=param)
        if n_prompt >= limit:
            raise APIError(
                f"{param}: the prompt is {n_prompt} tokens, but this model's maximum context length is {limit} "
                f"tokens (allowed: at most {limit - 1} prompt tokens)",
                param=param,
                code="context_length_exceeded",
            )
        room = limit - n_prompt
        if requested is None:
            return room
        if requested > room:
            raise APIError(
                f"{max_tokens_param}: {requested} is too large: the prompt uses {n_prompt} of this model's "
                f"{limit}-token context (allowed range: 1 <= {max_tokens_param} <= {room})",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        return requested

    # ------------------------------------------------------------ generation

    @staticmethod
    def sampling_params(
        request: SamplingRequest, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        """``request.sampling_params(...)``, made before anything is sent so that a bad
        combination of fields (e.g. min_tokens > max_tokens) is a 400."""
        try:
            return request.sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValidationError as exc:
            raise from_validation_error(exc, SamplingParams) from None

    def generate(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: list[SamplingParams],
        lora_request: LoRARequest | None,
        priority: int,
        cache_salt: str | None,
    ) -> PromptOutputs:
        """One engine request per prompt (``params[i]`` for ``prompts[i]``, n included);
        (prompt index, output) as outputs arrive. See ``merged``."""
        return self.merged(
            [
                self.engine.generate(
                    {"prompt_token_ids": prompt.token_ids},
                    prompt_params,
                    f"{request_id}-{i}",
                    lora_request=lora_request,
                    priority=priority,
                    cache_salt=cache_salt,
                )
                for i, (prompt, prompt_params) in enumerate(zip(prompts, params))
            ]
        )

    @staticmethod
    async def merged(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
        """(stream index, output) from the engine's streams as outputs arrive.

        Leaving the iteration early (the client went away) stops every stream, which
        aborts its engine request with all its sequences. ``ValueError`` from the engine
        (bad input) becomes a 400; anything else a 500."""
        try:
            async with aclosing(merge_async_iterators(*streams)) as outputs:
                async for item in outputs:
                    yield item
        except Exception as exc:
            raise _as_api_error(exc) from None  # _as_api_error logs an engine failure

    # ------------------------------------------------------------ logprobs

    def token_str(self, token_id: int, decoded: str | None) -> str:
        if decoded is not None:
            return decoded
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def _as_api_error(error: BaseException) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return APIError(str(error))
    logger.error("Engine error while generating", exc_info=error)
    return APIError(
        f"The engine failed while generating: {type(error).__name__}: {error}",
        status=HTTPStatus.INTERNAL_SERVER_ERROR,
        code="engine_error",
    )
