"""Per-step metadata of CPU_ATTN and its builder.

The builder plans a step once on the host; every layer reuses the plan:

- KV write: the slots of the step's keys/values (``-1`` slots, the padding, are dropped).
- Decode requests (query_len == 1), in a few groups of similar length
  (``DecodeBatch``): for each, the requests' block tables and positions (what the decode
  kernel reads in place) and, planned when a layer first asks, the cache rows to gather
  into a padded ``[B, Hkv, L, D]`` workspace, ordered for SDPA, and a key mask that hides
  the padding past each request's ``seq_len``.
- Prefill requests (query_len > 1), one ``PrefillRequest`` each: with context
  (prefix-cache hits, earlier chunks), its blocks and a causal mask shifted by the
  context length.

With a sliding window (``spec.sliding_window``, a KV-cache group's) each request's
gather starts at the block holding the first position its first query sees, so a long
request reads about a window, and blocks given back to the pool (the null block, or ids
reused by other requests) are never read; the masks hide the positions before each
query's window.

The builder also owns the ``Workspace`` that every layer gathers K/V into.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvloom.interfaces import AttentionLayerSpec, AttentionMetadataBuilder, CommonAttentionMetadata, window_start
from kvloom_backend_cpu import kernels

#: Decode requests are split into at most this many length groups, each at least this big.
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8


class Workspace:
    """A grow-only scratch buffer shared by all layers of a step.

    Layers run one after another, so one buffer serves every layer's K/V gather. Reusing
    it matters on the CPU: a fresh multi-megabyte tensor per layer costs page faults
    that can exceed the attention math itself.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffer
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            # Grow with headroom: decode contexts grow one token per step.
            capacity = max(numel, int(buffer.numel() * 1.25) if buffer is not None and buffer.dtype == dtype else 0)
            buffer = torch.empty(capacity, dtype=dtype, device=self.device)
            self._buffer = buffer
        return buffer[:numel].view(shape)


