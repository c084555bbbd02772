"""What every OpenAI endpoint shares: the engine handle, model-name resolution (the served
model or a LoRA adapter), prompt tokenization and length checks, the fan-out of a request
into one engine request per (prompt, choice), and token strings for logprobs.

A request with several prompts or ``n > 1`` becomes ``len(prompts) * n`` engine requests,
one per choice (``index = prompt_index * n + i``), merged back into one stream. Choice i of
a seeded request samples with seed ``seed + i`` so that the n choices differ but stay
reproducible.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from kvloom.entrypoints.openai.errors import APIError, from_validation_error
from kvloom.entrypoints.openai.serving_models import OpenAIServingModels
from kvloom.lora.request import LoRARequest
from kvloom.outputs import RequestOutput
from kvloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvloom.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

_MAX_SEED = 2**63 - 1


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

#: (choice index, RequestOutput) pairs as the engine produces them.
ChoiceOutputs = AsyncIterator[tuple[int, RequestOutput]]


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
    def child_seed(seed: int | None, i: int) -> int | None:
        if seed is None or i == 0:
            return seed
        return seed + i if seed + i <= _MAX_SEED else seed - i

    def build_params(
        self, num_prompts: int, n: int, seed: int | None, make_params: Callable[[int], SamplingParams]
    ) -> list[list[SamplingParams]]:
        """SamplingParams per prompt and choice, made before anything is sent so that a
        bad combination is a 400. ``make_params(prompt_index)`` gives the shared ones."""
        try:
            params = []
            for p in range(num_prompts):
                row = []
                for i in range(n):
                    choice = make_params(p)
                    choice.seed = self.child_seed(seed, i)
                    row.append(choice)
                params.append(row)
            return params
        except ValidationError as exc:
            raise from_validation_error(exc, SamplingParams) from None

    async def generate_choices(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: list[list[SamplingParams]],
        lora_request: LoRARequest | None,
        priority: int,
        cache_salt: str | None,
    ) -> ChoiceOutputs:
        """Run one engine request per choice; yield (choice index, output) as they arrive.
        ``params[prompt_index][i]`` is choice i of that prompt (see ``build_params``).

        Leaving the iteration early (the client went away) cancels every engine request,
        which aborts it in the engine. ``ValueError`` from the engine (bad input) becomes
        a 400; anything else a 500."""
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(index: int, prompt: Prompt, params: SamplingParams) -> None:
            try:
                stream = self.engine.generate(
                    {"prompt_token_ids": prompt.token_ids},
                    params,
                    f"{request_id}-{index}",
                    lora_request=lora_request,
                    priority=priority,
                    cache_salt=cache_salt,
                )
                async for output in stream:
                    queue.put_nowait((index, output, None))
                queue.put_nowait((index, None, None))
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait((index, None, exc))

        tasks = []
        for p, prompt in enumerate(prompts):
            n = len(params[p])
            for i, choice_params in enumerate(params[p]):
                tasks.append(asyncio.create_task(pump(p * n + i, prompt, choice_params)))
        try:
            running = len(tasks)
            while running:
                index, output, error = await queue.get()
                if error is not None:
                    raise _as_api_error(error)
                if output is None:
                    running -= 1
                    continue
                yield index, output
        finally:
            for task in tasks:
                task.cancel()

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
