"""TRITON_ATTN on a CUDA GPU: compiled kernels against the float64 reference, CUDA graphs.

Skipped without a GPU (the CPU runs the same kernels in test_triton_backend_interpret.py).
Thresholds are issue 6's acceptance: bf16 under 1e-2, fp32 under 1e-5 (fp16 under 5e-3).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kvloom_backend_triton.backend import TritonAttentionBackend
from kvloom_backend_triton.builder import CONFIG_EXTRA_KEY

from kvloom.testing.reference import PagedRun, check_paged_case, make_paged_case, place_requests, run_paged_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}

SCENARIOS = {
    # name: (query_lens, seq_lens, kernel config overrides)
    "decode": ([1] * 6, [1, 15, 16, 17, 700, 2100], {}),
    "split_decode": ([1] * 5, [3, 64, 511, 1500, 3000], {"force_num_splits": 7}),
    "prefill": ([300, 64, 1, 129], [300, 64, 1, 129], {}),
    "chunked_prefill": ([100, 37], [1100, 500], {}),
    "mixed": ([1, 250, 1, 17, 1], [900, 250, 2000, 433, 40], {}),
}

# Every dtype x head size once; GQA ratio and block size cycle through 1/4/8 and 16/32.
SHAPES = [
    (dtype, head_size, gqa, block)
    for i, (dtype, head_size) in enumerate(
        (d, h) for d in (torch.bfloat16, torch.float16, torch.float32) for h in (64, 128, 256)
    )
    for gqa, block in [((1, 4, 8)[i % 3], (16, 32)[i % 2])]
]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(
    ("dtype", "head_size", "gqa", "block_size"), SHAPES, ids=[f"{d}-d{h}-gqa{g}-b{b}" for d, h, g, b in SHAPES]
)
def test_matches_float64_reference(scenario: str, dtype: torch.dtype, head_size: int, gqa: int, block_size: int) -> None:
    query_lens, seq_lens, overrides = SCENARIOS[scenario]
    # A seed that is the same in every process (hash() of a str is not), so a failure
    # reproduces from the seed in its message.
    seed = zlib.crc32(f"{scenario}-{dtype}-d{head_size}-gqa{gqa}-b{block_size}".encode())
    case = make_paged_case(
        TritonAttentionBackend, query_lens, seq_lens, num_heads=8,
        num_kv_heads=8 // gqa, head_size=head_size, block_size=block_size, dtype=dtype, device="cuda",
        seed=seed, pad_tokens=4, extra={CONFIG_EXTRA_KEY: overrides},
    )
    run = run_paged_case(case)
    torch.cuda.synchronize()
    check = check_paged_case(case, run)
    assert not check.problems, f"seed {seed}: {check.problems}"
    assert check.rel_error < TOLERANCE[dtype], f"seed {seed}: {check}"
    if scenario == "split_decode":
        assert run.metadata.num_splits > 1


def test_cuda_graph_replay_follows_lengths_changed_in_place() -> None:
    """Capture a padded decode batch, refill lengths/tables/slots/data in place with a new
    step over the same cache, replay: the real requests' outputs match the float64
    reference of the new step, and the cache holds exactly its new tokens."""
    common_kw = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16,
                     device="cuda", pad_reqs=3, max_model_len=4096, max_num_seqs=16,
                     extra={CONFIG_EXTRA_KEY: {"programs_per_sm": 64}})  # split on any GPU
    first = make_paged_case(TritonAttentionBackend, [1] * 5, [4096, 1, 700, 2000, 33], seed=1, **common_kw)

    builder = TritonAttentionBackend.get_builder_cls()(first.spec, torch.device("cuda"), 256)
    impl = TritonAttentionBackend.get_impl_cls()(num_heads=32, head_size=128, scale=first.spec.scale, num_kv_heads=8)
    md = builder.build_for_cudagraph_capture(first.common)
    assert md.num_splits > 1  # the graph path exercises split-KV + reduce
    out = torch.empty_like(first.query)
    impl.forward(first.query, first.key, first.value, first.kv_cache, md, out)  # JIT outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(first.query, first.key, first.value, first.kv_cache, md, out)

    # The next step over the same cache (no more blocks than it has), copied into the
    # captured step's tensors in place.
    cache = first.cache
    new_lens = [17, 3000, 1, 2500, 900]
    requests = place_requests([1] * 5, new_lens, block_size=16, num_blocks=cache.num_blocks,
                              generator=cache.generator)
    second = cache.step(requests, filler_requests=3, max_blocks=first.common.block_table.shape[1])
    first.refill_from(second)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check = check_paged_case(second, PagedRun(out, md, None))
    assert not check.problems, check.problems
    assert check.rel_error < 1e-2, check