@dataclass
class DecodeBatch:
    """Requests with query_len == 1, attended in one batched call.

    The decode kernel reads the requests' blocks in place (``block_table`` and the
    positions); the SDPA path gathers them into a padded ``[B, Hkv, L, D]`` workspace
    (``kv_rows``, ``key_mask``, ``pad_rows``: planned on first use, so a step whose layers
    all run the kernel never plans a gather)."""

    num_reqs: int
    #: Token rows of the decode queries; ``None`` when they are the contiguous rows
    #: ``token_start : token_start + num_reqs`` (the common case; avoids a gather).
    token_rows: torch.Tensor | None
    token_start: int
    num_kv_heads: int
    block_size: int
    #: int64, contiguous: ``[num_reqs, blocks]`` block ids from each request's first needed
    #: block on (its window's first block under a sliding window; entries past its last
    #: block read block 0), the first position of that block, the first position each
    #: query sees (its window's start) and the sequence lengths (``[num_reqs]`` each).
    block_table: torch.Tensor
    first_pos: torch.Tensor
    key_start: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def padded_len(self) -> int:
        """Key positions gathered per request (the longest decode sequence, or window,
        rounded up to whole blocks)."""
        return self.block_table.shape[1] * self.block_size

    @functools.cached_property
    def kernel_args(self) -> kernels.BatchArgs:
        """The decode kernel's struct of the requests (made by the first layer that asks)."""
        return kernels.batch_args(self.token_start, self.token_rows, self.block_table, self.first_pos, self.key_start,
                                  self.seq_lens)  # fmt: skip

    @property
    def kv_rows(self) -> torch.Tensor:
        """int64 ``[num_reqs * num_kv_heads * padded_len]``: rows of the cache viewed as
        ``[slots * num_kv_heads, head_size]``, ordered (request, kv head, position), so the
        gather lands directly in the ``[B, Hkv, L, D]`` layout SDPA reads fastest."""
        return self._gather_plan[0]

    @property
    def key_mask(self) -> torch.Tensor:
        """bool ``[num_reqs, 1, 1, padded_len]``: True = the key position is in the
        request's sequence (and window)."""
        return self._gather_plan[1]

    @property
    def pad_rows(self) -> torch.Tensor:
        """int64: the gathered rows (indices into ``kv_rows``) outside each request's
        sequence or window. The cache is not zero-filled, so they may hold NaN; the mask
        alone would not hide it (NaN + -inf and 0 * NaN are NaN), so they are zeroed after
        the gather."""
        return self._gather_plan[2]

    @functools.cached_property
    def _gather_plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size, kv_heads, num = self.block_size, self.num_kv_heads, self.num_reqs
        offsets = torch.arange(self.padded_len)
        slots = self.block_table[:, offsets // size] * size + offsets % size  # [B, L]
        kv_rows = slots[:, None, :] * kv_heads + torch.arange(kv_heads)[None, :, None]
        positions = self.first_pos[:, None] + offsets[None, :]  # [B, L]
        valid = (positions < self.seq_lens[:, None]) & (positions >= self.key_start[:, None])
        pad_rows = (~valid)[:, None, :].expand(num, kv_heads, -1).reshape(-1).nonzero().squeeze(1)
        return kv_rows.reshape(-1), valid.view(num, 1, 1, -1), pad_rows


@dataclass
class PrefillRequest:
    """One request with query_len > 1."""

    token_start: int
    token_end: int
    context_len: int
    seq_len: int
    #: int64 block ids of positions ``key_start .. seq_len`` when ``context_len > 0``, else
    #: ``None`` (no context: attention runs on the step's own keys and values).
    block_ids: torch.Tensor | None
    #: bool ``[query_len, seq_len - key_start]``: the causal mask shifted by the context (and
    #: the window); None for a plain causal prefill without context or window.
    mask: torch.Tensor | None
    #: First key position the gathered blocks hold (0 without a window).
    key_start: int = 0


@dataclass
class CPUAttentionMetadata:
    num_actual_tokens: int
    block_size: int
    #: int64 slots to write; the matching token rows are ``write_rows`` or, when that is
    #: ``None``, the first ``len(write_slots)`` rows.
    write_slots: torch.Tensor
    write_rows: torch.Tensor | None
    #: Decode requests in groups of similar length (usually one group).
    decodes: list[DecodeBatch]
    prefills: list[PrefillRequest]
    #: The builder's scratch buffer for K/V gathers (shared by all layers).
    workspace: Workspace


class CPUAttentionMetadataBuilder(AttentionMetadataBuilder[CPUAttentionMetadata]):
    """Plans each step once for all layers; owns the workspace they gather K/V into."""

    def __init__(self, spec: AttentionLayerSpec, device: torch.device, max_num_blocks: int) -> None:
        super().__init__(spec, device, max_num_blocks)
        self.workspace = Workspace(device)

    def build(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        block_size = self.spec.block_size
        num_actual = common.num_actual_tokens
        num_reqs = common.num_reqs

        slots = common.slot_mapping[:num_actual].to(torch.int64)
        writable = slots >= 0
        if bool(writable.all()):
            write_rows = None
        else:
            write_rows = writable.nonzero().squeeze(1)
            slots = slots[write_rows]

        starts = common.query_start_loc_cpu[: num_reqs + 1].to(torch.int64)
        query_lens = starts[1:] - starts[:-1]
        seq_lens = common.seq_lens_cpu[:num_reqs].to(torch.int64)
        # Requests past num_actual_tokens are CUDA-graph padding: nothing to compute.
        real = starts[1:] <= num_actual
        decode_idx = ((query_lens == 1) & real).nonzero().squeeze(1)
        prefill_idx = ((query_lens > 1) & real).nonzero().squeeze(1)

        decodes = [
            self._plan_decode(common, group, starts, seq_lens)
            for group in self._group_decodes(decode_idx, seq_lens)
        ]
        prefills = [
            self._plan_prefill(common, i, int(starts[i]), int(starts[i + 1]), int(seq_lens[i]))
            for i in prefill_idx.tolist()
        ]
        return CPUAttentionMetadata(
            num_actual_tokens=num_actual,
            block_size=block_size,
            write_slots=slots,
            write_rows=write_rows,
            decodes=decodes,
            prefills=prefills,
            workspace=self.workspace,
        )

    def _group_decodes(self, req_idx: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
        """Split the decode requests into a few groups of similar length.

        One batched call pads every request to the longest sequence; with lengths spread
        out (continuous batching) most of that work is padding. Sorting by length and
        splitting into up to ``MAX_DECODE_GROUPS`` equal-count groups bounds the waste;
        a split is kept only when it cuts the padded positions by >= 10%, because every
        group costs one more gather + SDPA call per layer.
        """
        num = req_idx.numel()
        if num == 0:
            return []
        block_size = self.spec.block_size
        req_lens = seq_lens[req_idx]
        # Gathered lengths: from the block of each request's window start on.
        gathered = req_lens - self._window_start(req_lens - 1) // block_size * block_size
        lens, order = torch.sort(gathered, descending=True)
        padded_lens = ((lens + block_size - 1) // block_size * block_size).tolist()

        def padded_work(bounds: list[int]) -> int:
            return sum((b - a) * padded_lens[a] for a, b in zip(bounds[:-1], bounds[1:]))

        best = [0, num]
        for groups in range(2, MAX_DECODE_GROUPS + 1):
            if num // groups < MIN_DECODE_GROUP:
                break
            bounds = [round(i * num / groups) for i in range(groups + 1)]
            if padded_work(bounds) > 0.9 * padded_work(best):
                break
            best = bounds
        if len(best) == 2:
            return [req_idx]  # keep the batch order: decode rows are often contiguous
        ordered = req_idx[order]
        return [ordered[a:b].sort().values for a, b in zip(best[:-1], best[1:])]

    def _plan_decode(
        self,
        common: CommonAttentionMetadata,
        req_idx: torch.Tensor,
        starts: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> DecodeBatch:
        block_size = self.spec.block_size
        num = req_idx.numel()
        rows = starts[req_idx]
        token_start = int(rows[0])
        contiguous = bool((rows == torch.arange(token_start, token_start + num)).all())
        dec_seq_lens = seq_lens[req_idx]
        if bool((dec_seq_lens < 1).any()):
            raise ValueError(f"seq_lens: decode requests need seq_lens >= 1, got {dec_seq_lens.tolist()}")
        # The query (position seq_len - 1) sees positions from window_start on.
        window_start = self._window_start(dec_seq_lens - 1)
        first_block = window_start // block_size
        blocks_needed = (dec_seq_lens + block_size - 1) // block_size - first_block
        blocks_per_req = int(blocks_needed.max())
        columns = first_block[:, None] + torch.arange(blocks_per_req)[None, :]  # [B, blocks_per_req]
        width = common.block_table.shape[1]
        table = common.block_table.index_select(0, req_idx.to(common.block_table.device)).to(torch.int64)
        table = table.gather(1, columns.clamp(max=width - 1).to(table.device)).cpu()
        # Entries past a request's last block may hold anything: point them at block 0
        # (always a valid index); the key mask hides what they contain.
        in_use = torch.arange(blocks_per_req)[None, :] < blocks_needed[:, None]
        table = torch.where(in_use, table, torch.zeros_like(table))
        return DecodeBatch(
            num_reqs=num,
            token_rows=None if contiguous else rows,
            token_start=token_start,
            num_kv_heads=self.spec.num_kv_heads,
            block_size=block_size,
            block_table=table.contiguous(),
            first_pos=(first_block * block_size).contiguous(),
            key_start=window_start.contiguous(),
            seq_lens=dec_seq_lens.contiguous(),
        )

    def _plan_prefill(
        self, common: CommonAttentionMetadata, req: int, start: int, end: int, seq_len: int
    ) -> PrefillRequest:
        query_len = end - start
        context_len = seq_len - query_len
        if context_len < 0:
            raise ValueError(
                f"request {req}: seq_lens ({seq_len}) must be >= its query length ({query_len})"
            )
        block_size = self.spec.block_size
        key_start = 0
        block_ids = mask = None
        if context_len > 0:
            first_block = int(self._window_start(torch.tensor(context_len))) // block_size
            key_start = first_block * block_size
            num_blocks = -(-seq_len // block_size)
            block_ids = common.block_table[req, first_block:num_blocks].to(torch.int64)
        if context_len > 0 or self.spec.sliding_window is not None:
            # Query j sits at position context_len + j and sees keys at positions <= it
            # (and inside its window).
            q_pos = torch.arange(context_len, seq_len)[:, None]
            k_pos = torch.arange(key_start, seq_len)[None, :]
            mask = k_pos <= q_pos
            if self.spec.sliding_window is not None:
                mask &= k_pos > q_pos - self.spec.sliding_window
        return PrefillRequest(start, end, context_len, seq_len, block_ids, mask, key_start)

    def _window_start(self, query_positions: torch.Tensor) -> torch.Tensor:
        """The first position each query position sees (0 without a sliding window)."""
        return window_start(query_positions, self.spec.sliding_window)
