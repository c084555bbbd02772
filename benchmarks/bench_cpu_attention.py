"""Time CPU_ATTN's forward (one layer) and builder (once per step) on engine-like batches.

    python benchmarks/bench_cpu_attention.py [--dtype float32|bfloat16|float16] [--iters N]

Shapes are SmolLM2-135M's attention (9 query heads, 3 KV heads, head size 64). Each line
prints the median and the fastest of N calls in ms. "contiguous SDPA" is the same math on
an unpaged, already-contiguous [B, Hkv, L, D] cache, called the way HF transformers'
decode calls it per layer (query heads packed per KV head, padding mask): the floor that
paging has to approach.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvloom.attention.backend import AttentionLayerSpec, CommonAttentionMetadata
from kvloom_backend_cpu import CPUAttentionBackend

H, HKV, D, BLOCK = 9, 3, 64, 16


def timed(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """Median and minimum wall time of one call, in ms."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), min(samples)


def cpu_ms(fn: Callable[[], object], iters: int) -> float:
    """Process CPU time per call in ms (all threads): steadier than wall time when other
    processes share the cores."""
    start = time.process_time()
    for _ in range(iters):
        fn()
    return (time.process_time() - start) * 1e3 / iters


def make_step(context_lens: list[int], query_lens: list[int], dtype: torch.dtype):
    """A batch with shuffled physical blocks; returns everything forward needs."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = max(-(-s // BLOCK) for s in seq_lens)
    num_blocks = len(seq_lens) * blocks_per_req + 1
    table = torch.randperm(num_blocks)[: len(seq_lens) * blocks_per_req].view(len(seq_lens), -1).to(torch.int32)
    slots = []
    for i, (c, s) in enumerate(zip(context_lens, seq_lens)):
        slots += [int(table[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(c, s)]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seqs = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts, seq_lens=seqs, block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=len(seq_lens),
        num_actual_tokens=len(slots), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seqs,
    )
    spec = AttentionLayerSpec(num_heads=H, num_kv_heads=HKV, head_size=D, dtype=dtype, kv_cache_dtype=dtype,
                              block_size=BLOCK, max_num_seqs=len(seq_lens), max_model_len=max(seq_lens),
                              scale=D**-0.5)
    builder = CPUAttentionBackend.get_builder_cls()(spec, torch.device("cpu"), blocks_per_req)
    impl = CPUAttentionBackend.get_impl_cls()(num_heads=H, head_size=D, scale=D**-0.5, num_kv_heads=HKV)
    cache = torch.randn(CPUAttentionBackend.get_kv_cache_shape(num_blocks, BLOCK, HKV, D)).to(dtype)
    n = len(slots)
    qkv = torch.randn(n, (H + 2 * HKV) * D).to(dtype)  # views of a fused projection, as models pass them
    q = qkv[:, : H * D].view(n, H, D)
    k = qkv[:, H * D : (H + HKV) * D].view(n, HKV, D)
    v = qkv[:, (H + HKV) * D :].view(n, HKV, D)
    return builder, impl, common, cache, q, k, v


def bench(label: str, context_lens: list[int], query_lens: list[int], dtype: torch.dtype, iters: int) -> None:
    builder, impl, common, cache, q, k, v = make_step(context_lens, query_lens, dtype)
    md = builder.build(common)
    out = torch.empty_like(q)
    forward = lambda: impl.forward(q, k, v, cache, md, out)  # noqa: E731
    fwd_med, fwd_min = timed(forward, iters)
    fwd_cpu = cpu_ms(forward, iters)
    bld_med, bld_min = timed(lambda: builder.build(common), iters)
    print(f"{label:<44} forward {fwd_med:8.3f} ms (min {fwd_min:7.3f}, cpu {fwd_cpu:7.3f})"
          f"   builder {bld_med:6.3f} ms (min {bld_min:6.3f})")


def bench_contiguous(label: str, batch: int, seq_len: int, dtype: torch.dtype, iters: int) -> None:
    # HF's decode call with a padding mask: query heads packed per KV head ("pack_gqa").
    q = torch.randn(batch, HKV, H // HKV, D).to(dtype)
    k = torch.randn(batch, HKV, seq_len, D).to(dtype)
    v = torch.randn(batch, HKV, seq_len, D).to(dtype)
    mask = torch.ones(batch, 1, 1, seq_len, dtype=torch.bool)
    fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    med, low = timed(fn, iters)
    print(f"{label:<44} sdpa    {med:8.3f} ms (min {low:7.3f}, cpu {cpu_ms(fn, iters):7.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"H={H} Hkv={HKV} D={D} block={BLOCK}")
    bench("decode B=64 ctx=256", [256] * 64, [1] * 64, dtype, args.iters)
    bench_contiguous("  contiguous SDPA, same shape (floor)", 64, 257, dtype, args.iters)
    bench("decode B=64 ctx=100..1000 (varied)", torch.randint(100, 1001, (64,)).tolist(), [1] * 64, dtype, args.iters)
    bench("decode B=8 ctx=256", [256] * 8, [1] * 8, dtype, args.iters)
    bench("prefill 1 x 512 tokens", [0], [512], dtype, args.iters)
    bench("prefill 4 x 256 tokens", [0] * 4, [256] * 4, dtype, args.iters)
    bench("chunked prefill 512 over 512 cached", [512], [512], dtype, args.iters)
    bench("mixed: 1 chunk 256/ctx 256 + 63 decodes", [256] + [256] * 63, [256] + [1] * 63, dtype, args.iters)


if __name__ == "__main__":
    main()
