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

Everything is checked before the first byte of a response: the fields' ranges (those the
model bounds, such as ``top_k`` and token ids, with ``kvloom.model_limits``' rules, which
the engine's front end and core apply too), the request's size
(``ServerLimits``), and the prompts are tokenized (large ones off the event loop,
``limits.run_blocking``) and admitted into the engine (``AsyncLLM.add_request``), so
that bad input is a 400 even for a stream. Engine errors: a request the engine refused is
a 400 with its reason; one that failed in the engine, or any other failure, is a 500
saying "internal error" with the request id, the details going to the log only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import ValidationError

from kvloom.engine.core_client import EngineDeadError
from kvloom.engine.errors import RequestFailedError
from kvloom.engine.input_processor import priority_problem
from kvloom.entrypoints.openai.errors import APIError, engine_dead_error, from_validation_error, internal_error
from kvloom.entrypoints.openai.limits import ServerLimits, run_blocking
from kvloom.entrypoints.openai.protocol import SamplingRequest
from kvloom.entrypoints.openai.serving_models import OpenAIServingModels
from kvloom.lora.request import LoRARequest
from kvloom.model_limits import ModelLimits, Problem, out_of_vocab, params_problems, prompt_problems
from kvloom.outputs import RequestOutput
from kvloom.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams
from kvloom.structured_output.registry import DEFAULT_BACKEND, validate_structured_outputs

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


class ChunkTemplate:
    """The JSON of a stream's most common chunk (text alone: no logprobs, not finished),
    written once by pydantic around a placeholder text and then filled per token.

    Why: validating and serializing a chunk model costs ~15 us, a tenth of the server's CPU
    per streamed token (``benchmarks/bench_frontend_stream.py``); filling the template costs
    ~1 us, and the layout stays pydantic's (``tests/entrypoints/openai/test_chunk_template.py``
    checks it against the model's own JSON)."""

    TEXT: ClassVar[str] = "kvloom-chunk-text-placeholder"

    def __init__(self, chunk_json: str) -> None:
        """``chunk_json``: the chunk's JSON as the stream sends it, ``ChunkTemplate.TEXT`` as its text."""
        head, found, tail = chunk_json.partition(json.dumps(self.TEXT))
        if not found or self.TEXT in tail:
            raise ValueError("the chunk must hold ChunkTemplate.TEXT exactly once")
        self.head, self.tail = "data: " + head, tail + "\n\n"

    def sse(self, text: str) -> str:
        """The chunk's event with ``text`` in place of the placeholder, without building a model."""
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


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


#: A text prompt longer than this many characters per token of ``max_model_len`` is
#: first tokenized only up to that length: when that prefix alone has more tokens than the
#: context holds (plus ``_PREFIX_SLACK`` for a word cut in two), the prompt is refused
#: without tokenizing the rest (a token averages about 4 characters).
_PREFIX_CHARS_PER_TOKEN = 16
_PREFIX_SLACK = 32
#: Admit this many prompts of one request, then let the event loop serve others.
_ADMIT_BATCH = 16


