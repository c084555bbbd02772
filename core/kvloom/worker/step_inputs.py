"""A step's inputs: the persistent host and device buffers and how a step fills them.

``StepInputs.prepare`` flattens the scheduled tokens of all requests into one batch: input
ids, positions, slot mapping, ``query_start_loc``, ``seq_lens``, block table and the rows
whose logits are sampled. Each buffer has a host staging twin (pinned on CUDA) and goes
to the device in one copy per step, asynchronously from pinned memory.

The device buffers are allocated once and never reallocated: CUDA graphs (piecewise and
full decode, ``kvloom.worker.cudagraph``) read them at fixed addresses, and every
metadata object of a step is a view of their first rows (``common_metadata``).

KV-cache groups (hybrid models): every group has its own block table and slot mapping
(``GroupTables``); the rest is shared. ``common_metadata`` describes the first group, and
``group_metadata`` the same step for each group (what each group's metadata builder
reads). Padding and dummy batches fill every group's tables alike.

Async scheduling: a step may be prepared while the previous one still runs. Its input
tokens sampled by that step are not on the host yet (the input batch holds a placeholder,
-1); ``prepare`` copies them on the device from the previous step's sampled tensor
(``record_sampled``). The pinned staging buffers are refilled only once the previous
step's copies out of them ran (``mark_copied`` records that point).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvloom.attention.backend import CommonAttentionMetadata
from kvloom.scheduler.output import SchedulerOutput
from kvloom.utils import cdiv
from kvloom.worker.input_batch import CachedRequestState, InputBatch


@dataclass
class StepBatch:
    """The flattened inputs of one step (host side) plus what postprocessing needs."""

    req_ids: list[str]
    states: list[CachedRequestState]
    num_tokens: int
    query_lens: np.ndarray  # [B]
    seq_lens: np.ndarray  # [B]
    logits_indices: np.ndarray  # [B]: index of each request's last scheduled token
    uniform_decode: bool
    rows: np.ndarray  # [B]: each request's row in the input batch
    #: Whether some request of the step wants prompt logprobs.
    any_prompt_logprobs: bool = False
    #: Scheduled requests left out of the step because their own work failed.
    failed_req_ids: list[str] = field(default_factory=list)
    #: Speculative decoding: each request's drafts verified in this step (None: no drafts).
    #: Request i then has ``1 + len(drafts[i])`` logits rows, its last tokens.
    drafts: list[list[int]] | None = None
    #: Rows of logits the step computes (``logits_indices``): B, or B + the drafts.
    num_logits: int = 0


@dataclass
class GroupTables:
    """One KV-cache group's step buffers: block table and slot mapping (host + device)."""

    block_table_cpu: torch.Tensor  # [max_num_reqs, max_blocks_per_req], pinned on CUDA
    block_table: torch.Tensor  # the same on the device
    #: A step's block table is its first rows' first columns: not contiguous in either
    #: table. It goes packed (contiguous, from the front of ``block_table_cpu``) into this
    #: staging buffer and is spread into ``block_table`` on the device: copied strided
    #: from the host, torch would stage it in pageable memory first.
    block_table_staging: torch.Tensor
    slot_mapping_cpu: torch.Tensor  # [max_num_tokens]
    slot_mapping: torch.Tensor


