"""Random paged-attention batches and a float64 reference, for tests and benchmarks.

Backend-agnostic: the cache is shaped by ``backend.get_kv_cache_shape`` and filled through
``backend.split_kv_cache``, so the same case checks any backend through its builder and
impl. The cache starts as NaN everywhere except the context positions the batch owns, and
the block table scatters each request over shuffled physical blocks: a kernel that reads a
wrong slot, or a position past a sequence's end, produces NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    CommonAttentionMetadata,
)


@dataclass
class PagedCase:
    """One step's inputs, the cache before the step, and what a correct step produces."""

    query: torch.Tensor  # [N, Hq, D]
    key: torch.Tensor  # [N, Hkv, D]
    value: torch.Tensor  # [N, Hkv, D]
    kv_cache: torch.Tensor  # backend layout; the impl writes into it
    common: CommonAttentionMetadata
    spec: AttentionLayerSpec
    expected_output: torch.Tensor  # float64 [num_actual_tokens, Hq, D]
    expected_key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], after the write
    expected_value_cache: torch.Tensor

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf if out has a non-finite value)."""
    out64 = out.to(torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    ref64 = ref.to(device=out64.device, dtype=torch.float64)
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))


def reference_attention(
    query: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    query_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention in float64. ``keys[r]``/``values[r]``: request r's whole
    sequence ``[seq_len, Hkv, D]``; its queries are the last ``query_lens[r]`` positions."""
    num_heads = query.shape[1]
    outputs = []
    start = 0
    for k, v, q_len in zip(keys, values, query_lens):
        q = query[start : start + q_len].to(torch.float64)
        start += q_len
        group = num_heads // k.shape[1]
        k64 = k.to(torch.float64).repeat_interleave(group, dim=1)  # [S, Hq, D]
        v64 = v.to(torch.float64).repeat_interleave(group, dim=1)
        seq_len = k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k64) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        scores = scores.masked_fill((k_pos > q_pos).to(scores.device), float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v64))
    return torch.cat(outputs, dim=0)


