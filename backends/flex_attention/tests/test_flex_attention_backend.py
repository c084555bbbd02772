"""CPU tests of the FLEX_ATTENTION backend.

The backend declares CUDA only (see its backend.py for the CPU measurements), but its
planning, block masks, cache writes and impl are device-agnostic. Here they run on the CPU
with flex_attention's uncompiled reference (which evaluates ``mask_mod`` on every
query/slot pair, so the mask alone must be right) against the float64 reference of
``kvloom.testing.reference``, which reads the cache through the block tables; a structural test checks that the block lists, which only the compiled
kernels read, cover exactly what the mask allows. The compiled CUDA path runs in the GPU
conformance test (tests/gpu/test_backends_fiflex.py).
"""

from __future__ import annotations

import pytest
import torch
from kvloom_backend_flex_attention import KVLOOM_PLUGIN_API, FlexAttentionBackend
from kvloom_backend_flex_attention.impl import cuda_kernel_options
from kvloom_backend_flex_attention.planning import plan_page_ownership, plan_query_groups
from torch.nn.attention.flex_attention import flex_attention

from kvloom.interfaces import (
    AttentionCGSupport,
    AttentionLayerSpec,
    AttentionSelectorConfig,
    AttentionType,
    DeviceCapability,
)
from kvloom.interfaces import write_kv_default_layout as write_kv_split
from kvloom.testing.reference import (
    PagedCache,
    PagedCase,
    PagedRun,
    check_paged_case,
    make_paged_case,
    place_requests,
    run_paged_case,
)

H100 = DeviceCapability(9, 0)


def _config(**overrides) -> AttentionSelectorConfig:
    base = dict(head_size=64, dtype=torch.bfloat16, block_size=16, device_type="cuda", device_capability=H100)
    base.update(overrides)
    return AttentionSelectorConfig(**base)


# ---------------------------------------------------------------------------- declarations
def test_declarations():
    assert KVLOOM_PLUGIN_API == "1.0"
    assert FlexAttentionBackend.NAME == "FLEX_ATTENTION"
    assert FlexAttentionBackend.cudagraph_support == AttentionCGSupport.NEVER
    assert FlexAttentionBackend.required_modules == {}
    summary = FlexAttentionBackend.support_summary()
    assert summary["dtypes"] == ["float16", "bfloat16", "float32"]
    assert summary["block_sizes"] == ["multiples of 16"]
    assert summary["device_types"] == ["cuda"]
    assert FlexAttentionBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert FlexAttentionBackend.preferred_block_size() == 16


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(dtype=torch.float32, head_size=80, block_size=48), dict(dtype=torch.float16, head_size=256,
                                                                      block_size=None)],
)
def test_valid_configurations(overrides):
    assert FlexAttentionBackend.validate_configuration(_config(**overrides)) == []


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(device_type="cpu", device_capability=None), "device type cpu not supported (supports cuda)"),
        (dict(block_size=8), "block size 8 not supported (supports multiples of 16)"),
        (dict(head_size=320), "head size 320 not supported (supports 1..256)"),
        (dict(kv_cache_dtype="fp8"), "kv cache dtype fp8 not supported (supports auto)"),
        (dict(device_capability=DeviceCapability(7, 5)),
         "dtype bfloat16 needs compute capability >= 8.0 (device has 7.5); use float16"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type encoder_only not supported (supports decoder)"),
    ],
)
def test_validation_reasons(overrides, reason):
    assert FlexAttentionBackend.validate_configuration(_config(**overrides)) == [reason]


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128])
@pytest.mark.parametrize(
    "head_size, dtype", [(64, torch.bfloat16), (256, torch.float16), (128, torch.float32), (256, torch.float32)]
)
def test_cuda_kernel_tiles_divide_the_sparse_blocks(block_size, head_size, dtype):
    for q_block in (16, 64):
        options = cuda_kernel_options(q_block, block_size, head_size, dtype)
        assert options["BLOCK_M"] == q_block and q_block % options["BLOCK_M"] == 0
        assert block_size % options["BLOCK_N"] == 0 and options["BLOCK_N"] >= 16
        assert options["FORCE_USE_FLEX_ATTENTION"] is True
        # Q tile plus three pipelined K/V stages fit in H100 shared memory with headroom.
        assert (q_block + 3 * 2 * options["BLOCK_N"]) * head_size * dtype.itemsize <= 160 * 1024


