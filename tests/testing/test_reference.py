"""kvloom.testing.reference: the float64 reference against a naive per-token loop on fresh
random paged data, and the paged batches it builds (layout, padding, expected cache)."""

from __future__ import annotations

import math

import pytest
import torch

from kvloom.attention.backend import CommonAttentionMetadata
from kvloom.testing.reference import (
    check_paged_case,
    make_paged_case,
    reference_attention,
    relative_error,
    run_paged_case,
)
from tests.helpers.reference_backend import ReferenceBackend


def naive_attention(query, key_cache, value_cache, block_table, query_lens, seq_lens, scale) -> torch.Tensor:
    """One query token and head at a time, in Python floats over float64 values."""
    block_size = key_cache.shape[1]
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    out = torch.zeros(sum(query_lens), num_heads, query.shape[2], dtype=torch.float64)
    token = 0
    for r, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        for j in range(q_len):
            position = seq_len - q_len + j
            for h in range(num_heads):
                kv = h // (num_heads // num_kv_heads)
                q = query[token, h].double()
                where = [(block_table[r][p // block_size], p % block_size) for p in range(position + 1)]
                keys = [key_cache[b, o, kv].double() for b, o in where]
                values = [value_cache[b, o, kv].double() for b, o in where]
                scores = [float(q @ k) * scale for k in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                out[token, h] = sum(w * v for w, v in zip(weights, values)) / sum(weights)
            token += 1
    return out


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_a_naive_per_token_loop(num_heads: int, num_kv_heads: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    block_size, head_size, num_blocks = 4, 8, 12
    query_lens, seq_lens = [3, 1, 5], [7, 6, 5]  # chunk over a prefix, decode, fresh prompt
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    query = torch.randn(sum(query_lens) + 2, num_heads, head_size, generator=gen)  # 2 padding rows
    block_table = torch.randperm(num_blocks, generator=gen)[:6].view(3, 2).to(torch.int32)
    starts = torch.tensor([0, 3, 4, 9, 10], dtype=torch.int32)  # + one filler request past the real tokens
    lens = torch.tensor([*seq_lens, 1], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts, seq_lens=lens, block_table=torch.cat([block_table, block_table[:1] * 0]),
        slot_mapping=torch.zeros(11, dtype=torch.int64), num_reqs=4, num_actual_tokens=9, max_query_len=5,
        max_seq_len=7, query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )
    scale = 0.3
    ref = reference_attention(query, key_cache, value_cache, common, scale)
    expected = naive_attention(query, key_cache, value_cache, block_table.tolist(), query_lens, seq_lens, scale)
    assert ref.dtype == torch.float64 and ref.shape == (9, num_heads, head_size)
    torch.testing.assert_close(ref, expected, rtol=1e-12, atol=1e-12)


def test_relative_error() -> None:
    ref = torch.ones(4, dtype=torch.float64)
    assert relative_error(ref.float(), ref) == 0.0
    assert relative_error(torch.tensor([1.0, 1.0, 1.0, 3.0]), ref) == pytest.approx(1.0)
    assert relative_error(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) == float("inf")


@pytest.mark.parametrize("fill", ["nan", "zeros", "random"])
def test_paged_case_layout(fill: str) -> None:
    case = make_paged_case(
        ReferenceBackend, [3, 1, 6], [10, 17, 6], num_heads=4, num_kv_heads=2, head_size=8, block_size=4,
        dtype=torch.float32, seed=5, pad_tokens=2, pad_reqs=3, fill=fill,
    )
    common = case.common
    assert common.num_actual_tokens == 10 and common.num_reqs == 6 and case.query.shape == (15, 4, 8)
    assert common.query_start_loc_cpu.tolist() == [0, 3, 4, 10, 11, 12, 13]
    assert common.seq_lens_cpu.tolist() == [10, 17, 6, 1, 1, 1]
    # One fused QKV tensor, as models pass it.
    assert case.key.data_ptr() == case.query.data_ptr() + 4 * 8 * 4 and case.query.stride(0) == (4 + 2 * 2) * 8
    # Slots: the real tokens' from the block table, -1 for fillers and padding rows.
    assert common.slot_mapping[10:].tolist() == [-1] * 5
    table = common.block_table
    assert (table[3:] == 0).all() and int(table.max()) < case.cache.num_blocks
    blocks = [table[r, : -(-s // 4)].tolist() for r, s in enumerate([10, 17, 6])]
    assert len({b for row in blocks for b in row}) == 3 + 5 + 2  # each request on its own blocks
    assert int(common.slot_mapping[3]) == blocks[1][16 // 4] * 4 + 16 % 4
    # The expected cache holds the new tokens at their slots; the backend's starts without them.
    flat_k = case.cache.expected_key_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[case.written_slots], case.key[:10])
    assert "key cache: 10 slot(s) of real tokens hold wrong values" in case.cache_problems()[0]
    # Context positions hold data; the slots no request owns hold the fill.
    owned = torch.cat([r.slots(0, r.seq_len, 4) for r in case.requests])
    assert torch.isfinite(flat_k[owned]).all() and torch.isfinite(case.expected_output).all()
    spare = torch.ones(flat_k.shape[0], dtype=torch.bool)
    spare[owned] = False
    assert {"nan": lambda t: t.isnan().all(), "zeros": lambda t: (t == 0).all(),
            "random": lambda t: torch.isfinite(t).all() and t.abs().mean() > 2}[fill](flat_k[spare])


def test_a_correct_backend_passes_and_mistakes_are_caught() -> None:
    def case():
        return make_paged_case(
            ReferenceBackend, [4, 1, 1], [9, 30, 2], num_heads=4, num_kv_heads=1, head_size=16, block_size=8,
            dtype=torch.bfloat16, seed=3, pad_tokens=3, scale=0.2,
        )

    good = case()
    run = run_paged_case(good)
    check = check_paged_case(good, run)
    assert not check.problems and check.cache_ok and len(check.request_errors) == 3
    assert check.rel_error < 1e-2 and run.returned is run.output

    # A slot that no real token maps to changed (as when padding rows are written).
    bad = case()
    run = run_paged_case(bad)
    spare = next(s for s in range(bad.cache.num_blocks * 8) if s not in set(bad.written_slots.tolist()))
    ReferenceBackend.split_kv_cache(bad.kv_cache)[0].view(-1, 1, 16)[spare] = 1.0
    check = check_paged_case(bad, run)
    assert not check.cache_ok and "key cache: 1 slot(s) changed that no real token maps to" in check.problems[0]

    # A request's output rows left as they were (NaN).
    skipped = case()
    run = run_paged_case(skipped)
    run.output[4] = float("nan")
    check = check_paged_case(skipped, run)
    assert check.rel_error == float("inf") and "not fully written" in check.problems[-1]
