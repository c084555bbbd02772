"""What the scheduler hands the worker each step (vLLM V1's SchedulerOutput).

The worker keeps a persistent copy of every running request (tokens, block table), so a
step only carries differences: new requests in full, running ones as new block ids.
A request that was preempted and is scheduled again comes back as a *new* request with
all its tokens (prompt + output so far); ``finished_req_ids`` also lists preempted ids so
the worker drops their state.

Block ids come per KV-cache group (``kvloom.kv_cache.spec``): one list per group, in group
order (a model with one attention type has one group). A sliding-window group's list
holds the null block (id 0) where blocks that slid out of the window were given back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvloom.lora.request import LoRARequest
from kvloom.sampling_params import PoolingParams, SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    #: Tokens generated before a preemption (recomputed together with the prompt).
    output_token_ids: list[int]
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    #: The request's block table, one list per KV-cache group.
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    #: The request's EOS id (the sampler masks it until min_tokens are generated).
    eos_token_id: int | None = None


@dataclass
class CachedRequestData:
    req_id: str
    #: Blocks appended to the request's block table this step, one list per KV-cache
    #: group (each may be empty).
    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    #: Pipeline parallelism only: the tokens this step computes (positions
    #: ``num_computed_tokens`` on), which the stages before the last did not sample
    #: themselves. None without pipeline parallelism.
    new_token_ids: list[int] | None = None
    #: Speculative decoding: the request's block table was cut to its first this many
    #: blocks (the slots of rejected drafts went back to the pool) before ``new_block_ids``
    #: are appended. None: nothing was cut.
    num_kept_blocks: int | None = None


@dataclass
class GrammarOutput:
    """The bitmask a step's sampling applies (``sample_tokens`` of a step whose
    ``pending_structured_output_tokens`` deferred it): request id -> its row of
    ``grammar_bitmask`` (int32 ``[rows, ceil(vocab_size / 32)]``, CPU)."""

    structured_output_request_ids: dict[str, int]
    grammar_bitmask: torch.Tensor


@dataclass
class KVTransferStep:
    """The KV connector's part of a step (``kvloom.scheduler.kv_connector``): the
    connector's metadata and the loads the scheduler expects, by request, so that the
    model runner's part can tell which requests a failed load concerns."""

    #: What the connector's scheduler side built for its worker side (None: building it
    #: failed, and every load of the step fails).
    metadata: Any
    #: Request id -> device blocks loaded in this step, before its forward reads them.
    sync_loads: dict[str, list[int]] = field(default_factory=dict)
    #: Request id -> device blocks whose asynchronous load starts in this step.
    async_loads: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    #: Tokens to compute this step per request id (draft tokens included).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    #: Draft tokens per request id (speculative decoding), verified this step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    #: Requests finished, aborted or preempted since the last step: drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    #: Structured outputs: request id -> its row of ``grammar_bitmask``, for the
    #: structured requests that sample this step.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    #: int32 ``[rows, ceil(vocab_size / 32)]`` on the CPU: bit ``t`` of a row set when
    #: token ``t`` may be sampled (``kvloom.structured_output.bitmask``).
    grammar_bitmask: torch.Tensor | None = None
    #: Async scheduling: a structured request sampling in this step has a token of the step
    #: still in flight, so its bitmask cannot be filled yet (``grammar_bitmask`` is None).
    #: The worker runs the forward and keeps the logits; the engine core fills the bitmask
    #: once that token is back (``Scheduler.get_grammar_bitmask``) and has the step sampled
    #: with it (``sample_tokens``).
    pending_structured_output_tokens: bool = False
    #: The KV connector's part of the step (None without a connector).
    kv_connector_metadata: KVTransferStep | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
