"""Attention kernels against the GPU's measured ceilings (issue 6, Benchmark 3).

For each backend named with ``--backends`` (looked up by name through kvloom's registry,
driven only through the common contract: builder + impl), and for TRITON_ATTN each kernel
variant named with ``--variants``:

1. correctness first: the worst request's relative error against the float64 reference
   (``kvloom.testing.reference``) on smaller random paged batches (decode, prefill,
   chunked prefill with a cached prefix, a mixed batch), output poisoned with NaN
   beforehand; the cache's unwritten slots hold NaN too, except for backends that read
   whole pages and need them finite (FLEX_ATTENTION: zeros, as the engine allocates the
   cache);
2. decode: batch 64 x context 4096 (Hq 32, Hkv 8, D 128, bf16; each backend at the block
   size the engine would give it, ``preferred_block_size``: 16 for most, 256 for
   FLASH_ATTN, whose kernels take multiples of 256 only; ``--block-size`` forces one):
   achieved GB/s over the K/V bytes that must be read, next to the measured device-copy
   bandwidth (read + write bytes of a large device-to-device copy, same run);
3. prefill: 8 x 2048 fresh prompts: TFLOP/s of causal attention (the FLOPs under the mask)
   next to a measured bf16 GEMM rate;
4. CUDA graphs (``--cuda-graph``, backends that declare support): capture one decode step,
   change every sequence length and block table in place, refresh the builder
   (``build_for_cudagraph_capture``, as the model runner does before every replay),
   replay, compare with eager.

Variants: TRITON_ATTN's kernel configs (``--variants``); FLASH_ATTN's pure-decode kernel
(``--flash-attn-decode-kernels``, default both ``kvcache`` = ``flash_attn_with_kvcache``
and ``varlen`` = ``flash_attn_varlen_func``).

A backend that is not installed, or cannot run the shape here (e.g. its library is
missing), is skipped with the reason logged and kept as an error row in the results.

Times are ``triton.testing.do_bench`` medians of one forward (the cache write of the
step's new tokens included, as the contract does it). Inputs that fit in 4x L2 are
rotated among copies. Prints a table and writes ``attention_kernels.json`` and
``attention_kernels.md`` under ``--out``.

Example (one GPU call)::

    python benchmarks/bench_attention_kernels.py --backends TRITON_ATTN,FLASHINFER,FLEX_ATTENTION,FLASH_ATTN \\
        --variants "default;decode_block_n=32;decode_num_warps=8;decode_num_stages=4;programs_per_sm=8" \\
        --cuda-graph --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from kvloom_registry import PluginError

from kvloom.attention.backend import (
    AttentionCGSupport,
    AttentionLayerSpec,
    AttentionSelectorConfig,
    CommonAttentionMetadata,
)
from kvloom.attention.selector import BackendSelectionError, get_attention_backend
from kvloom.platforms.interface import DeviceCapability
from kvloom.testing.reference import check_paged_case, make_paged_case, relative_error, run_paged_case

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_limits import bench, measure_copy_bandwidth, measure_gemm_rate, synchronize  # noqa: E402, RUF100

logger = logging.getLogger("bench_attention_kernels")

CONFIG_EXTRA_KEY = "triton_attn_config"  # kvloom_backend_triton.builder.CONFIG_EXTRA_KEY
FLASH_ATTN_DECODE_EXTRA_KEY = "flash_attn_decode_kernel"  # kvloom_backend_flash_attn.builder.DECODE_KERNEL_EXTRA_KEY
#: The engine's block size when the user sets none (kvloom.attention.backend.DEFAULT_BLOCK_SIZE).
DEFAULT_BLOCK_SIZE = 16
#: Backends that load whole pages and need the cache's unwritten slots finite (the engine
#: allocates the KV cache with zeros): their correctness cases get zeros there, not NaN.
ZERO_FILLED_CACHE_BACKENDS = frozenset({"FLEX_ATTENTION"})


# --------------------------------------------------------------------------- lookup


def load_backend(name: str) -> type:
    """The backend class registered under ``name``; ``BackendSelectionError`` when no
    installed plugin provides it, a ``PluginError`` when the plugins fail to load."""
    return get_attention_backend(name)


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """One step's inputs on the device (several copies when rotating through L2)."""

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    kv_caches: list[torch.Tensor]
    common: Any
    spec: Any
    kv_bytes_read: int
    flops: float
    extra: dict = field(default_factory=dict)


