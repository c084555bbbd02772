"""kvloom.testing.reference: the float64 reference against a naive per-token loop on fresh
random paged data, and the paged batches it builds (layout, padding, expected cache)."""

from __future__ import annotations

import math

import pytest
import torch

from kvloom.attention.backend import AttentionLayerSpec, CommonAttentionMetadata
from kvloom.testing.reference import (
    PagedCache,
    PagedRun,
    check_paged_case,
    make_paged_case,
    place_requests,
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


def test_place_requests() -> None:
    gen = torch.Generator().manual_seed(0)
    requests = place_requests([3, 1, 6], [10, 17, 6], block_size=4, num_blocks=12, generator=gen)
    assert [(r.context_len, r.query_len, len(r.blocks)) for r in requests] == [(7, 3, 3), (16, 1, 5), (0, 6, 2)]
    owned = [b for r in requests for b in r.blocks]
    assert len(set(owned)) == 10 and max(owned) < 12  # each request on its own blocks
    with pytest.raises(ValueError, match="the requests need 10 blocks of 4; the cache has 9"):
        place_requests([3, 1, 6], [10, 17, 6], block_size=4, num_blocks=9, generator=gen)
    with pytest.raises(ValueError, match="1 <= query_len <= seq_len"):
        place_requests([0], [5], block_size=4, num_blocks=9, generator=gen)


def test_a_step_of_fillers_alone_is_a_dummy_capture_batch() -> None:
    case = make_paged_case(ReferenceBackend, [], [], num_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                           dtype=torch.float32, pad_reqs=3)
    common = case.common
    assert (common.num_reqs, common.num_actual_tokens, common.max_query_len, common.max_seq_len) == (3, 0, 1, 1)
    assert common.query_start_loc_cpu.tolist() == [0, 1, 2, 3] and common.seq_lens_cpu.tolist() == [1, 1, 1]
    assert common.slot_mapping.tolist() == [-1] * 3 and (common.block_table == 0).all()
    assert case.query.shape == (3, 4, 8) and case.expected_output.shape == (0, 4, 8)
    check = check_paged_case(case, run_paged_case(case, for_cudagraph=True))
    assert not check.problems and check.request_errors == []
    with pytest.raises(ValueError, match="at least one request or filler"):
        make_paged_case(ReferenceBackend, [], [], num_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                        dtype=torch.float32)


def test_refill_from_replays_a_later_step_on_the_captured_tensors() -> None:
    """What a CUDA-graph test does: capture on a dummy step's tensors, then refill them
    with each new step over the same cache and run on them; checked against the new step."""
    spec = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=8, dtype=torch.float32,
                              kv_cache_dtype=torch.float32, block_size=4, max_num_seqs=4, max_model_len=32,
                              scale=0.3)
    gen = torch.Generator().manual_seed(2)
    cache = PagedCache.allocate(ReferenceBackend, spec, 20, "cpu", gen, fill="nan")
    captured = cache.step([], filler_requests=4, max_blocks=8)
    builder, impl = cache.make_builder(8), cache.make_impl()
    out = torch.full_like(captured.query, float("nan"))
    for seq_lens in ([9, 1, 32], [4, 17]):
        requests = place_requests([1] * len(seq_lens), seq_lens, block_size=4, num_blocks=20, generator=gen)
        step = cache.step(requests, filler_requests=4 - len(seq_lens), max_blocks=8)
        qkv_ptr = captured.query.data_ptr()
        captured.refill_from(step)
        assert captured.query.data_ptr() == qkv_ptr and torch.equal(captured.query, step.query)
        assert captured.common.num_actual_tokens == len(seq_lens) and captured.common.max_seq_len == max(seq_lens)
        assert captured.common.seq_lens_cpu.tolist() == seq_lens + [1] * (4 - len(seq_lens))
        metadata = builder.build_for_cudagraph_capture(captured.common)
        impl.forward(captured.query, captured.key, captured.value, cache.kv_cache, metadata, out)
        check = check_paged_case(step, PagedRun(out, metadata, None))
        assert not check.problems and check.rel_error < 1e-6

    other = make_paged_case(ReferenceBackend, [1] * 4, [5] * 4, num_heads=4, num_kv_heads=2, head_size=8,
                            block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs a step over the same PagedCache"):
        captured.refill_from(other)
    with pytest.raises(ValueError, match="replays one batch shape: 4 requests x 4 token rows, not 5 x 5"):
        captured.refill_from(cache.step(place_requests([1] * 5, [2] * 5, block_size=4, num_blocks=20,
                                                       generator=gen), max_blocks=8))
