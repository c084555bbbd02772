"""The model runner's persistent per-request state.

Each running request owns one row of the host arrays: its token ids (prompt + outputs)
and its block table in every KV-cache group (``block_tables``, one array per group; a
model with one attention type has one). Rows are kept across steps so a decode step only
appends a token and, sometimes, a block id; building a step's inputs is then a few numpy
gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvloom.lora.request import LoRARequest
from kvloom.sampling_params import PoolingParams, SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    num_computed_tokens: int
    #: Blocks in the request's table, per KV-cache group.
    num_blocks: list[int]
    lora_request: LoRARequest | None = None
    generator: torch.Generator | None = None
    #: The model's end-of-sequence token, which ``min_tokens`` holds back.
    eos_token_id: int | None = None
    #: Running sum of hidden states for MEAN pooling across prefill chunks.
    pooling_sum: torch.Tensor | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class Placeholders:
    """The placeholder tokens (-1) one step appended (``InputBatch.append_placeholders``):
    one per request that samples a token the host learns later (``set_tokens``)."""

    states: list[CachedRequestState]
    #: Per request: the placeholder's index in its output tokens.
    output_index: list[int]
    #: Per request: its row, the placeholder's position in it, and the row's owner then
    #: (``InputBatch.row_owner``: a request that left the batch no longer owns its row).
    rows: np.ndarray
    positions: np.ndarray
    owners: np.ndarray


def _wants_prompt_logprobs(state: CachedRequestState) -> bool:
    return state.sampling_params is not None and state.sampling_params.prompt_logprobs is not None


class InputBatch:
    """Row-indexed token ids and block tables of the running requests."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, num_kv_cache_groups: int = 1
                 ) -> None:  # fmt: skip
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        #: One block table per KV-cache group (``block_table``: the first group's).
        self.block_tables = [
            np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32) for _ in range(num_kv_cache_groups)
        ]
        self.block_table = self.block_tables[0]
        #: Per row, which ``add`` put its request there (the version it made): a request
        #: that left and the one that took its row differ.
        self.row_owner = np.zeros(max_num_reqs, dtype=np.int64)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        #: Changes whenever a request is added or removed: while it stays, every request
        #: id still names the same state (what per-batch caches key on).
        self.version = 0
        #: How many requests in the batch want prompt logprobs (steps without any skip them).
        self.num_prompt_logprobs = 0

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self.requests[req_id]

    def add(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        sampling_params: SamplingParams | None,
        pooling_params: PoolingParams | None,
        block_ids: tuple[list[int], ...],
        num_computed_tokens: int,
        lora_request: LoRARequest | None,
        generator: torch.Generator | None,
        eos_token_id: int | None = None,
    ) -> CachedRequestState:
        if req_id in self.requests:
            raise RuntimeError(f"request {req_id} is already in the batch")
        if not self._free_rows:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_reqs} requests in the batch")
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {req_id} has {num_tokens} tokens, more than max_model_len {self.max_model_len}")
        row = self._free_rows.pop()
        self.token_ids[row, : len(prompt_token_ids)] = prompt_token_ids
        self.token_ids[row, len(prompt_token_ids) : num_tokens] = output_token_ids
        state = CachedRequestState(
            req_id=req_id,
            row=row,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            sampling_params=sampling_params,
            pooling_params=pooling_params,
            num_computed_tokens=num_computed_tokens,
            num_blocks=[0] * len(self.block_tables),
            lora_request=lora_request,
            generator=generator,
            eos_token_id=eos_token_id,
        )
        self.requests[req_id] = state
        self.version += 1
        self.row_owner[row] = self.version
        self.num_prompt_logprobs += _wants_prompt_logprobs(state)
        self.append_blocks(state, block_ids)
        return state

    def append_blocks(self, state: CachedRequestState, block_ids: tuple[list[int], ...]) -> None:
        """Append to the request's table in each KV-cache group (``block_ids``: one list per group)."""
        if len(block_ids) != len(self.block_tables):
            raise RuntimeError(f"request {state.req_id}: block ids for {len(block_ids)} KV-cache groups, the batch "
                               f"has {len(self.block_tables)}")  # fmt: skip
        for group, ids in enumerate(block_ids):
            if not ids:
                continue
            start = state.num_blocks[group]
            end = start + len(ids)
            if end > self.max_blocks_per_req:
                raise RuntimeError(f"request {state.req_id} needs {end} blocks, more than {self.max_blocks_per_req}")
            self.block_tables[group][state.row, start:end] = ids
            state.num_blocks[group] = end

    def keep_blocks(self, state: CachedRequestState, num_blocks: int) -> None:
        """The request's block table is its first ``num_blocks`` blocks now in every KV-cache
        group (speculative decoding gave the rest back); later blocks are appended after them."""
        if any(num_blocks > n for n in state.num_blocks):
            raise RuntimeError(f"request {state.req_id} keeps {num_blocks} blocks but has {state.num_blocks}")
        state.num_blocks = [num_blocks] * len(state.num_blocks)

    def write_drafts(self, state: CachedRequestState, drafts: list[int]) -> None:
        """Draft tokens to verify this step, after the request's known tokens (their row's
        positions are overwritten by the tokens accepted or sampled there)."""
        start = state.num_tokens
        end = min(start + len(drafts), self.max_model_len)
        self.token_ids[state.row, start:end] = drafts[: end - start]

    def append_token(self, state: CachedRequestState, token_id: int) -> None:
        n = state.num_tokens
        if n < self.max_model_len:
            self.token_ids[state.row, n] = token_id
        state.output_token_ids.append(token_id)

    def append_placeholders(self, states: list[CachedRequestState]) -> Placeholders:
        """Append a placeholder (-1) to each request's tokens: the token this step samples
        for it, still on its way to the host. Per request only its list grows here; the
        rows are written in one numpy assignment."""
        rows: list[int] = []
        positions: list[int] = []
        output_index: list[int] = []
        for state in states:
            out = state.output_token_ids
            rows.append(state.row)
            positions.append(len(state.prompt_token_ids) + len(out))
            output_index.append(len(out))
            out.append(-1)
        placeholders = Placeholders(states, output_index, np.array(rows, dtype=np.int64),
                                    np.array(positions, dtype=np.int64), self.row_owner[rows])  # fmt: skip
        self._write(placeholders.rows, placeholders.positions, -1)
        return placeholders

    def set_tokens(self, placeholders: Placeholders, token_ids: list[int]) -> None:
        """Replace each placeholder with its sampled token (``token_ids``, one per
        request), skipping requests that left the batch since (their rows may be reused)."""
        live = self.row_owner[placeholders.rows] == placeholders.owners
        for state, index, token_id, is_live in zip(placeholders.states, placeholders.output_index, token_ids,
                                                   live.tolist()):  # fmt: skip
            if is_live:
                state.output_token_ids[index] = token_id
        self._write(placeholders.rows[live], placeholders.positions[live], np.array(token_ids, dtype=np.int64)[live])

    def _write(self, rows: np.ndarray, positions: np.ndarray, values: np.ndarray | int) -> None:
        """``token_ids[rows, positions] = values`` where the position is inside the row
        (a request's last sampled token may lie past ``max_model_len``)."""
        inside = positions < self.max_model_len
        if not inside.all():
            rows, positions = rows[inside], positions[inside]
            if isinstance(values, np.ndarray):
                values = values[inside]
        self.token_ids[rows, positions] = values

    def set_token(self, state: CachedRequestState, output_index: int, token_id: int) -> None:
        """Replace the placeholder at ``output_index`` with the token sampled there."""
        state.output_token_ids[output_index] = token_id
        position = state.num_prompt_tokens + output_index
        if position < self.max_model_len:
            self.token_ids[state.row, position] = token_id

    def write_tokens(self, state: CachedRequestState, start: int, token_ids: list[int]) -> None:
        """The request's tokens at positions ``start, start+1, ...``, learnt elsewhere (a
        pipeline stage before the last gets the last stage's samples from the
        scheduler): known positions are overwritten, the next ones appended."""
        for position, token_id in enumerate(token_ids, start):
            if position < state.num_prompt_tokens:
                continue  # prompt tokens never change
            index = position - state.num_prompt_tokens
            if index < len(state.output_token_ids):
                self.set_token(state, index, token_id)
            elif index == len(state.output_token_ids):
                self.append_token(state, token_id)
            else:
                raise RuntimeError(f"request {state.req_id}: token at position {position} arrived before the "
                                   f"{state.num_tokens} earlier ones")  # fmt: skip

    def remove(self, req_id: str) -> CachedRequestState | None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
            self.version += 1
            self.num_prompt_logprobs -= _wants_prompt_logprobs(state)
        return state
