"""Helpers of the scheduler (vLLM: ``vllm/v1/core/sched/utils.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.outputs import EngineCoreOutput
from kvloom.request import Request, RequestStatus
from kvloom.scheduler.output import CachedRequestData, NewRequestData


@dataclass
class StepPlan:
    """What one ``schedule()`` has decided so far; each phase adds to it."""

    token_budget: int
    """Tokens the step may still schedule (``max_num_batched_tokens`` at the start)."""
    now: float
    """The step's timestamp for request events (0 without stats)."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_preempted: int = 0


def check_stop(request: Request, max_model_len: int) -> bool:
    """Apply stop conditions after one appended token; sets status and stop_reason."""
    params = request.sampling_params
    assert params is not None
    num_output_tokens = len(request.output_token_ids)
    if num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if last_token_id == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    max_tokens = request.max_tokens
    if len(request.all_token_ids) >= max_model_len or (max_tokens is not None and num_output_tokens >= max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def final_output(request: Request) -> EngineCoreOutput:
    """A final output without tokens (an abort, a failure, a request too large for the cache)."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=request.get_finished_reason(),
        stop_reason=request.stop_reason,
        events=request.take_events(),
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )


def stop_limits(request: Request, max_model_len: int) -> tuple[frozenset[int], int]:
    """A generating request's (token ids that may stop it, token count that ends it), so that
    the common step needs no full stop check."""
    params = request.sampling_params
    assert params is not None
    stop_token_ids = set(params.stop_token_ids)
    if request.eos_token_id is not None and not params.ignore_eos:
        stop_token_ids.add(request.eos_token_id)
    max_num_tokens = max_model_len
    if request.max_tokens is not None:
        max_num_tokens = min(max_num_tokens, request.num_prompt_tokens + request.max_tokens)
    return frozenset(stop_token_ids), max_num_tokens