def make_timing_batch(
    backend: type,
    *,
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    extra: dict,
    l2_bytes: int,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    seed: int = 0,
    num_blocks: int | None = None,
) -> Batch:
    """Random (never zero) paged data, each request on shuffled physical blocks
    (``num_blocks``: cache size, at least what the batch needs). Drawn on the device and
    with no reference output, for timing at full size."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = max(num_blocks or 0, sum(blocks_per_req))
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=device)
    slots = []
    start = 0
    for r, (n, q_len, s_len) in enumerate(zip(blocks_per_req, query_lens, seq_lens)):
        block_table[r, :n] = perm[start : start + n]
        start += n
        pos = torch.arange(s_len - q_len, s_len, device=device)
        slots.append(block_table[r, pos // block_size].long() * block_size + pos % block_size)
    slot_mapping = torch.cat(slots)
    num_tokens = sum(query_lens)

    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    cache_bytes = math.prod(shape) * torch.finfo(dtype).bits // 8
    q_bytes = num_tokens * num_heads * head_size * torch.finfo(dtype).bits // 8
    copies = 1 if cache_bytes + q_bytes >= 4 * l2_bytes else min(8, -(-4 * l2_bytes // (cache_bytes + q_bytes)))

    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=device, dtype=dtype, generator=gen)

    queries = [randn(num_tokens, num_heads, head_size) for _ in range(copies)]
    keys = [randn(num_tokens, num_kv_heads, head_size) for _ in range(copies)]
    values = [randn(num_tokens, num_kv_heads, head_size) for _ in range(copies)]
    kv_caches = [randn(*shape) for _ in range(copies)]

    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=sl.to(device), block_table=block_table,
        slot_mapping=slot_mapping, num_reqs=len(seq_lens), num_actual_tokens=num_tokens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=sl,
    )
    spec = AttentionLayerSpec(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, kv_cache_dtype=dtype,
        block_size=block_size, max_num_seqs=max_num_seqs or len(seq_lens),
        max_model_len=max_model_len or max(seq_lens), scale=head_size**-0.5, extra=dict(extra),
    )
    elt = torch.finfo(dtype).bits // 8
    kv_bytes = sum(seq_lens) * num_kv_heads * head_size * 2 * elt
    # Causal attention: query at position p sees p + 1 keys; QK^T and PV are 2 FLOPs/MAC each.
    visible = sum(sum(range(s - q + 1, s + 1)) for q, s in zip(query_lens, seq_lens))
    flops = 4.0 * visible * num_heads * head_size
    return Batch(queries, keys, values, kv_caches, common, spec, kv_bytes, flops,
                 {"copies": copies, "num_blocks": num_blocks})


def time_forward(
    backend: type, batch: Batch, warmup_ms: int, rep_ms: int, for_cudagraph: bool = False, cuda_graph: bool = False
) -> float:
    """Median ms of one forward. ``for_cudagraph``: with the plan a CUDA graph would get
    (``build_for_cudagraph_capture``). ``cuda_graph`` (CUDA only): the forwards of every
    input copy captured in one graph, its replay timed and divided by the copies, so the
    host's kernel launches (tens of us for a small layer) stay out of the figure."""
    device = batch.queries[0].device
    builder = backend.get_builder_cls()(batch.spec, device, batch.common.block_table.shape[1])
    impl = backend.get_impl_cls()(
        num_heads=batch.spec.num_heads, head_size=batch.spec.head_size, scale=batch.spec.scale,
        num_kv_heads=batch.spec.num_kv_heads,
    )
    metadata = builder.build_for_cudagraph_capture(batch.common) if for_cudagraph else builder.build(batch.common)
    outputs = [torch.empty_like(q) for q in batch.queries]

    def forward(i: int) -> None:
        impl.forward(batch.queries[i], batch.keys[i], batch.values[i], batch.kv_caches[i], metadata, outputs[i])

    copies = len(batch.queries)
    if cuda_graph and device.type == "cuda":
        for i in range(copies):  # JIT and autotuning outside the capture
            forward(i)
        synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(copies):
                forward(i)
        return bench(graph.replay, warmup_ms, rep_ms, device) / copies

    step = [0]

    def run() -> None:
        forward(step[0] % copies)
        step[0] += 1

    run()
    synchronize(device)
    return bench(run, warmup_ms, rep_ms, device)


# --------------------------------------------------------------------------- checks