class OpenAIServing:
    #: Log each request's id, prompt sizes and sampling parameters (``--enable-log-requests``).
    log_requests: bool = False

    def __init__(
        self, engine: "AsyncLLM", models: OpenAIServingModels | None = None, limits: ServerLimits | None = None
    ) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_name = self.config.model.served_model_name
        self.max_model_len = self.config.model.max_model_len
        self.model_limits = ModelLimits.of(self.config.model)
        # --generation-config (ModelConfig)
        self.generation_defaults: dict[str, Any] = dict(getattr(self.config.model, "generation_defaults", {}) or {})
        structured_config = getattr(self.config, "structured_outputs", None)
        self.structured_outputs_backend = structured_config.backend if structured_config is not None else DEFAULT_BACKEND
        self.limits = limits if limits is not None else ServerLimits()
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
        problem = priority_problem(priority, self.config.scheduler.policy)
        if problem is not None:
            raise APIError(problem, param="priority")

    def check_num_sequences(self, num_prompts: int, n: int, param: str) -> None:
        """At most ``--max-sequences-per-request`` engine sequences (prompts x n)."""
        limit = self.limits.max_sequences_per_request
        if num_prompts * n > limit:
            raise APIError(
                f"{param}: {num_prompts} prompt(s) x n={n} make {num_prompts * n} sequences, more than this "
                f"server allows in one request (allowed: prompts x n <= {limit}, --max-sequences-per-request)",
                param=param,
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Token ids in the vocabulary."""
        problem = out_of_vocab(ids, self.model_limits.vocab_size)
        if problem is not None:
            raise APIError(f"{param}: {problem}", param=param)

    @staticmethod
    def raise_first(problems: list[Problem], code: str | None = None) -> None:
        """The first of the model-bounded rules' problems (``kvloom.model_limits``) as a
        400 naming the field."""
        if problems:
            field, message = problems[0]
            raise APIError(message, param=field, code=code)

    def require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(
                f"{param}: the server runs without a tokenizer (--skip-tokenizer-init); send token ids instead",
                param=param,
            )
        return self.tokenizer

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True, param: str = "prompt",
                 limit: int | None = None) -> Prompt:  # fmt: skip
        """Tokenize a text prompt, or check a token-id prompt against the vocabulary. A
        text that cannot fit ``limit`` tokens (default: max_model_len) may be refused after
        tokenizing a prefix of it (see ``_PREFIX_CHARS_PER_TOKEN``)."""
        if not isinstance(prompt, str):
            self.check_token_ids(prompt, param)
            return Prompt(list(prompt))
        tokenizer = self.require_tokenizer(param)
        limit = self.max_model_len if limit is None else limit
        prefix_chars = _PREFIX_CHARS_PER_TOKEN * limit
        if len(prompt) > prefix_chars:
            n_prefix = len(self._encode(tokenizer, prompt[:prefix_chars], add_special_tokens, param))
            if n_prefix > limit + _PREFIX_SLACK:
                raise APIError(
                    f"{param}: the prompt has more than {n_prefix - _PREFIX_SLACK} tokens (its first {prefix_chars} "
                    f"characters alone), but this model's maximum context length is {self.max_model_len} tokens",
                    param=param,
                    code="context_length_exceeded",
                )
        return Prompt(self._encode(tokenizer, prompt, add_special_tokens, param), prompt)

    @staticmethod
    def _encode(tokenizer: Any, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # the text cannot be tokenized (the body's strings are valid Unicode)
            logger.warning("Tokenizing %s failed: %r", param, exc)
            raise APIError(f"{param}: cannot be tokenized ({type(exc).__name__})", param=param) from None

    async def tokenize_async(self, prompt: str | list[int], add_special_tokens: bool = True, param: str = "prompt",
                             limit: int | None = None) -> Prompt:  # fmt: skip
        """``tokenize``, off the event loop when the prompt is large."""
        return await run_blocking(len(prompt), self.tokenize, prompt, add_special_tokens, param, limit)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> str:  # fmt: skip
        """The chat template applied to ``messages`` (a 400 when it cannot be);
        ``template_kwargs``: extra variables for the template (``chat_template_kwargs``)."""
        tokenizer = self.require_tokenizer("messages")
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError(f"messages: the model {self.model_name} has no chat template; use /v1/completions "
                           "or start the server with --chat-template", param="messages")  # fmt: skip
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tokenize=False,
                                                 **(template_kwargs or {}))  # fmt: skip
        except Exception as exc:  # jinja's TemplateError, or the template's own raise_exception
            raise APIError(f"messages: the chat template rejected them: {exc}", param="messages") from None

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool = False,
                    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> Prompt:
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, template_kwargs)
        # The template already wrote the special tokens (BOS, role markers).
        return self.tokenize(text, add_special_tokens=add_special_tokens, param="messages")

    async def chat_prompt_async(self, messages: list[dict], add_generation_prompt: bool,
                                add_special_tokens: bool = False, continue_final_message: bool = False,
                                template_kwargs: dict[str, Any] | None = None) -> Prompt:  # fmt: skip
        """``chat_prompt``, off the event loop when the messages are large."""
        size = sum(len(str(m.get("content") or "")) for m in messages) + 64 * len(messages)
        return await run_blocking(size, self.chat_prompt, messages, add_generation_prompt, add_special_tokens,
                                  continue_final_message, template_kwargs)  # fmt: skip

    def prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""
        return prompt.text

    def max_tokens_for(self, prompt: Prompt, requested: int | None, param: str, max_tokens_param: str) -> int:
        """Check the prompt against the model (``kvloom.model_limits``); the max_tokens
        this prompt may use."""
        n_prompt, limit = len(prompt.token_ids), self.max_model_len
        room = limit - n_prompt
        problems = prompt_problems(prompt.token_ids, self.model_limits, pooling=False,
                                   names={"prompt": param, "prompt_token_ids": param})  # fmt: skip
        self.raise_first(problems, code="context_length_exceeded" if room < 1 else None)
        if requested is None:
            # The model's generation config may bound an unset max_tokens (max_new_tokens).
            default = self.generation_defaults.get("max_tokens")
            return min(room, default) if isinstance(default, int) and default > 0 else room
        # The OpenAI API refuses what cannot fit (offline, LLM lets the context cut it short,
        # as vLLM does): a server rule, not one of the model's.
        if requested > room:
            raise APIError(
                f"{max_tokens_param}: {requested} is too large: the prompt uses {n_prompt} of this model's "
                f"{limit}-token context (allowed range: 1 <= {max_tokens_param} <= {room})",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        return requested

    # ------------------------------------------------------------ generation

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        names: dict[str, str] | None = None,
    ) -> SamplingParams:
        """``SamplingParams`` of the request with the generation config's defaults, made
        before anything is sent so that a bad value is a 400: first the rules the model
        bounds (``kvloom.model_limits``; ``names``: the request's names of the fields, e.g.
        chat's ``top_logprobs`` for ``logprobs``), which say more than the fields' own
        ranges, then those ranges and combinations (e.g. min_tokens > max_tokens)."""
        structured, _ = self.structured_outputs(request)
        values = request.sampling_values(max_tokens, logprobs, prompt_logprobs, self.generation_defaults,
                                         structured_outputs=structured)  # fmt: skip
        self.raise_first(params_problems(SamplingParams.model_construct(**values), self.model_limits, names))
        try:
            return SamplingParams(**values)
        except ValidationError as exc:
            raise from_validation_error(exc, SamplingParams) from None

    def structured_outputs(self, request: SamplingRequest) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint, checked by the structured-output backend (a
        schema, regex or grammar that cannot compile is a 400 naming the field)."""
        try:
            structured, field = request.structured_outputs_params()
            if structured is not None:
                if self.tokenizer is None:
                    raise ValueError(f"{field}: the server runs without a tokenizer (--skip-tokenizer-init), which "
                                     "structured outputs need")  # fmt: skip
                try:
                    validate_structured_outputs(structured, self.structured_outputs_backend)
                except ValueError as exc:
                    raise ValueError(f"{field}: {str(exc).removeprefix('structured_outputs.')}") from None
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(":", 1)[0]) from None
        return structured, field

    async def generate(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: list[SamplingParams],
        lora_request: LoRARequest | None,
        priority: int,
        cache_salt: str | None,
    ) -> PromptOutputs:
        """Admit one engine request per prompt (``params[i]`` for ``prompts[i]``, n
        included) now, then return (prompt index, output) as outputs arrive (``merged``).
        A prompt the engine refuses is a 400 here, and nothing of the request runs."""
        inputs = [{"prompt_token_ids": prompt.token_ids} for prompt in prompts]
        if self.log_requests:
            logger.info("Received request %s: %d prompt(s) of %s tokens, lora %s, params %s", request_id, len(prompts),
                        [len(p.token_ids) for p in prompts], lora_request.lora_name if lora_request else None,
                        params[0])  # fmt: skip
        streams = await self.admit(request_id, inputs, params, lora_request, priority, cache_salt)
        return AdmittedOutputs(streams, request_id)

    async def admit(
        self,
        request_id: str,
        inputs: list[Any],
        params: list[SamplingParams] | list[PoolingParams],
        lora_request: LoRARequest | None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[Any]:
        """``engine.add_request`` for each input (id ``{request_id}-{i}``): the admitted
        requests' output streams. If one fails, those admitted are aborted and the error
        raised as an API error. Between batches of admissions the event loop serves others."""
        streams: list[Any] = []
        try:
            for i, (item, item_params) in enumerate(zip(inputs, params)):
                if i and i % _ADMIT_BATCH == 0:
                    await asyncio.sleep(0)
                streams.append(self.engine.add_request(f"{request_id}-{i}", item, item_params,
                                                       lora_request=lora_request, priority=priority,
                                                       cache_salt=cache_salt))  # fmt: skip
        except BaseException as exc:
            for stream in streams:
                await stream.aclose()
            if isinstance(exc, Exception):
                raise _as_api_error(exc, request_id) from None
            raise
        return streams

    @staticmethod
    async def merged(streams: list[AsyncGenerator[T, None]], request_id: str = "") -> AsyncIterator[tuple[int, T]]:
        """(stream index, output) from the engine's streams as outputs arrive.

        Leaving the iteration early (the client went away) stops every stream, which
        aborts its engine request with all its sequences. A request the engine refused
        (``ValueError``) becomes a 400; anything else a 500 ("internal error", logged)."""
        try:
            async with aclosing(merge_async_iterators(*streams)) as outputs:
                async for item in outputs:
                    yield item
        except Exception as exc:
            raise _as_api_error(exc, request_id) from None  # _as_api_error logs an engine failure

    # ------------------------------------------------------------ logprobs

    def token_str(self, token_id: int, decoded: str | None) -> str:
        if decoded is not None:
            return decoded
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


class AdmittedOutputs:
    """(prompt index, output) of admitted engine requests as outputs arrive
    (``OpenAIServing.merged``). ``aclose()`` aborts every request not finished, also when
    the outputs were never read (a client gone before its stream started)."""

    def __init__(self, streams: list[Any], request_id: str) -> None:
        self._streams = streams
        self._merged = OpenAIServing.merged(streams, request_id)

    def __aiter__(self) -> "AdmittedOutputs":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        return await self._merged.__anext__()

    async def aclose(self) -> None:
        await self._merged.aclose()
        for stream in self._streams:
            await stream.aclose()


class EventStream:
    """A response's server-sent events (``chunks``) over ``outputs``: ``aclose()`` closes
    both, so that the server can abort the requests of a stream whatever became of it."""

    def __init__(self, chunks: AsyncGenerator[str, None], outputs: Any) -> None:
        self._chunks = chunks
        self._outputs = outputs

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> str:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()
        await self._outputs.aclose()


def _as_api_error(error: BaseException, request_id: str) -> APIError:
    """An engine error as the client sees it: bad input (``ValueError``, which includes a
    request the engine refused) is a 400 with its message; anything else is logged and a
    500 that names only the request id."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestFailedError):
        logger.error("Request %s failed in the engine: %s", request_id, error.detail)
        return internal_error(request_id)
    if isinstance(error, ValueError):
        return APIError(str(error))
    if isinstance(error, EngineDeadError):
        logger.error("Request %s: %s", request_id, error)
        return engine_dead_error(request_id)
    logger.error("Engine error while serving request %s", request_id, exc_info=error)
    return internal_error(request_id)
