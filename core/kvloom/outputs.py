"""Outputs at each boundary: model runner -> scheduler -> front end -> user."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kvloom.kv_transfer.output import KVConnectorReport
from kvloom.metrics.scheduler_stats import SchedulerStats
from kvloom.request import EngineCoreEvent, FinishReason

# ----------------------------------------------------------------- model runner -> scheduler


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs for one position: the chosen token first, then the top-N.

    ``token_ids[0]`` is the sampled (or prompt) token and ``ranks[0]`` its rank in the
    vocabulary (1 = most likely); entries 1..N are the top-N tokens, ranks 1..N.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    #: Per request, in ``req_ids`` order: the accepted tokens of this step
    #: ([] while a prompt is still being prefilled in chunks).
    sampled_token_ids: list[list[int]]
    #: Per request: one TokenLogprobs per sampled token, or None if not requested.
    logprobs: list[list[TokenLogprobs] | None] | None = None
    #: Per request id: prompt logprobs computed this step (one entry per prompt position
    #: after the first, in order; chunked prefill delivers them in pieces).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    #: Per request: the pooled vector for pooling requests whose prompt is complete.
    pooler_output: list[torch.Tensor | None] | None = None
    #: Requests whose own work failed in this step (request id -> what failed): their
    #: sampling, prompt logprobs, pooling, LoRA or state set-up. They are in ``req_ids``
    #: with no tokens; the scheduler finishes them with ``FinishReason.ERROR`` while the
    #: rest of the batch goes on.
    failed: dict[str, str] = field(default_factory=dict)
    #: Speculative decoding: per request, in ``req_ids`` order, the drafts the proposer made
    #: for its next step ([] for none); None: no proposer ran.
    spec_token_ids: list[list[int]] | None = None
    #: The KV connector's report of the step, None without a connector.
    kv_connector_output: KVConnectorReport | None = None


class PendingModelRunnerOutput(ABC):
    """A step launched on the device whose results may not be on the host yet.

    ``get_output()`` waits for them; repeated calls return the same output. Async
    scheduling keeps one of these in flight while the next step is scheduled and launched
    behind it. A worker whose step is complete when it returns wraps its output with
    ``done(output)``; the model runner returns an ``AsyncModelRunnerOutput``.
    """

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """The step's results, on the host (waits for the device if need be)."""

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> "PendingModelRunnerOutput":
        """An already complete step."""
        return _CompletedModelRunnerOutput(output)


class _CompletedModelRunnerOutput(PendingModelRunnerOutput):
    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def get_output(self) -> ModelRunnerOutput:
        return self._output


# ----------------------------------------------------------------- scheduler -> front end
#
# msgspec Structs (array-like, defaults omitted): they cross the process boundary as
# msgpack, see ``kvloom.engine.serial``.


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    pooling_output: torch.Tensor | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    num_cached_tokens: int = 0
    #: Why the request ended without a result: with ``FinishReason.ABORT``, the engine
    #: refused it when it arrived (bad input); with ``FinishReason.ERROR``, its own work
    #: failed in a step. None otherwise.
    error: str | None = None
    #: The KV connector's params of a finished request (e.g. where its KV waits for a
    #: decode instance), passed on to the user's ``RequestOutput``.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineLoad(msgspec.Struct, array_like=True, gc=False):
    """How busy one engine core of several (data parallelism) is after a step: what the
    front ends balance requests by (``engine/load_balancer.py``). Sent whether or not stats
    are logged."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    #: Monotonic time (engine-core process) at which these outputs were produced.
    timestamp: float = 0.0
    finished_requests: set[str] = msgspec.field(default_factory=set)
    #: Which engine core produced them (several serve one front end with data parallelism).
    engine_index: int = 0
    #: The engine core's load after this step, with data parallelism (every step, to every client).
    load: EngineLoad | None = None


# ----------------------------------------------------------------- front end -> user


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One dict per position: token id -> Logprob (vLLM's shape).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    lora_request: Any = None
    #: The KV connector's params of the finished request (vLLM's field): what a proxy
    #: passes to the decode instance of a prefill.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class PoolingOutput:
    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The pooled result of one prompt (``LLM.encode``; what IO processors post-process).

    With an IO processor, ``LLM.encode`` returns one of these whose ``outputs`` is the
    processor's output instead.
    """

    request_id: str
    """The engine request's id."""
    outputs: PoolingOutput
    """``outputs.data``: the pooled vector (a float tensor on the CPU)."""
    prompt_token_ids: list[int]
    """The prompt's token ids."""
    finished: bool = True
    """Always ``True`` (pooling finishes in one step)."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float
    """The pair's score: a cross-encoder's sigmoid(logit), or the cosine of two embeddings."""


@dataclass
class ScoringRequestOutput:
    """The score of one text pair (``LLM.score``; vLLM's class of the same name)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    """The pair's prompt (cross-encoder) or the two texts' tokens one after the other."""
    finished: bool = True