# ---------------------------------------------------------------------------- host planning
def test_plan_query_groups_hand_computed():
    # r0: decode at position 40; r1: 70-token prefill; r2: 20-token chunk after 17 tokens.
    qsl = torch.tensor([0, 1, 71, 91], dtype=torch.int32)
    seq_lens = torch.tensor([41, 70, 37], dtype=torch.int32)
    short, long = plan_query_groups(qsl, seq_lens, block_size=16)

    assert short.q_block_size == 16 and short.num_rows == 48
    assert short.token_index.tolist() == [0] + list(range(71, 91))
    assert short.row_of_token.tolist() == [0] + list(range(16, 36))
    assert short.req_of_row.tolist() == [0] * 16 + [2] * 32
    assert short.pos_of_row.tolist() == [40] + [-1] * 15 + list(range(17, 37)) + [-1] * 12
    assert short.req_of_qblock.tolist() == [0, 2, 2]
    # r0's block sees pages 0-1 fully and page 2 (slots 32..40) partly; r2's first block
    # (positions 17..32) page 0 fully, pages 1-2 partly; its second (33..36) pages 0-1 fully.
    assert short.full_pages.tolist() == [2, 1, 2]
    assert short.visible_pages.tolist() == [3, 3, 3]

    assert long.q_block_size == 64 and long.num_rows == 128
    assert long.token_index.tolist() == list(range(1, 71))
    assert long.row_of_token.tolist() == list(range(70))
    assert long.pos_of_row.tolist() == list(range(70)) + [-1] * 58
    assert long.req_of_qblock.tolist() == [1, 1]
    assert long.full_pages.tolist() == [0, 4]
    assert long.visible_pages.tolist() == [4, 5]


def test_plan_query_groups_skips_empty_groups_and_requests_without_queries():
    groups = plan_query_groups(torch.tensor([0, 1, 1, 2]), torch.tensor([5, 9, 1]), block_size=16)
    assert len(groups) == 1 and groups[0].req_of_qblock.tolist() == [0, 2]


def test_plan_page_ownership_hand_computed():
    ownership = plan_page_ownership(torch.tensor([1, 33, 16]), block_size=16, block_table_width=4)
    assert ownership.table_index.tolist() == [0, 4, 5, 6, 8]
    assert ownership.logical_page.tolist() == [0, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="needs 3 blocks of 16; the block table has only 2 columns"):
        plan_page_ownership(torch.tensor([33]), block_size=16, block_table_width=2)


def test_write_kv_split_lands_in_split_view_and_skips_minus_one():
    cache = torch.zeros(FlexAttentionBackend.get_kv_cache_shape(4, 16, 2, 8))
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_split(cache, key, value, torch.tensor([-1, 2 * 16 + 3, 63]))
    k_cache, v_cache = FlexAttentionBackend.split_kv_cache(cache)
    assert torch.equal(k_cache[2, 3], key[1]) and torch.equal(v_cache[2, 3], value[1])
    assert torch.equal(k_cache[3, 15], key[2]) and torch.equal(v_cache[3, 15], value[2])
    assert int((cache != 0).any(dim=(-1, -2)).sum()) == 4


# ---------------------------------------------------------------------------- steps
BLOCK = 16


def _spec(heads, kv_heads, dim, dtype, block_size=BLOCK) -> AttentionLayerSpec:
    return AttentionLayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=dim, dtype=dtype,
                              kv_cache_dtype=dtype, block_size=block_size, max_num_seqs=8, max_model_len=256,
                              scale=dim**-0.5)


