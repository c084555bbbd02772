"""Requests as the engine core sees them, with their statuses and lifecycle events."""

from __future__ import annotations

import enum
import time

import msgspec

from kvloom.lora.request import LoRARequest
from kvloom.sampling_params import PoolingParams, SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request finished (the string is what the OpenAI API reports)."""

    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the client, or refused by the engine when it arrived
    ERROR = "error"  # failed inside the engine (its own work failed; the others went on)

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    """Where a request is in its lifecycle. Everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # waiting for a structured-output grammar to compile
    WAITING_FOR_REMOTE_KVS = enum.auto()  # waiting for its KV to arrive through the KV connector
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # rejected (e.g. prompt longer than max_model_len)
    FINISHED_ERROR = enum.auto()  # its own work failed in a step (see ModelRunnerOutput.failed)

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class EngineCoreEventType(enum.IntEnum):
    """Per-request events the core timestamps so the front end can compute intervals."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):
    """An event with a monotonic timestamp taken in the engine-core process."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: float | None = None) -> "EngineCoreEvent":
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the front end sends to the engine core: a tokenized, validated request.

    A msgspec Struct (as are the engine core's outputs): it crosses the process boundary
    as msgpack (``kvloom.engine.serial``). ``client_index`` names the front end (API
    server process) that sent it, when several share an engine core: its outputs go back
to that front end only.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None = None
    eos_token_id: int | None = None
    arrival_time: float = msgspec.field(default_factory=time.time)
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    priority: int = 0
    client_index: int = 0


class Request:
    """A request inside the engine core: tokens so far, progress, status and events.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix-cache hits
    included); ``num_tokens`` counts prompt + output tokens. Draft tokens from speculative
    decoding (``spec_token_ids``) are scheduled as extra new tokens but are not part of
    ``all_token_ids`` until accepted.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        pooling_params: PoolingParams | None = None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.priority = priority

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by steps still in flight (not in
        # output_token_ids yet, but already scheduled as inputs of the next step).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.events: list[EngineCoreEvent] = []
        # Block hashes of the full blocks of all_token_ids, computed incrementally by the
        # KV cache manager (prefix caching) or the KV connector's part of the scheduler.
        self.block_hashes: list[bytes | int] = []
        #: What the KV connector reads for this request (``SamplingParams.kv_transfer_params``).
        self.kv_transfer_params = sampling_params.kv_transfer_params if sampling_params is not None else None

        if sampling_params is not None:
            self.max_tokens = sampling_params.max_tokens
        else:  # pooling: the prompt is all there is
            self.max_tokens = 1

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> "Request":
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            pooling_params=req.pooling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            lora_request=req.lora_request,
            cache_salt=req.cache_salt,
            priority=req.priority,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def skip_prefix_cache_reading(self) -> bool:
        """Requests that need a result for every prompt position (pooling, prompt
        logprobs) must compute it: a prefix-cache hit would skip those positions. Their
        blocks are still cached for others."""
        if self.pooling_params is not None:
            return True
        return self.sampling_params is not None and self.sampling_params.prompt_logprobs is not None

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):  # the scheduler's case, once per request per step
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        self.events.append(EngineCoreEvent.new_event(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __lt__(self, other: "Request") -> bool:
        """Priority order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