def correctness(backend: type, device: torch.device, dtype: torch.dtype, shape: dict, extra: dict,
                context: int, prompt: int) -> dict[str, float]:
    """Relative errors on smaller random batches (float64 reference on the CPU); lengths
    scale with the decode context ``context`` and the prompt length ``prompt``."""
    hq, hkv, d, bs = shape["num_heads"], shape["num_kv_heads"], shape["head_size"], shape["block_size"]
    c, p = context, prompt
    cases = {
        "decode": ([1] * 8, [1, c // 241 + 1, c // 13 + 1, c // 4, c // 2 - 1, c * 5 // 8, c * 13 // 16 + 3, c]),
        "prefill": ([p // 4, p // 10 + 1, 77 % p + 1],) * 2,
        "chunked": ([p // 8, p // 20 + 1], [p // 2, p // 3]),
        "mixed": ([1, p // 7 + 1, 1, p // 32 + 1, 1], [c // 4 + 1, p // 7 + 1, c, p // 3, 33]),
    }
    errors: dict[str, float] = {}
    for i, (name, (q_lens, s_lens)) in enumerate(cases.items()):
        case = make_paged_case(
            backend, q_lens, s_lens, num_heads=hq, num_kv_heads=hkv, head_size=d, block_size=bs, dtype=dtype,
            device=device, seed=100 + i, pad_tokens=3, extra=extra,
            fill="zeros" if backend.NAME in ZERO_FILLED_CACHE_BACKENDS else "nan",
        )
        check = check_paged_case(case, run_paged_case(case))
        errors[name] = check.rel_error if check.cache_ok else float("inf")
    return errors


def cuda_graph_check(backend: type, device: torch.device, dtype: torch.dtype, shape: dict, extra: dict,
                     batch: int, context: int, warmup_ms: int, rep_ms: int) -> dict[str, float]:
    """Capture a decode step, then change lengths and block tables in place and replay."""
    if backend.cudagraph_support < AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        return {}
    kw = {"num_heads": shape["num_heads"], "num_kv_heads": shape["num_kv_heads"], "head_size": shape["head_size"],
          "block_size": shape["block_size"], "dtype": dtype, "device": device, "extra": extra, "l2_bytes": 0,
          "max_model_len": context}
    first = make_timing_batch(backend, query_lens=[1] * batch, seq_lens=[context] * batch, seed=1, **kw)
    gen = torch.Generator().manual_seed(2)
    new_lens = torch.randint(1, context + 1, (batch,), generator=gen).tolist()
    second = make_timing_batch(backend, query_lens=[1] * batch, seq_lens=new_lens, seed=3,
                               num_blocks=first.extra["num_blocks"], **kw)

    spec = first.spec
    builder = backend.get_builder_cls()(spec, device, first.common.block_table.shape[1])
    impl = backend.get_impl_cls()(num_heads=spec.num_heads, head_size=spec.head_size, scale=spec.scale,
                                  num_kv_heads=spec.num_kv_heads)
    # Persistent buffers the graph reads, refilled in place like a model runner does.
    common = first.common
    q, k, v, cache = first.queries[0], first.keys[0], first.values[0], first.kv_caches[0]
    out = torch.empty_like(q)
    metadata = builder.build_for_cudagraph_capture(common)
    for _ in range(2):  # compile (JIT) before capturing; the writes land in the same slots
        impl.forward(q, k, v, cache, metadata, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(q, k, v, cache, metadata, out)

    # New step: same batch size, new lengths, tables, slots and data; then the builder
    # refreshes its persistent state for this batch size, as the model runner does
    # before every replay (the contract of build_for_cudagraph_capture).
    sc = second.common
    common.seq_lens.copy_(sc.seq_lens)
    common.seq_lens_cpu.copy_(sc.seq_lens_cpu)
    common.max_seq_len = sc.max_seq_len
    common.block_table.zero_()
    common.block_table[:, : sc.block_table.shape[1]].copy_(sc.block_table)
    common.slot_mapping.copy_(sc.slot_mapping)
    q.copy_(second.queries[0])
    k.copy_(second.keys[0])
    v.copy_(second.values[0])
    cache.copy_(second.kv_caches[0])
    builder.build_for_cudagraph_capture(common)
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()

    eager_out = torch.empty_like(q)
    eager_cache = second.kv_caches[0].clone()
    eager_builder = backend.get_builder_cls()(second.spec, device, sc.block_table.shape[1])
    impl.forward(second.queries[0], second.keys[0], second.values[0], eager_cache, eager_builder.build(sc), eager_out)
    torch.cuda.synchronize()
    result = {"graph_vs_eager_rel_error": relative_error(replayed.float(), eager_out.float())}
    result["graph_decode_ms"] = bench(graph.replay, warmup_ms, rep_ms, device)
    return result


# --------------------------------------------------------------------------- main


def parse_variants(text: str) -> list[tuple[str, dict]]:
    from kvloom_backend_triton.config import parse_overrides

    variants = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        variants.append((item, {} if item == "default" else parse_overrides(item)))
    return variants


def backend_variants(name: str, args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(label, ``AttentionLayerSpec.extra``) for each variant of backend ``name``."""
    if name == "TRITON_ATTN":
        return [(label, {CONFIG_EXTRA_KEY: overrides}) for label, overrides in parse_variants(args.variants)]
    if name == "FLASH_ATTN":
        kernels = [k.strip() for k in args.flash_attn_decode_kernels.split(",") if k.strip()]
        return [(f"decode={k}", {FLASH_ATTN_DECODE_EXTRA_KEY: k}) for k in kernels]
    return [("default", {})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="TRITON_ATTN", help="comma-separated registry names")
    parser.add_argument("--variants", default="default",
                        help="TRITON_ATTN kernel configs, ';'-separated, each 'default' or 'field=value,...'")
    parser.add_argument("--out", default=None, help="directory for attention_kernels.{json,md}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size for every backend (default: each backend's preferred size, "
                             "as the engine picks it)")
    parser.add_argument("--flash-attn-decode-kernels", default="kvcache,varlen",
                        help="FLASH_ATTN pure-decode kernels to time, comma-separated (kvcache, varlen)")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=4096)
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--copy-gib", type=float, default=2.0)
    parser.add_argument("--gemm-n", type=int, default=8192)
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=500)
    parser.add_argument("--cuda-graph", action="store_true", help="also check and time CUDA-graph decode replay")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: smoke-test this script at tiny shapes under TRITON_INTERPRET=1 (no real timing)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_attention_kernels needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)")
        props = torch.cuda.get_device_properties(device)
    else:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
        from kvloom_backend_triton.interpreter_compat import (
            patch_interpreter_scalar_index,
        )

        patch_interpreter_scalar_index()
        props = SimpleNamespace(name="cpu (TRITON_INTERPRET smoke run)", multi_processor_count=8,
                                L2_cache_size=0, major=9, minor=0)
    dtype = getattr(torch, args.dtype)
    heads = {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_size": args.head_size}
    l2_bytes = int(getattr(props, "L2_cache_size", 50 * 2**20))

    started = time.time()
    ceilings = {**measure_copy_bandwidth(device, args.copy_gib, args.warmup_ms, args.rep_ms),
                **measure_gemm_rate(device, args.gemm_n, args.warmup_ms, args.rep_ms)}
    logger.info("device copy %.0f GB/s, bf16 GEMM %.0f TFLOP/s", ceilings["copy_GBps"], ceilings["gemm_TFLOPs"])

    rows = []
    for name in (n.strip() for n in args.backends.split(",") if n.strip()):
        try:
            backend = load_backend(name)
        except (BackendSelectionError, PluginError) as exc:  # not installed, or failed to load: skip it
            logger.warning("skipping %s: %s", name, exc)
            rows.append({"backend": name, "variant": "-", "error": f"not available: {exc}"})
            continue
        block_size = args.block_size
        if block_size is None:
            block_size = backend.preferred_block_size(DEFAULT_BLOCK_SIZE)
        shape = {**heads, "block_size": block_size}
        reasons = backend.validate_configuration(_selector(backend, shape, dtype, props))
        if reasons:
            logger.warning("skipping %s: cannot run this shape here: %s", name, "; ".join(reasons))
            rows.append({"backend": name, "variant": "-", "block_size": block_size, "error": "; ".join(reasons)})
            continue
        for label, extra in backend_variants(name, args):
            row: dict[str, Any] = {"backend": name, "variant": label, "block_size": block_size}
            try:
                if not args.skip_correctness:
                    row["rel_errors"] = correctness(backend, device, dtype, shape, extra,
                                                    args.decode_context, args.prefill_len)
                decode = make_timing_batch(
                    backend, query_lens=[1] * args.decode_batch, seq_lens=[args.decode_context] * args.decode_batch,
                    device=device, dtype=dtype, extra=extra, l2_bytes=l2_bytes, **shape,
                )
                ms = time_forward(backend, decode, args.warmup_ms, args.rep_ms)
                row.update(decode_ms=ms, decode_GBps=decode.kv_bytes_read / ms / 1e6,
                           decode_kv_bytes=decode.kv_bytes_read)
                row["decode_pct_of_copy"] = 100 * row["decode_GBps"] / ceilings["copy_GBps"]
                del decode
                prefill = make_timing_batch(
                    backend, query_lens=[args.prefill_len] * args.prefill_batch,
                    seq_lens=[args.prefill_len] * args.prefill_batch, device=device, dtype=dtype, extra=extra,
                    l2_bytes=l2_bytes, **shape,
                )
                ms = time_forward(backend, prefill, args.warmup_ms, args.rep_ms)
                row.update(prefill_ms=ms, prefill_TFLOPs=prefill.flops / ms / 1e9, prefill_flops=prefill.flops)
                row["prefill_pct_of_gemm"] = 100 * row["prefill_TFLOPs"] / ceilings["gemm_TFLOPs"]
                del prefill
                if args.cuda_graph and device.type == "cuda":
                    row.update(cuda_graph_check(backend, device, dtype, shape, extra, args.decode_batch,
                                                args.decode_context, args.warmup_ms, args.rep_ms))
            except Exception as exc:  # one failing variant must not hide the others' numbers
                logger.exception("%s [%s] failed", name, label)
                row["error"] = f"{type(exc).__name__}: {exc}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)

    result = {
        "device": props.name, "sm_count": props.multi_processor_count, "l2_bytes": l2_bytes,
        "torch": torch.__version__, "triton": _triton_version(), "dtype": args.dtype, "shape": heads,
        "decode": {"batch": args.decode_batch, "context": args.decode_context},
        "prefill": {"batch": args.prefill_batch, "len": args.prefill_len},
        "ceilings": ceilings, "rows": rows, "seconds": time.time() - started,
    }
    table = render_markdown(result)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_kernels.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, "attention_kernels.md"), "w") as f:
            f.write(table + "\n")


def _selector(backend: type, shape: dict, dtype: torch.dtype, props: Any) -> Any:
    return AttentionSelectorConfig(
        head_size=shape["head_size"], dtype=dtype, block_size=shape["block_size"], device_type="cuda",
        device_capability=DeviceCapability(props.major, props.minor), num_heads=shape["num_heads"],
        num_kv_heads=shape["num_kv_heads"],
    )


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def render_markdown(result: dict) -> str:
    c = result["ceilings"]
    d, p, s = result["decode"], result["prefill"], result["shape"]
    lines = [
        (f"## Attention kernels on {result['device']} ({result['dtype']}, Hq {s['num_heads']}, "
         f"Hkv {s['num_kv_heads']}, D {s['head_size']}; KV block size per backend)"),
        "",
        (f"Device copy: {c['copy_GBps']:.0f} GB/s (read+write of {c['copy_bytes'] / 2**30:.1f} GiB); "
         f"bf16 GEMM {c['gemm_n']}^3: {c['gemm_TFLOPs']:.0f} TFLOP/s."),
        (f"Decode: batch {d['batch']} x context {d['context']}, GB/s over the K/V bytes read. "
         f"Prefill: {p['batch']} x {p['len']} fresh prompts, causal FLOPs."),
        "",
        ("| backend | variant | block | max rel err | decode ms | decode GB/s | % copy | graph ms | graph vs eager "
         "| prefill ms | prefill TFLOP/s | % GEMM |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "decode_ms" not in r:
            lines.append(f"| {r['backend']} | {r['variant']} | {r.get('block_size', '-')} | "
                         f"error: {r.get('error', '?')} |||||||||")
            continue
        errs = r.get("rel_errors", {})
        max_err = f"{max(errs.values()):.1e}" if errs else "-"
        graph_ms = f"{r['graph_decode_ms']:.3f}" if "graph_decode_ms" in r else "-"
        graph_err = f"{r['graph_vs_eager_rel_error']:.1e}" if "graph_vs_eager_rel_error" in r else "-"
        prefill = (f"{r['prefill_ms']:.3f} | {r['prefill_TFLOPs']:.1f} | {r['prefill_pct_of_gemm']:.0f}%"
                   if "prefill_ms" in r else "- | - | -")
        lines.append(
            f"| {r['backend']} | {r['variant']} | {r.get('block_size', '-')} | {max_err} | {r['decode_ms']:.3f} | "
            f"{r['decode_GBps']:.0f} | "
            f"{r['decode_pct_of_copy']:.0f}% | {graph_ms} | {graph_err} | {prefill} |"
        )
        if "error" in r:
            lines.append(f"| | | | error after decode: {r['error']} |||||||||")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
