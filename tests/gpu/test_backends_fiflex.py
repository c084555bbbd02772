"""GPU tests of the FLASHINFER and FLEX_ATTENTION backends (skipped without CUDA).

1. kvloom's backend conformance suite on each backend.
2. Direct checks of each backend through the plugin contract against the float64 reference
   of ``kvloom.testing.reference`` (prefill, chunked prefill with context, decode, a mixed
   batch in arbitrary order, GQA, slot -1), and for FLASHINFER a CUDA-graph capture and
   replay of a padded decode step.

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

from kvloom.attention.backend import AttentionBackend, AttentionLayerSpec
from kvloom.testing.reference import (
    PagedCache,
    PagedCase,
    PagedRun,
    check_paged_case,
    make_paged_case,
    place_requests,
    run_paged_case,
)

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


def _spec() -> AttentionLayerSpec:
    return AttentionLayerSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM, dtype=DTYPE,
                              kv_cache_dtype=DTYPE, block_size=BLOCK, max_num_seqs=16,
                              max_model_len=WIDTH * BLOCK, scale=SCALE)


def _shape(requests) -> tuple[list[int], list[int]]:
    """Query and sequence lengths of ``(context_len, query_len)`` requests."""
    return [q for _, q in requests], [c + q for c, q in requests]


def _case(name: str, requests, *, seed: int) -> PagedCase:
    """One step of ``(context_len, query_len)`` requests on shuffled blocks of a fresh cache
    of NUM_BLOCKS blocks (the same cache shape for every step, as in serving). Its spare
    slots hold large random values: finite, as flex_attention reads whole pages."""
    query_lens, seq_lens = _shape(requests)
    spec = _spec()
    return make_paged_case(
        _backend(name), query_lens, seq_lens, num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM,
        block_size=BLOCK, dtype=DTYPE, device="cuda", seed=seed, max_num_seqs=spec.max_num_seqs,
        max_model_len=spec.max_model_len, extra_blocks=NUM_BLOCKS - sum(-(-s // BLOCK) for s in seq_lens),
        fill="random",
    )


CASES = {
    "prefill": [(0, 300)],
    "chunked_prefill_with_context": [(100, 37), (250, 128), (17, 1)],
    "decode": [(1, 1), (40, 1), (700, 1), (129, 1), (16, 1)],
    "mixed_any_order": [(90, 1), (0, 77), (33, 1), (200, 64), (5, 1), (0, 3)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", BACKENDS)
def test_against_float64_reference(name, case):
    step = _case(name, CASES[case], seed=list(CASES).index(case))
    run = run_paged_case(step)
    torch.cuda.synchronize()
    # The cache exactly (the new tokens where the slot mapping says, nothing else
    # written), and each request's output against the float64 reference.
    check = check_paged_case(step, run)
    assert not check.problems, check.problems
    assert check.rel_error < 2e-2, check


@pytest.mark.parametrize("name", BACKENDS)
def test_slot_minus_one_is_not_written(name):
    step = _case(name, [(20, 5), (0, 3)], seed=42)
    step.common.slot_mapping[1] = -1
    before = step.kv_cache.clone()
    run_paged_case(step)
    changed = (step.kv_cache != before).any(dim=-1).any(dim=-1)
    assert int(changed.sum()) == 2 * 7  # 7 of 8 tokens, K and V each


def test_flashinfer_cudagraph_decode_replay():
    """Capture a padded decode step of batch size 4 once, then replay it for new steps."""
    cache = PagedCache.allocate(_backend("FLASHINFER"), _spec(), NUM_BLOCKS, "cuda", torch.Generator().manual_seed(7),
                                fill="random")
    builder, impl = cache.make_builder(WIDTH), cache.make_impl()
    # Persistent inputs, as a model runner keeps them for graphs, holding a dummy step of
    # filler requests alone (seq_len 1, block-table row 0, slot -1) to capture with.
    buffers = cache.step([], filler_requests=4, max_blocks=WIDTH)
    out = torch.zeros_like(buffers.query)
    meta = builder.build_for_cudagraph_capture(buffers.common)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        impl.forward(buffers.query, buffers.key, buffers.value, cache.kv_cache, meta, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(buffers.query, buffers.key, buffers.value, cache.kv_cache, meta, out)

    for requests in ([(30, 1), (700, 1), (5, 1)], [(64, 1), (1, 1), (300, 1)]):
        query_lens, seq_lens = _shape(requests)
        placed = place_requests(query_lens, seq_lens, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                                generator=cache.generator)
        step = cache.step(placed, filler_requests=1, max_blocks=WIDTH)
        buffers.refill_from(step)
        step_meta = builder.build(buffers.common)
        assert step_meta.wrapper is meta.wrapper, "a decode step of a captured size must use the graph wrapper"
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # Against the float64 reference; and the cache exactly: the real requests' new K/V
        # at their slots, nothing else written (the filler's slot -1 included).
        check = check_paged_case(step, PagedRun(out, step_meta, None))
        assert not check.problems, check.problems
        assert check.rel_error < 2e-2, check
