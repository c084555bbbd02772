"""Parallel sampling (n > 1): one user request fans out into n independent child requests.

Each child is an ordinary ``EngineCoreRequest`` with ``n=1`` and id ``f"{i}_{parent_id}"``.
The children share the prompt token ids, so with prefix caching the prompt's full KV
blocks are computed once and shared. With a seed, child i samples with ``seed + i``: the
n samples differ but the whole request stays reproducible. Only child 0 asks for prompt
logprobs (they are the same for every child).

The ``ParentRequest`` gathers the children's ``CompletionOutput``s (``index`` = i) into
one ``RequestOutput`` under the parent's id, which is finished when all children are.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvloom.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from kvloom.request import EngineCoreRequest
from kvloom.sampling_params import _MAX_SEED, RequestOutputKind, SamplingParams


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def _child_seed(seed: int, index: int) -> int:
    """seed + index, wrapped into SamplingParams' allowed seed range."""
    span = 2 * _MAX_SEED + 1
    return (seed + index + _MAX_SEED) % span - _MAX_SEED


class ParentRequest:
    """State of a user request with n > 1 in the front end."""

    def __init__(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        if params is None:
            raise ValueError("ParentRequest: parallel sampling needs sampling_params (not a pooling request)")
        self.request = request
        self.request_id = request.request_id
        self.sampling_params: SamplingParams = params
        self.n = params.n
        self.output_kind = params.output_kind
        self.queue: Any = None  # the OutputQueue of the parent's outputs (OutputProcessor.add_request)

        self._unfinished: set[int] = set(range(self.n))
        self._latest: dict[int, CompletionOutput] = {}  # newest output of each child
        self._step: dict[int, CompletionOutput] = {}  # outputs of children in this step (DELTA)
        self._child_metrics: dict[int, RequestMetrics] = {}
        self._max_num_generation_tokens = 0
        self._prompt: str | None = None
        self._prompt_logprobs: PromptLogprobs | None = None
        self._num_cached_tokens = 0
        self._emitted_final = False

    # ----------------------------------------------------------------- fan out

    def child_sampling_params(self, index: int) -> SamplingParams:
        params = self.sampling_params
        update: dict[str, Any] = {"n": 1}
        if params.seed is not None:
            update["seed"] = _child_seed(params.seed, index)
        if index > 0:
            update["prompt_logprobs"] = None
        return params.model_copy(update=update)

    def child_requests(self) -> list[tuple[int, EngineCoreRequest]]:
        """(index, child request) for i in 0..n-1, to add to the output processor and the core."""
        return [
            (
                i,
                msgspec.structs.replace(
                    self.request,
                    request_id=child_request_id(i, self.request_id),
                    sampling_params=self.child_sampling_params(i),
                ),
            )
            for i in range(self.n)
        ]

    # ----------------------------------------------------------------- fan in

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def record_child_output(
        self,
        index: int,
        completion: CompletionOutput | None,
        child_finished: bool,
        num_generation_tokens: int,
        metrics: RequestMetrics,
        prompt: str | None,
        prompt_logprobs: PromptLogprobs | None,
        num_cached_tokens: int,
    ) -> None:
        """Take one child's output of this step (``completion`` None: nothing to show yet)."""
        if completion is not None:
            self._latest[index] = completion
            self._step[index] = completion
        if child_finished:
            self._unfinished.discard(index)
            self._max_num_generation_tokens = max(self._max_num_generation_tokens, num_generation_tokens)
        self._child_metrics[index] = metrics
        self._prompt = prompt
        if index == 0:
            if prompt_logprobs is not None:
                self._prompt_logprobs = prompt_logprobs
            self._num_cached_tokens = num_cached_tokens

    @property
    def max_num_generation_tokens(self) -> int:
        return self._max_num_generation_tokens

    def make_request_output(self, prompt_token_ids: list[int]) -> RequestOutput | None:
        """The parent's output for this step, or None when there is nothing to show."""
        finished = self.finished
        if self._emitted_final:
            return None
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                self._step.clear()
                return None
            outputs = [self._latest[i] for i in sorted(self._latest)]
        elif self.output_kind == RequestOutputKind.DELTA:
            outputs = [self._step[i] for i in sorted(self._step)]
        else:
            outputs = [self._latest[i] for i in sorted(self._latest)]
        if not outputs and not finished:
            return None
        self._step.clear()
        prompt_logprobs = self._prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA:
            self._prompt_logprobs = None  # delivered once
        self._emitted_final = finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self._prompt,
            prompt_token_ids=prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self._num_cached_tokens,
            metrics=self._merged_metrics(finished),
            lora_request=self.request.lora_request,
        )

    def _merged_metrics(self, finished: bool) -> RequestMetrics:
        children = list(self._child_metrics.values())

        def earliest(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return min(known) if known else None

        def latest(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return max(known) if known else None

        return RequestMetrics(
            arrival_time=self.request.arrival_time,
            first_scheduled_time=earliest([m.first_scheduled_time for m in children]),
            first_token_time=earliest([m.first_token_time for m in children]),
            last_token_time=latest([m.last_token_time for m in children]),
            finished_time=latest([m.finished_time for m in children]) if finished else None,
        )
