"""GPU tests of the FLASHINFER and FLEX_ATTENTION backends (skipped without CUDA).

1. kvloom's backend conformance suite on each backend.
2. Direct checks of each backend through the plugin contract against a float64 reference
   (prefill, chunked prefill with context, decode, a mixed batch in arbitrary order, GQA,
   slot -1), and for FLASHINFER a CUDA-graph capture and replay of a padded decode step.

JIT/compile budget on a fresh machine: one dtype/head-size combination (bf16, 128) and one
block size, so FlashInfer builds one FA2 module (~27 s, shared by its prefill and
tensor-core decode wrappers) and flex_attention compiles two query-group kernels.
FLASHINFER needs the flashinfer-python wheel (tests/gpu/fetch_wheels.sh) and both
backend distributions installed (their entry points are looked up by name).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvloom.attention.backend import AttentionBackend, AttentionLayerSpec, CommonAttentionMetadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ["FLASHINFER", "FLEX_ATTENTION"]
HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS, WIDTH = 16, 4, 128, 16, 512, 64
DTYPE = torch.bfloat16
SCALE = 1 / math.sqrt(DIM)


@pytest.mark.parametrize("name", BACKENDS)
def test_conformance_suite(name):
    from kvloom.testing import run_conformance

    report = run_conformance(name, device="cuda")
    assert report.passed, report.format()


def _backend(name: str) -> type[AttentionBackend]:
    if name == "FLASHINFER":
        from kvloom_backend_flashinfer import FlashInferBackend

        return FlashInferBackend
    from kvloom_backend_flex_attention import FlexAttentionBackend

    return FlexAttentionBackend


def _parts(name: str):
    backend = _backend(name)
    device = torch.device("cuda")
    spec = AttentionLayerSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM, dtype=DTYPE,
                              kv_cache_dtype=DTYPE, block_size=BLOCK, max_num_seqs=16,
                              max_model_len=WIDTH * BLOCK, scale=SCALE)
    builder = backend.get_builder_cls()(spec, device, NUM_BLOCKS)
    impl = backend.get_impl_cls()(num_heads=HEADS, head_size=DIM, scale=SCALE, num_kv_heads=KV_HEADS)
    cache = torch.zeros(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK, KV_HEADS, DIM), dtype=DTYPE, device=device)
    return backend, builder, impl, cache


def _make_batch(backend, cache, requests, gen, *, pad_requests=0, slot_minus_one=()):
    """Context of each ``(context_len, query_len)`` request written through
    ``split_kv_cache``; returns (common, q, k, v, float64 reference [real tokens])."""
    k_cache, v_cache = backend.split_kv_cache(cache)
    needed = [-(-(c + q) // BLOCK) for c, q in requests]
    pages = torch.randperm(NUM_BLOCKS, generator=gen)[: sum(needed)].tolist()
    num_reqs = len(requests) + pad_requests
    block_table = torch.zeros(num_reqs, WIDTH, dtype=torch.int32)
    qs, ks, vs, slots, refs, q_lens, seq_lens = [], [], [], [], [], [], []
    for i, ((ctx, qlen), n) in enumerate(zip(requests, needed)):
        block_table[i, :n] = torch.tensor(pages[:n], dtype=torch.int32)
        pages = pages[n:]
        seq = ctx + qlen
        k_full = torch.randn(seq, KV_HEADS, DIM, generator=gen).to(DTYPE)
        v_full = torch.randn(seq, KV_HEADS, DIM, generator=gen).to(DTYPE)
        q = torch.randn(qlen, HEADS, DIM, generator=gen).to(DTYPE)
        pos = torch.arange(seq)
        flat = block_table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK
        blk, off = (flat[:ctx] // BLOCK).cuda(), (flat[:ctx] % BLOCK).cuda()
        k_cache[blk, off], v_cache[blk, off] = k_full[:ctx].cuda(), v_full[:ctx].cuda()
        slots.append(flat[ctx:])
        qs.append(q), ks.append(k_full[ctx:]), vs.append(v_full[ctx:])
        kk = k_full.double().repeat_interleave(HEADS // KV_HEADS, 1)
        vv = v_full.double().repeat_interleave(HEADS // KV_HEADS, 1)
        s = torch.einsum("qhd,khd->hqk", q.double(), kk) * SCALE
        s = s.masked_fill(pos[None, :] > pos[ctx:, None], float("-inf"))
        refs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv))
        q_lens.append(qlen), seq_lens.append(seq)
    for _ in range(pad_requests):  # CUDA-graph padding: query 1, seq_len 1, row 0, slot -1
        qs.append(torch.randn(1, HEADS, DIM, generator=gen).to(DTYPE))
        ks.append(torch.randn(1, KV_HEADS, DIM, generator=gen).to(DTYPE))
        vs.append(torch.randn(1, KV_HEADS, DIM, generator=gen).to(DTYPE))
        slots.append(torch.tensor([-1]))
        q_lens.append(1), seq_lens.append(1)
    slot_mapping = torch.cat(slots)
    for t in slot_minus_one:
        slot_mapping[t] = -1
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), seq_lens=seq_t.cuda(), block_table=block_table.cuda(),
        slot_mapping=slot_mapping.cuda(), num_reqs=num_reqs, num_actual_tokens=sum(q for _, q in requests),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_t,
    )
    ref = torch.cat(refs) if refs else torch.zeros(0, HEADS, DIM, dtype=torch.float64)
    return common, torch.cat(qs).cuda(), torch.cat(ks).cuda(), torch.cat(vs).cuda(), ref


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


CASES = {
    "prefill": [(0, 300)],
    "chunked_prefill_with_context": [(100, 37), (250, 128), (17, 1)],
    "decode": [(1, 1), (40, 1), (700, 1), (129, 1), (16, 1)],
    "mixed_any_order": [(90, 1), (0, 77), (33, 1), (200, 64), (5, 1), (0, 3)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", BACKENDS)
def test_against_float64_reference(name, case):
    backend, builder, impl, cache = _parts(name)
    gen = torch.Generator().manual_seed(list(CASES).index(case))
    common, q, k, v, ref = _make_batch(backend, cache, CASES[case], gen, slot_minus_one=())
    out = torch.full_like(q, float("nan"))
    impl.forward(q, k, v, cache, builder.build(common), out)
    torch.cuda.synchronize()
    assert _rel_err(out, ref) < 2e-2
    # The new tokens landed in the cache where the slot mapping says.
    k_cache, v_cache = backend.split_kv_cache(cache)
    slots = common.slot_mapping.long()
    assert torch.equal(k_cache[slots // BLOCK, slots % BLOCK], k)
    assert torch.equal(v_cache[slots // BLOCK, slots % BLOCK], v)


@pytest.mark.parametrize("name", BACKENDS)
def test_slot_minus_one_is_not_written(name):
    backend, builder, impl, cache = _parts(name)
    gen = torch.Generator().manual_seed(42)
    common, q, k, v, _ = _make_batch(backend, cache, [(20, 5), (0, 3)], gen, slot_minus_one=(1,))
    before = cache.clone()
    impl.forward(q, k, v, cache, builder.build(common), torch.empty_like(q))
    changed = (cache != before).any(dim=-1).any(dim=-1)
    assert int(changed.sum()) == 2 * 7  # 7 of 8 tokens, K and V each


def test_flashinfer_cudagraph_decode_replay():
    """Capture a padded decode step of batch size 4 once, then replay it for a new step."""
    backend, builder, impl, cache = _parts("FLASHINFER")
    gen = torch.Generator().manual_seed(7)
    # Persistent inputs, as a model runner keeps them for graphs.
    static_q = torch.zeros(4, HEADS, DIM, dtype=DTYPE, device="cuda")
    static_k = torch.zeros(4, KV_HEADS, DIM, dtype=DTYPE, device="cuda")
    static_v = torch.zeros_like(static_k)
    static_out = torch.zeros_like(static_q)
    static_slots = torch.full((4,), -1, dtype=torch.int64, device="cuda")

    dummy, *_ = _make_batch(backend, cache, [], gen, pad_requests=4)
    dummy.slot_mapping = static_slots
    meta = builder.build_for_cudagraph_capture(dummy)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        impl.forward(static_q, static_k, static_v, cache, meta, static_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(static_q, static_k, static_v, cache, meta, static_out)

    for seed, requests in ((1, [(30, 1), (700, 1), (5, 1)]), (2, [(64, 1), (1, 1), (300, 1)])):
        common, q, k, v, ref = _make_batch(backend, cache, requests, torch.Generator().manual_seed(seed),
                                           pad_requests=1)
        static_slots.copy_(common.slot_mapping)
        common.slot_mapping = static_slots
        step_meta = builder.build(common)
        assert step_meta.wrapper is meta.wrapper, "a decode step of a captured size must use the graph wrapper"
        static_q.copy_(q), static_k.copy_(k), static_v.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(static_out[:3], ref) < 2e-2
        k_cache, _ = backend.split_kv_cache(cache)
        slots = common.slot_mapping[:3]
        assert torch.equal(k_cache[slots // BLOCK, slots % BLOCK], k[:3])