def make_paged_case(
    backend: type[AttentionBackend],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    pad_tokens: int = 0,
    pad_reqs: int = 0,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    extra_blocks: int = 2,
    extra: dict | None = None,
) -> PagedCase:
    """A step of ``len(query_lens)`` requests; request r has ``seq_lens[r] - query_lens[r]``
    cached positions and ``query_lens[r]`` new tokens.

    ``pad_tokens``: extra tokens after the real ones with slot -1 (CUDA-graph token
    padding). ``pad_reqs``: extra one-token requests the way the runner pads a decode batch
    for a graph (seq_len 1, block-table row 0, slot -1); both are excluded from
    ``num_actual_tokens`` and the expected output.
    """
    if len(query_lens) != len(seq_lens):
        raise ValueError("query_lens and seq_lens must have the same length")
    if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens)):
        raise ValueError("each request needs 1 <= query_len <= seq_len")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + extra_blocks
    max_blocks = max(blocks_per_req)
    physical = torch.randperm(num_blocks, generator=gen)
    # Unused table entries point at a NaN block: reading past a sequence shows up.
    unused_block = int(physical[-1])
    block_table = torch.full((len(seq_lens) + pad_reqs, max_blocks), unused_block, dtype=torch.int32)
    block_table[len(seq_lens) :] = 0  # graph-padding requests use block-table row 0
    next_block = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = physical[next_block : next_block + n]
        next_block += n

    kv_cache = torch.full(
        backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype
    )
    key_cache, value_cache = backend.split_kv_cache(kv_cache)

    seq_keys, seq_values, slots = [], [], []
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        k_all, v_all = rand(s_len, num_kv_heads, head_size), rand(s_len, num_kv_heads, head_size)
        seq_keys.append(k_all)
        seq_values.append(v_all)
        pos = torch.arange(s_len)
        blocks = block_table[r, pos // block_size].long()
        offsets = pos % block_size
        context = s_len - q_len
        key_cache[blocks[:context], offsets[:context]] = k_all[:context]
        value_cache[blocks[:context], offsets[:context]] = v_all[:context]
        slots.append(blocks[context:] * block_size + offsets[context:])

    num_actual = sum(query_lens)
    num_tokens = num_actual + pad_reqs + pad_tokens
    query = rand(num_tokens, num_heads, head_size)
    key = torch.cat([k[-q:] for k, q in zip(seq_keys, query_lens)] + [rand(num_tokens - num_actual, num_kv_heads, head_size)])
    value = torch.cat(
        [v[-q:] for v, q in zip(seq_values, query_lens)] + [rand(num_tokens - num_actual, num_kv_heads, head_size)]
    )
    slot_mapping = torch.cat(slots + [torch.full((num_tokens - num_actual,), -1, dtype=torch.long)])

    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()
    real_slots = slot_mapping[:num_actual]
    expected_key_cache.view(-1, num_kv_heads, head_size)[real_slots] = key[:num_actual]
    expected_value_cache.view(-1, num_kv_heads, head_size)[real_slots] = value[:num_actual]

    scale = head_size**-0.5
    expected = reference_attention(query[:num_actual], seq_keys, seq_values, query_lens, scale)

    all_query_lens = list(query_lens) + [1] * pad_reqs
    all_seq_lens = list(seq_lens) + [1] * pad_reqs
    query_start_loc = torch.zeros(len(all_query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(all_query_lens).cumsum(0)
    seq_lens_t = torch.tensor(all_seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device),
        num_reqs=len(all_query_lens),
        num_actual_tokens=num_actual,
        max_query_len=max(all_query_lens),
        max_seq_len=max(all_seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    spec = AttentionLayerSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        kv_cache_dtype=dtype,
        block_size=block_size,
        max_num_seqs=max_num_seqs or len(all_query_lens),
        max_model_len=max_model_len or max(all_seq_lens),
        scale=scale,
        extra=dict(extra or {}),
    )
    return PagedCase(
        query=query.to(device),
        key=key.to(device),
        value=value.to(device),
        kv_cache=kv_cache.to(device),
        common=common,
        spec=spec,
        expected_output=expected,
        expected_key_cache=expected_key_cache,
        expected_value_cache=expected_value_cache,
    )


def run_case(
    backend: type[AttentionBackend], case: PagedCase, for_cudagraph: bool = False
) -> tuple[torch.Tensor, Any]:
    """Build metadata and run the backend's impl once on a NaN-poisoned output;
    returns the output and the metadata."""
    spec = case.spec
    builder = backend.get_builder_cls()(spec, case.query.device, case.common.block_table.shape[1])
    impl = backend.get_impl_cls()(
        num_heads=spec.num_heads, head_size=spec.head_size, scale=spec.scale, num_kv_heads=spec.num_kv_heads
    )
    metadata = builder.build_for_cudagraph_capture(case.common) if for_cudagraph else builder.build(case.common)
    output = torch.full_like(case.query, float("nan"))
    impl.forward(case.query, case.key, case.value, case.kv_cache, metadata, output)
    return output, metadata


def check_case(backend: type[AttentionBackend], case: PagedCase, output: torch.Tensor) -> dict[str, float | bool]:
    """Relative error of the real tokens' output and whether the cache write was exact
    (new slots hold the new K/V, every other slot untouched, padding slots skipped)."""
    key_cache, value_cache = backend.split_kv_cache(case.kv_cache)
    cache_ok = bool(
        torch.equal(key_cache.cpu().nan_to_num(1234.5), case.expected_key_cache.nan_to_num(1234.5))
        and torch.equal(value_cache.cpu().nan_to_num(1234.5), case.expected_value_cache.nan_to_num(1234.5))
    )
    return {
        "rel_error": relative_error(output[: case.num_actual_tokens].cpu(), case.expected_output),
        "cache_ok": cache_ok,
    }