def _case(requests, *, heads, kv_heads, dim, dtype, seed, block_size=BLOCK, **features) -> PagedCase:
    """One step of ``(context_len, query_len)`` requests on shuffled blocks of a fresh
    cache. flex_attention reads whole pages, so the slots no request owns must be finite:
    they hold large random values (a mask letting one through shows in the output).
    ``features``: ``sliding_window`` / ``logits_soft_cap``; the blocks wholly before a
    window, which the reference poisons with NaN, get 1e4 instead: the uncompiled flex reads
    every page (the compiled kernels read only the listed ones, checked below)."""
    spec = _spec(heads, kv_heads, dim, dtype, block_size)
    case = make_paged_case(
        FlexAttentionBackend, [q for _, q in requests], [c + q for c, q in requests], num_heads=heads,
        num_kv_heads=kv_heads, head_size=dim, block_size=block_size, dtype=dtype, seed=seed,
        max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len, fill="random", **features,
    )
    for cache in (case.kv_cache, case.cache.expected_key_cache, case.cache.expected_value_cache):
        cache.nan_to_num_(nan=1e4)
    return case


def _run(case: PagedCase) -> PagedRun:
    """The backend's own builder and impl on ``case``, the impl calling flex_attention's
    uncompiled reference (the CPU is not a declared device)."""
    impl = case.cache.make_impl()
    impl.flex_fn = flex_attention
    return run_paged_case(case, impl=impl)


def _check(case: PagedCase, run: PagedRun, tol: float) -> None:
    """The cache exactly as a correct step leaves it, and each real request's output
    within ``tol`` of the float64 reference (relative, worst request)."""
    check = check_paged_case(case, run)
    assert not check.problems, check.problems
    assert check.rel_error < tol, check


CASES = {
    "prefill": [(0, 37)],
    "chunked_prefill_with_context": [(20, 7), (48, 70), (3, 1)],
    "decode": [(40, 1), (0, 1), (100, 1), (15, 1)],
    "mixed_interleaved": [(40, 1), (0, 9), (17, 1), (31, 80), (64, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)])