class StepInputs:
    """The step's input buffers (host staging + device) and their filling."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        num_kv_cache_groups: int = 1,
        uniform_query_len: int = 1,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        #: A uniform decode batch has this many tokens per request: 1, or 1 + k with
        #: speculative decoding (the full CUDA graphs' batches).
        self.uniform_query_len = uniform_query_len
        self.pin_memory = pin = device.type == "cuda"

        def host(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        def dev(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        n, b = max_num_tokens, max_num_reqs
        self.input_ids_cpu, self.input_ids = host(n, torch.int64), dev(n, dtype=torch.int64)
        self.positions_cpu, self.positions = host(n, torch.int64), dev(n, dtype=torch.int64)
        self.query_start_loc_cpu, self.query_start_loc = host(b + 1, torch.int32), dev(b + 1, dtype=torch.int32)
        self.seq_lens_cpu, self.seq_lens = host(b, torch.int32), dev(b, dtype=torch.int32)
        self.groups = [
            GroupTables(
                torch.zeros(b, max_blocks_per_req, dtype=torch.int32, pin_memory=pin),
                dev(b, max_blocks_per_req, dtype=torch.int32),
                dev(b * max_blocks_per_req, dtype=torch.int32),
                host(n, torch.int64),
                dev(n, dtype=torch.int64),
            )
            for _ in range(num_kv_cache_groups)
        ]
        first = self.groups[0]
        self.block_table_cpu, self.block_table = first.block_table_cpu, first.block_table
        self.slot_mapping_cpu, self.slot_mapping = first.slot_mapping_cpu, first.slot_mapping
        # One logits row per request, or with speculation one per verified position.
        num_logits = b if uniform_query_len == 1 else n
        self.logits_indices_cpu, self.logits_indices = host(num_logits, torch.int64), dev(num_logits, dtype=torch.int64)
        # Input tokens still in flight (``_fill_placeholders``): their places in the input
        # and their rows in the previous step's sampled tensor.
        self.placeholder_index_cpu, self.placeholder_index = host(n, torch.int64), dev(n, dtype=torch.int64)
        self.placeholder_src_cpu, self.placeholder_src = host(n, torch.int64), dev(n, dtype=torch.int64)

        self._copied: torch.cuda.Event | None = None
        # The last step's sampled tokens on the device, and the row in them of each
        # input-batch row's request (-1: none).
        self._prev_sampled: torch.Tensor | None = None
        self._prev_sampled_of_row = np.full(max_num_reqs, -1, dtype=np.int64)

    # ------------------------------------------------------------------ a step
    def prepare(
        self, scheduler_output: SchedulerOutput, req_ids: list[str], input_batch: InputBatch
    ) -> tuple[StepBatch, CommonAttentionMetadata]:
        """The step's inputs for ``req_ids`` (the scheduled requests that have not failed)."""
        if self._copied is not None:  # the previous step's host->device copies
            self._copied.synchronize()
            self._copied = None
        requests = input_batch.requests
        states = [requests[r] for r in req_ids]
        b = len(req_ids)
        scheduled = scheduler_output.num_scheduled_tokens
        # req_ids is the scheduler's order less the failed requests: with none left out,
        # the token counts are the dict's values as they stand.
        counts = scheduled.values() if b == len(scheduled) else (scheduled[r] for r in req_ids)
        query_lens = np.fromiter(counts, dtype=np.int64, count=b)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=b)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=b)
        input_ids, cu, seq_lens = self._fill(rows, starts, query_lens, input_batch.block_tables, input_batch.token_ids)
        assert input_ids is not None
        n = int(cu[-1])
        logits_indices = cu[1:] - 1
        drafts = None
        if scheduler_output.scheduled_spec_decode_tokens:
            spec = scheduler_output.scheduled_spec_decode_tokens
            drafts = [spec.get(r, []) for r in req_ids]
            num_drafts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=b)
            # Each request's last 1 + m tokens: the verified positions.
            logits_indices = np.repeat(cu[1:] - num_drafts - 1, num_drafts + 1) + _ranges(num_drafts + 1)
        num_logits = len(logits_indices)
        self.logits_indices_cpu.numpy()[:num_logits] = logits_indices
        self.logits_indices[:num_logits].copy_(self.logits_indices_cpu[:num_logits], non_blocking=self.pin_memory)
        if (placeholders := np.flatnonzero(input_ids < 0)).size:
            self._fill_placeholders(placeholders, np.repeat(np.arange(b), query_lens), req_ids, rows)

        max_query_len = int(query_lens.max())
        common = self.common_metadata(b, n, max_query_len, int(seq_lens.max()))
        batch = StepBatch(
            req_ids=req_ids,
            states=states,
            num_tokens=n,
            query_lens=query_lens,
            seq_lens=seq_lens,
            logits_indices=logits_indices,
            uniform_decode=max_query_len == self.uniform_query_len == int(query_lens.min()),
            rows=rows,
            any_prompt_logprobs=input_batch.num_prompt_logprobs > 0,
            drafts=drafts,
            num_logits=num_logits,
        )
        return batch, common

    def prepare_tokens(
        self, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray, input_ids: np.ndarray, input_batch: InputBatch
    ) -> CommonAttentionMetadata:
        """Inputs of a forward over given tokens (a speculative draft model's): request j
        (input-batch row ``rows[j]``) feeds ``input_ids`` from position ``starts[j]`` on,
        ``query_lens[j]`` of them; the logits rows are each request's last token."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        _, cu, seq_lens = self._fill(rows, starts, query_lens, input_batch.block_tables, None)
        n, b = int(cu[-1]), len(rows)
        self.input_ids_cpu.numpy()[:n] = input_ids
        self.input_ids[:n].copy_(self.input_ids_cpu[:n], non_blocking=self.pin_memory)
        self.logits_indices_cpu.numpy()[:b] = cu[1:] - 1
        self.logits_indices[:b].copy_(self.logits_indices_cpu[:b], non_blocking=self.pin_memory)
        return self.common_metadata(b, n, int(query_lens.max()), int(seq_lens.max()))

    def _fill(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        query_lens: np.ndarray,
        block_tables: list[np.ndarray],
        token_ids: np.ndarray | None,
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """Positions, ``query_start_loc``, ``seq_lens`` and every KV-cache group's slot
        mapping and block table of requests in input-batch ``rows`` computing
        ``query_lens`` tokens from ``starts``, copied to the device (and the input ids from
        ``token_ids``' rows when given): (the input ids or None, ``query_start_loc``,
        ``seq_lens``)."""
        b = len(rows)
        seq_lens = starts + query_lens
        n = int(query_lens.sum())
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        # positions: for each token, its request's start + its index within the request
        token_rows = np.repeat(rows, query_lens)
        positions = np.repeat(starts - cu[:-1], query_lens) + np.arange(n)
        self.positions_cpu.numpy()[:n] = positions
        input_ids = None
        if token_ids is not None:
            input_ids = token_ids[token_rows, positions]
            self.input_ids_cpu.numpy()[:n] = input_ids
        self.query_start_loc_cpu.numpy()[: b + 1] = cu
        self.seq_lens_cpu.numpy()[:b] = seq_lens
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)

        # One host->device copy per buffer (asynchronous from pinned memory on CUDA).
        nb = self.pin_memory
        if input_ids is not None:
            self.input_ids[:n].copy_(self.input_ids_cpu[:n], non_blocking=nb)
        self.positions[:n].copy_(self.positions_cpu[:n], non_blocking=nb)
        self.query_start_loc[: b + 1].copy_(self.query_start_loc_cpu[: b + 1], non_blocking=nb)
        self.seq_lens[:b].copy_(self.seq_lens_cpu[:b], non_blocking=nb)
        offsets = positions % self.block_size
        block_index = positions // self.block_size
        for group, table in zip(self.groups, block_tables):
            blocks = table[token_rows, block_index]
            group.slot_mapping_cpu.numpy()[:n] = blocks.astype(np.int64) * self.block_size + offsets
            packed = group.block_table_cpu.view(-1)[: b * max_blocks].view(b, max_blocks)
            packed.numpy()[:] = table[rows, :max_blocks]
            group.slot_mapping[:n].copy_(group.slot_mapping_cpu[:n], non_blocking=nb)
            staged = group.block_table_staging[: b * max_blocks].view(b, max_blocks)
            staged.copy_(packed, non_blocking=nb)
            group.block_table[:b, :max_blocks].copy_(staged)
        return input_ids, cu, seq_lens

    def mark_copied(self) -> None:
        """Record, behind the step's host->device copies and before its forward, the event
        the next step waits for before it rewrites the pinned staging buffers. Recorded
        after the forward instead, it would make the next step's input preparation wait
        for this whole step on the device, undoing async scheduling's overlap."""
        if self.pin_memory:
            self._copied = torch.cuda.Event()
            self._copied.record()

    # ------------------------------------------------------------------ tokens in flight
    def record_sampled(self, sampled: torch.Tensor, rows: np.ndarray, sample_rows: list[int]) -> None:
        """The step just sampled ``sampled`` on the device; the request in input-batch row
        ``rows[j]`` finds its token at ``sampled[sample_rows[j]]`` (after ``forget_sampled``
        of the step before)."""
        self._prev_sampled = sampled
        self._prev_sampled_of_row[rows] = sample_rows

    def in_flight_tokens(self, states: list[CachedRequestState]) -> tuple[list[int], torch.Tensor] | None:
        """The newest token of each of ``states`` that is still in flight (its outputs end
        in the placeholder -1): (indices into ``states``, the tokens on the device, from the
        last step's sampled tensor); None when none is. Call before ``forget_sampled``.

        The indices go to the device from pageable memory without waiting for the stream
        (as the sampling tensors do): the pinned staging buffers may still feed a copy of
        the step in flight."""
        held = [j for j, s in enumerate(states) if s.output_token_ids and s.output_token_ids[-1] < 0]
        if not held:
            return None
        src = self._prev_sampled_of_row[[states[j].row for j in held]]
        if (missing := np.flatnonzero(src < 0)).size:
            req_id = states[held[int(missing[0])]].req_id
            raise RuntimeError(f"request {req_id} has an output token that no step in flight samples")
        assert self._prev_sampled is not None
        return held, self._prev_sampled[torch.from_numpy(src).to(self.device, non_blocking=True)]

    def forget_sampled(self) -> None:
        """No step in flight samples tokens the next step reads."""
        self._prev_sampled = None
        self._prev_sampled_of_row.fill(-1)

    def _fill_placeholders(
        self, token_index: np.ndarray, req_of_token: np.ndarray, req_ids: list[str], rows: np.ndarray
    ) -> None:
        """Input tokens sampled by the step still in flight: copy them on the device.
        ``token_index``: their places in the input; ``req_of_token``: each input token's
        request (an index into ``req_ids`` and their input-batch ``rows``).

        The indices go through the pinned staging buffers like the other inputs: a
        blocking host->device copy (``torch.tensor(..., device=...)``) would wait for the
        whole stream, i.e. for the step in flight, and undo async scheduling's overlap."""
        req_index = req_of_token[token_index]
        src = self._prev_sampled_of_row[rows[req_index]]
        if (missing := np.flatnonzero(src < 0)).size:
            req_id = req_ids[int(req_index[missing[0]])]
            raise RuntimeError(f"request {req_id} has an input token that no step in flight samples")
        assert self._prev_sampled is not None
        k, nb = len(src), self.pin_memory
        self.placeholder_index_cpu.numpy()[:k] = token_index
        self.placeholder_src_cpu.numpy()[:k] = src
        dst = self.placeholder_index[:k]
        dst.copy_(self.placeholder_index_cpu[:k], non_blocking=nb)
        self.placeholder_src[:k].copy_(self.placeholder_src_cpu[:k], non_blocking=nb)
        self.input_ids[dst] = self._prev_sampled[self.placeholder_src[:k]]

    # ------------------------------------------------------------------ padding and warm-up
    def dummy_metadata(self, query_lens: np.ndarray, max_model_len: int | None = None) -> CommonAttentionMetadata:
        """Metadata for padding/warm-up requests of ``query_lens`` tokens: block-table rows
        0, no KV writes; input ids zero, positions counting up (modulo ``max_model_len``
        when given, else zero)."""
        b = len(query_lens)
        n = int(query_lens.sum())
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        self.query_start_loc_cpu.numpy()[: b + 1] = cu
        self.seq_lens_cpu.numpy()[:b] = query_lens
        self.logits_indices_cpu.numpy()[:b] = cu[1:] - 1
        self.query_start_loc[: b + 1].copy_(self.query_start_loc_cpu[: b + 1])
        self.seq_lens[:b].copy_(self.seq_lens_cpu[:b])
        self.logits_indices[:b].copy_(self.logits_indices_cpu[:b])
        for group in self.groups:
            group.block_table[:b].zero_()
            group.slot_mapping[:n].fill_(-1)
        self.input_ids[:n].zero_()
        if max_model_len is None:
            self.positions[:n].zero_()
        else:
            self.positions[:n].copy_(torch.arange(n, device=self.device) % max_model_len)
        return self.common_metadata(b, n, int(query_lens.max()), int(query_lens.max()))

    def pad_decode(self, b: int, size: int) -> CommonAttentionMetadata:
        """Pad a uniform decode batch of ``b`` requests of ``uniform_query_len`` (q) tokens
        each (already prepared) to ``size`` tokens with dummy requests (q tokens, seq_len q,
        block-table row 0, slot -1): a full decode graph of that size reads them."""
        q = self.uniform_query_len
        n, num_reqs = b * q, size // q
        if size > n:
            qsl = self.query_start_loc_cpu.numpy()
            qsl[b + 1 : num_reqs + 1] = np.arange(b + 1, num_reqs + 1) * q
            self.seq_lens_cpu.numpy()[b:num_reqs] = q
            self.input_ids_cpu.numpy()[n:size] = 0
            self.positions_cpu.numpy()[n:size] = np.tile(np.arange(q), num_reqs - b)
            self.query_start_loc[b + 1 : num_reqs + 1].copy_(self.query_start_loc_cpu[b + 1 : num_reqs + 1],
                                                              non_blocking=True)  # fmt: skip
            self.seq_lens[b:num_reqs].copy_(self.seq_lens_cpu[b:num_reqs], non_blocking=True)
            self.input_ids[n:size].copy_(self.input_ids_cpu[n:size], non_blocking=True)
            self.positions[n:size].copy_(self.positions_cpu[n:size], non_blocking=True)
            for group in self.groups:  # every group's rows of the fillers
                group.slot_mapping_cpu.numpy()[n:size] = -1
                group.block_table_cpu[b:num_reqs].zero_()
                group.slot_mapping[n:size].copy_(group.slot_mapping_cpu[n:size], non_blocking=True)
                group.block_table[b:num_reqs].copy_(group.block_table_cpu[b:num_reqs], non_blocking=True)
        return self.common_metadata(num_reqs, size, q, int(self.seq_lens_cpu[:num_reqs].max()))

    def zero_padding(self, n: int, padded: int) -> None:
        """Rows ``n..padded`` of the token inputs are padding (a graph's capture size)."""
        if padded > n:
            self.input_ids[n:padded].zero_()
            self.positions[n:padded].zero_()

    def group_metadata(self, common: CommonAttentionMetadata) -> list[CommonAttentionMetadata]:
        """``common`` (made by this object: the first group's) for every KV-cache group:
        the same step over each group's block table and slot mapping."""
        b, n = common.num_reqs, common.slot_mapping.shape[0]
        return [common] + [
            replace(common, block_table=group.block_table[:b], slot_mapping=group.slot_mapping[:n])
            for group in self.groups[1:]
        ]

    def common_metadata(self, b: int, n: int, max_query_len: int, max_seq_len: int) -> CommonAttentionMetadata:
        """The step's metadata as views of the persistent buffers (first ``b`` requests,
        ``n`` tokens), which the caller has filled."""
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[:n],
            num_reqs=b,
            num_actual_tokens=n,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=self.query_start_loc_cpu[: b + 1],
            seq_lens_cpu=self.seq_lens_cpu[:b],
        )


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """``0..l-1`` for each length ``l``, concatenated."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
