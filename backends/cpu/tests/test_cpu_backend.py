"""CPU_ATTN: the full conformance suite plus the backend's own contract details."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from kvloom_backend_cpu import CPUAttentionBackend, kernels
from kvloom_backend_cpu.builder import CPUAttentionMetadataBuilder
from kvloom_backend_cpu.impl import CPUAttentionImpl

from kvloom.interfaces import (
    AttentionLayerSpec,
    AttentionSelectorConfig,
    AttentionType,
    FP8_KV_CACHE_DTYPES,
    CommonAttentionMetadata,
    dequantize_kv,
    quantize_kv,
)
from kvloom.interfaces.models import Attention
from kvloom.testing import ConformanceCase, check_case, conformance_cases, forward_context, run_case
from kvloom.testing.reference import (
    PagedCache,
    PagedRequest,
    PagedRun,
    check_paged_case,
    make_paged_case,
    place_requests,
    reference_attention,
    relative_error,
)


@pytest.mark.parametrize("case", conformance_cases(CPUAttentionBackend), ids=str)
def test_conformance(case: ConformanceCase) -> None:
    check_case(CPUAttentionBackend, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_smollm2_head_layout(scenario: str, dtype: torch.dtype) -> None:
    # 9 query heads over 3 KV heads (SmolLM2-135M): a GQA ratio the standard layouts lack.
    case = ConformanceCase(scenario, dtype, num_heads=9, num_kv_heads=3, head_size=64, block_size=16)
    result = run_case(CPUAttentionBackend, case, seed=0)
    assert result.passed, result.format()


def test_registered_through_its_entry_point() -> None:
    eps = importlib.metadata.entry_points(group="kvloom.attention_backends")
    (ep,) = [e for e in eps if e.name == "CPU_ATTN"]
    assert ep.load() is CPUAttentionBackend
    assert ep.dist is not None and ep.dist.name == "kvloom-backend-cpu"
    import kvloom_backend_cpu

    assert kvloom_backend_cpu.KVLOOM_PLUGIN_API == "1.1"


def _config(**kw) -> AttentionSelectorConfig:
    base = dict(head_size=64, dtype=torch.float32, block_size=16, device_type="cpu")
    return AttentionSelectorConfig(**{**base, **kw})


def test_declared_support() -> None:
    assert CPUAttentionBackend.NAME == "CPU_ATTN"
    for ok in (_config(), _config(dtype=torch.bfloat16, block_size=7, head_size=80),
               _config(dtype=torch.float16, block_size=1, head_size=256), _config(block_size=None),
               _config(kv_cache_dtype="fp8"), _config(kv_cache_dtype="fp8_e5m2", dtype=torch.bfloat16)):
        assert CPUAttentionBackend.validate_configuration(ok) == []
    assert CPUAttentionBackend.preferred_block_size() == 16
    assert CPUAttentionBackend.get_kv_cache_shape(10, 16, 3, 64) == (2, 10, 16, 3, 64)
    reasons = CPUAttentionBackend.validate_configuration(
        _config(device_type="cuda", head_size=512, kv_cache_dtype="int8", use_mla=True,
                attn_type=AttentionType.ENCODER_ONLY, dtype=torch.float64)
    )
    joined = "; ".join(reasons)
    for expected in ("device type cuda not supported", "head size 512 not supported (supports 1..256)",
                     "kv cache dtype int8 not supported", "MLA not supported", "attention type encoder_only",
                     "dtype float64 not supported"):
        assert expected in joined


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"kv_cache_dtype": "int8"}, "kv_cache_dtype"), ({"attn_type": AttentionType.ENCODER}, "attn_type"),
     ({"num_kv_heads": 3}, "num_kv_heads"), ({"sinks": torch.zeros(3)}, "sinks")],
)
def test_impl_refuses_what_it_does_not_implement(kwargs: dict, field: str) -> None:
    args = {"num_heads": 8, "head_size": 64, "scale": 0.125, "num_kv_heads": 2, **kwargs}
    error = ValueError if field in ("num_kv_heads", "sinks") else NotImplementedError
    with pytest.raises(error, match=field):
        CPUAttentionImpl(**args)


def _common(query_lens: list[int], seq_lens: list[int], block_size: int, num_tokens: int | None = None):
    """Metadata for requests laid out in consecutive blocks (block tables 0, 1, 2, ...)."""
    blocks_per_req = max(-(-s // block_size) for s in seq_lens)
    table = torch.arange(len(seq_lens) * blocks_per_req, dtype=torch.int32).view(len(seq_lens), -1)
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        slots += [int(table[i, p // block_size]) * block_size + p % block_size for p in range(s - q, s)]
    num_actual = len(slots)
    slots += [-1] * ((num_tokens or num_actual) - num_actual)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seqs = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts, seq_lens=seqs, block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=len(seq_lens),
        num_actual_tokens=num_actual, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seqs,
    ), table.numel()


def _builder(block_size: int = 16, num_heads: int = 8, num_kv_heads: int = 2, head_size: int = 64):
    spec = AttentionLayerSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                              dtype=torch.float32, kv_cache_dtype=torch.float32, block_size=block_size,
                              max_num_seqs=8, max_model_len=256, scale=head_size**-0.5)
    return CPUAttentionMetadataBuilder(spec, torch.device("cpu"), max_num_blocks=16)


def test_builder_batches_decodes_and_splits_prefills() -> None:
    builder = _builder()
    common, _ = _common([1, 1, 1], [40, 3, 17], 16)
    md = builder.build(common)
    (decode,) = md.decodes
    assert md.prefills == []
    assert decode.num_reqs == 3 and decode.token_rows is None and decode.padded_len == 48
    assert decode.kv_rows.numel() == 3 * 2 * 48  # (request, kv head, position)
    assert md.write_rows is None and md.write_slots.tolist() == common.slot_mapping.tolist()
    # Only the keys before each seq_len are visible.
    assert decode.key_mask.view(3, -1).sum(1).tolist() == [40, 3, 17]
    # Decodes around a prefill: gathered by row; the prefill with context gets a mask.
    common, _ = _common([1, 5, 1], [9, 20, 33], 16, num_tokens=10)
    md = builder.build(common)
    assert [d.token_rows.tolist() for d in md.decodes] == [[0, 6]]
    (prefill,) = md.prefills
    assert (prefill.token_start, prefill.token_end, prefill.context_len) == (1, 6, 15)
    assert prefill.mask.shape == (5, 20) and prefill.mask.sum().item() == sum(range(16, 21))
    assert md.write_slots.numel() == 7  # the 3 padding rows (slot -1) are dropped


def test_decodes_of_spread_lengths_are_grouped_by_length() -> None:
    builder = _builder()
    lens = torch.randint(100, 1001, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    md = builder.build(_common([1] * 64, lens, 16)[0])
    assert len(md.decodes) > 1
    rows = torch.cat([d.token_rows for d in md.decodes]).sort().values
    assert rows.tolist() == list(range(64))  # every decode exactly once
    padded = sum(d.num_reqs * d.padded_len for d in md.decodes)
    assert padded < 0.8 * 64 * (-(-max(lens) // 16) * 16)
    # Equal lengths: one group, in batch order.
    (single,) = builder.build(_common([1] * 64, [300] * 64, 16)[0]).decodes
    assert single.token_rows is None


def test_workspace_is_shared_by_layers_and_reused_across_steps() -> None:
    """bfloat16: the decodes gather into the workspace (float32 ones read the cache in place)."""
    torch.manual_seed(0)
    builder = _builder()
    impl = CPUAttentionImpl(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2)
    bf16 = torch.bfloat16
    caches = [torch.randn(CPUAttentionBackend.get_kv_cache_shape(64, 16, 2, 64), dtype=bf16) for _ in range(2)]
    pointers = set()
    for seq in (100, 101):  # two decode steps
        common, _ = _common([1] * 4, [seq] * 4, 16)
        md = builder.build(common)
        for cache in caches:  # two layers
            q, k, v = (torch.randn(4, heads, 64, dtype=bf16) for heads in (8, 2, 2))
            impl.forward(q, k, v, cache, md, torch.empty(4, 8, 64, dtype=bf16))
            pointers.add(md.workspace._buffer.data_ptr())
    assert len(pointers) == 1


def test_through_the_attention_layer() -> None:
    """The model-facing Attention layer with CPU_ATTN: one prompt, then one decode step
    over the K/V the prompt wrote, each against the float64 reference."""
    H, Hkv, D, bs = 6, 2, 32, 4
    layer = Attention(H, D, D**-0.5, Hkv, CPUAttentionBackend, prefix="layers.0.attn")
    builder = _builder(block_size=bs, num_heads=H, num_kv_heads=Hkv, head_size=D)
    gen = torch.Generator().manual_seed(0)
    cache = PagedCache.allocate(CPUAttentionBackend, builder.spec, 8, "cpu", gen)
    layer.kv_cache = cache.kv_cache
    (sequence,) = place_requests([11], [11], block_size=bs, num_blocks=8, generator=gen)
    for request in (PagedRequest(0, 10, sequence.blocks), PagedRequest(10, 1, sequence.blocks)):
        step = cache.step([request], prewrite_context=False)  # the prompt's K/V: written by the layer
        with forward_context(builder.build(step.common)):
            out = layer(step.query.flatten(1), step.key.flatten(1), step.value.flatten(1))
        check = check_paged_case(step, PagedRun(out.view(step.query.shape), None, None))
        assert not check.problems, check.problems
        assert check.rel_error < 1e-5, check


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_cache_against_the_float64_reference(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """A mixed step (a fresh prompt, a chunked prefill over cached context, decodes) with an
    fp8 KV cache and per-tensor scales: the cache holds exactly ``quantize_kv`` of the keys
    and values, and the output matches float64 attention over the dequantized cache."""
    fp8 = FP8_KV_CACHE_DTYPES[kv_cache_dtype]
    k_scale, v_scale = 0.05, 0.03  # the random K/V (std 1) span beyond +-448 * scale: some saturate
    case = make_paged_case(CPUAttentionBackend, [7, 5, 1, 1], [7, 12, 20, 9], num_heads=4, num_kv_heads=2,
                           head_size=32, block_size=4, dtype=dtype, seed=3, fill="zeros")
    cache = torch.empty(case.kv_cache.shape, dtype=fp8)
    cache.view(torch.uint8).copy_(quantize_kv(case.kv_cache, k_scale, fp8).view(torch.uint8))  # the context
    cache[1].view(torch.uint8).copy_(quantize_kv(case.kv_cache[1], v_scale, fp8).view(torch.uint8))
    impl = CPUAttentionImpl(num_heads=4, head_size=32, scale=32**-0.5, num_kv_heads=2, kv_cache_dtype=kv_cache_dtype,
                            attn_type=AttentionType.DECODER)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    metadata = CPUAttentionMetadataBuilder(case.spec, "cpu", case.common.block_table.shape[1]).build(case.common)
    output = torch.full(case.query.shape, float("nan"), dtype=dtype)
    impl.forward(case.query, case.key, case.value, cache, metadata, output)

    expected_k = quantize_kv(case.cache.expected_key_cache, k_scale, fp8)
    expected_v = quantize_kv(case.cache.expected_value_cache, v_scale, fp8)
    assert torch.equal(cache[0].view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(cache[1].view(torch.uint8), expected_v.view(torch.uint8))
    reference = reference_attention(case.query, dequantize_kv(expected_k, k_scale, torch.float64),
                                    dequantize_kv(expected_v, v_scale, torch.float64), case.common, 32**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    error = relative_error(output[: case.num_actual_tokens], reference)
    assert error < tolerance
    # The quantization is visible: against the unquantized K/V the error is far larger.
    assert relative_error(output[: case.num_actual_tokens], case.expected_output) > 3 * error


@pytest.mark.parametrize(("name", "dtype", "kernel"), [
    ("decode", torch.float32, True), ("sliding_window_long_decode", torch.float32, True),
    ("mixed", torch.float32, True), ("soft_cap", torch.float32, False), ("decode", torch.bfloat16, False),
])  # fmt: skip
def test_kernels_attends_float32_layers_without_cap_or_sinks(
    name: str, dtype: torch.dtype, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C decode kernel computes float32 decodes (checked against the float64 reference
    by the case); soft caps and half precision keep the SDPA path."""
    calls = []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    label = f"{name}[{str(dtype).removeprefix('torch.')},h8/kv2,d64,bs16]"
    case = next(c for c in conformance_cases(CPUAttentionBackend) if str(c) == label)
    check_case(CPUAttentionBackend, case)
    assert bool(calls) is kernel


def test_kv_write_kernel_stores_float32_rows_where_index_copy_would() -> None:
    """The C KV write against ``index_copy_`` of the same rows: strided key rows (a view of a
    fused projection), slots in several blocks, one layer's two caches."""
    torch.manual_seed(3)
    impl = CPUAttentionImpl(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2)
    builder = _builder()
    common, _ = _common([3, 1], [20, 40], 16)
    md = builder.build(common)
    fused = torch.randn(4, 5, 2, 64)
    key, value = fused[:, 0], fused[:, 3]
    cache = torch.randn(CPUAttentionBackend.get_kv_cache_shape(8, 16, 2, 64))
    expected = cache.clone()
    expected[0].view(-1, 2, 64).index_copy_(0, md.write_slots, key)
    expected[1].view(-1, 2, 64).index_copy_(0, md.write_slots, value)
    impl._write_kv(key, value, cache[0], cache[1], md)
    assert torch.equal(cache, expected)