def test_matches_float64_reference(case, heads, kv_heads):
    step = _case(CASES[case], heads=heads, kv_heads=kv_heads, dim=32, dtype=torch.float32,
                 seed=list(CASES).index(case))
    _check(step, _run(step), 1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_half_precision_and_block_size_32(dtype, tol):
    step = _case([(50, 1), (0, 70), (33, 12)], heads=8, kv_heads=2, dim=64, dtype=dtype, seed=5, block_size=32)
    _check(step, _run(step), tol)


@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize("window", [20, 1, 300])
def test_sliding_window_and_soft_cap_match_float64_reference(window, cap):
    step = _case(CASES["mixed_interleaved"], heads=8, kv_heads=2, dim=32, dtype=torch.float32, seed=window,
                 sliding_window=window, logits_soft_cap=cap)
    _check(step, _run(step), 1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_sinks_match_float64_reference(window):
    """gpt-oss's sinks (alone, and with a window as its windowed layers have them)."""
    step = _case(CASES["mixed_interleaved"], heads=8, kv_heads=2, dim=32, dtype=torch.float32, seed=11,
                 sliding_window=window, sinks=True)
    _check(step, _run(step), 1e-5)


def test_soft_cap_alone_matches_float64_reference():
    step = _case(CASES["chunked_prefill_with_context"], heads=4, kv_heads=4, dim=32, dtype=torch.float32, seed=3,
                 logits_soft_cap=2.0)
    _check(step, _run(step), 1e-5)


def test_forward_refuses_a_layer_window_unlike_the_plan():
    step = _case([(40, 1)], heads=8, kv_heads=2, dim=32, dtype=torch.float32, seed=1, sliding_window=8)
    meta = step.cache.make_builder(step.common.block_table.shape[1]).build(step.common)
    impl = FlexAttentionBackend.get_impl_cls()(num_heads=8, head_size=32, scale=0.1, num_kv_heads=2)
    with pytest.raises(ValueError, match="layer sliding_window None differs from the step's plan \\(8\\)"):
        impl.forward(step.query, step.key, step.value, step.kv_cache, meta, torch.empty_like(step.query))


def test_prefix_shared_page():
    """Request 1 reuses request 0's first page (same tokens there, as prefix caching would)."""
    gen = torch.Generator().manual_seed(9)
    cache = PagedCache.allocate(FlexAttentionBackend, _spec(8, 2, 32, torch.float32), 6, "cpu", gen, fill="random")
    first, second = place_requests([1, 5], [21, 23], block_size=BLOCK, num_blocks=6, generator=gen)
    second.blocks[0] = first.blocks[0]  # both contexts fill that page: it holds the tokens both read
    step = cache.step([first, second])
    assert step.common.block_table[0, 0] == step.common.block_table[1, 0]
    _check(step, _run(step), 1e-5)


def test_slot_minus_one_is_not_written():
    step = _case([(0, 5), (16, 3)], heads=8, kv_heads=2, dim=32, dtype=torch.float32, seed=4)
    skipped = int(step.written_slots[2])
    step.common.slot_mapping[2] = -1
    before = step.kv_cache.clone()
    _run(step)
    changed = (step.kv_cache != before).any(dim=(-1, -2))  # [2, blocks, block_size]
    assert int(changed[0].sum()) == 7 and int(changed[1].sum()) == 7
    k_cache, _ = FlexAttentionBackend.split_kv_cache(step.kv_cache)
    assert torch.equal(k_cache.reshape(-1, 2, 32)[skipped], before[0].reshape(-1, 2, 32)[skipped])


@pytest.mark.parametrize("window", [None, 20])
def test_block_lists_cover_exactly_what_the_mask_allows(window):
    """What the compiled kernels rely on: for every query block, every slot the mask allows
    lies in a listed page, full pages are allowed for every real row, lists are disjoint;
    with a window no page wholly before the block's first row's window is listed."""
    step = _case([(40, 1), (0, 9), (17, 1), (31, 80), (64, 1), (5, 70)], heads=8, kv_heads=2, dim=32,
                 dtype=torch.float32, seed=12, sliding_window=window)
    block_table = step.common.block_table
    num_blocks, width = step.cache.num_blocks, block_table.shape[1]
    meta = step.cache.make_builder(width).build(step.common)
    kv_len = num_blocks * BLOCK
    slot = torch.arange(kv_len)
    for group, mask in zip(meta.groups, meta.block_masks(num_blocks)):
        rows = torch.arange(group.num_rows)
        allowed = mask.mask_mod(torch.tensor(0), torch.tensor(0), rows[:, None], slot[None, :])  # [R, kv_len]
        # Independent expectation from the block table.
        logical = torch.arange(width)
        page_of = block_table[group.req_of_row]  # [R, W]
        pos = group.pos_of_row
        expected = torch.zeros(group.num_rows, kv_len, dtype=torch.bool)
        for r in range(group.num_rows):
            for j in logical.tolist():
                if pos[r] >= 0 and j * BLOCK <= pos[r]:
                    p = int(page_of[r, j])
                    n_valid = min(BLOCK, int(pos[r]) - j * BLOCK + 1)
                    expected[r, p * BLOCK : p * BLOCK + n_valid] = True
                    if window is not None:  # positions <= pos - window fall out
                        first = max(0, int(pos[r]) - window + 1)
                        for position in range(j * BLOCK, min(first, (j + 1) * BLOCK)):
                            expected[r, p * BLOCK + position - j * BLOCK] = False
        assert torch.equal(allowed, expected), "mask_mod disagrees with the block table"

        qb = group.q_block_size
        for b in range(group.num_rows // qb):
            partial = mask.kv_indices[0, 0, b, : int(mask.kv_num_blocks[0, 0, b])].tolist()
            full = mask.full_kv_indices[0, 0, b, : int(mask.full_kv_num_blocks[0, 0, b])].tolist()
            assert not set(partial) & set(full) and len(set(partial + full)) == len(partial + full)
            block_allowed = allowed[b * qb : (b + 1) * qb]
            pages_allowed = set(torch.nonzero(block_allowed.any(0)).flatten().div(BLOCK, rounding_mode="floor").tolist())
            assert pages_allowed <= set(partial) | set(full), "an allowed page is not listed"
            real = group.pos_of_row[b * qb : (b + 1) * qb] >= 0
            for p in full:
                assert bool(block_allowed[real][:, p * BLOCK : (p + 1) * BLOCK].all()), "a full page is not fully allowed"
            assert set(partial) <= pages_allowed, "a listed partial page is never allowed"
            if window is not None:
                first_row_pos = int(group.pos_of_row[b * qb])
                request_pages = block_table[group.req_of_row[b * qb]].tolist()
                before = request_pages[: max(0, first_row_pos - window + 1) // BLOCK]
                assert not set(before) & set(partial + full), "a page wholly before the window is listed"
