#!/usr/bin/env python3
"""One attention layer on the shapes of issue 19's engine steps (Llama-3-8B attention).

Where ``bench_attention_kernels.py`` times textbook shapes, this times the two steps the
issue's targets are measured on, one layer of each, through the backend's builder and
impl as the model runner drives them:

* ``decode B``: B requests of one token over ``--context`` cached tokens, with the split
  plan of a CUDA graph (``build_for_cudagraph_capture``, planned for ``--max-model-len``,
  as ``bench_decode_roofline.py``'s graphs run): GB/s over the K/V bytes read, and % of
  the device-copy bandwidth measured in the same run;
* ``mixed P``: ``--decodes`` such decodes plus one ``--chunk``-token prefill chunk after P
  cached tokens (``bench_mixed_step.py``'s step when the long prompt's chunk P/chunk runs),
  with the eager plan (a piecewise step runs attention outside the graphs); next to it the
  same decodes alone (eager plan) and the chunk alone, and the chunk's attention FLOPs at
  the GEMM rate measured in the same run: ``extra us`` = mixed - decodes alone - chunk
  FLOPs at the GEMM rate, what the step's model in ``bench_mixed_step.py`` does not count.

Variants: the backend's kernel configs (TRITON_ATTN: ``KVLOOM_TRITON_ATTN_CONFIG`` syntax,
``;``-separated, e.g. ``"default;prefill_block_n=128"``). Times are ``do_bench`` medians of
one forward (its KV write included), inputs rotated among copies when they fit in L2,
replayed from a CUDA graph: the device time. In the engine the host launches a mixed
step's attention ahead of the device (the step is ~20 ms of device work), so the device
time is what a step pays; ``--eager`` times plain launches instead, host cost included.

    python benchmarks/bench_attention_steps.py --out $OUT [--backend TRITON_ATTN] [--variants ...]

``--device cpu`` runs tiny shapes in the Triton interpreter (``TRITON_INTERPRET=1``): a
smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention_kernels import (  # noqa: E402
    DEFAULT_BLOCK_SIZE,
    backend_variants,
    load_backend,
    make_timing_batch,
    time_forward,
)
from device_limits import measure_copy_bandwidth, measure_gemm_rate  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def step_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """(name, kind, query_lens, seq_lens, for_cudagraph) of every timed batch."""
    ctx = args.context
    cases: list[dict[str, Any]] = []
    for b in _ints(args.decode_batches):
        cases.append({"name": f"decode {b}", "kind": "decode", "query_lens": [1] * b, "seq_lens": [ctx] * b,
                      "for_cudagraph": True})  # fmt: skip
    if args.decodes:
        cases.append({"name": f"decodes {args.decodes} alone", "kind": "decodes_alone",
                      "query_lens": [1] * args.decodes, "seq_lens": [ctx] * args.decodes, "for_cudagraph": False})  # fmt: skip
    for prefix in _ints(args.prefixes):
        chunk = {"query_lens": [args.chunk], "seq_lens": [prefix + args.chunk]}
        cases.append({"name": f"chunk alone P={prefix}", "kind": "chunk", "prefix": prefix, **chunk,
                      "for_cudagraph": False})  # fmt: skip
        cases.append({"name": f"mixed P={prefix}", "kind": "mixed", "prefix": prefix,
                      "query_lens": [1] * args.decodes + chunk["query_lens"],
                      "seq_lens": [ctx] * args.decodes + chunk["seq_lens"], "for_cudagraph": False})  # fmt: skip
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="TRITON_ATTN")
    parser.add_argument("--variants", default="default", help="';'-separated kernel configs (TRITON_ATTN)")
    parser.add_argument("--out", default=None, help="directory for attention_steps.json")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None, help="default: the backend's preferred size")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--context", type=int, default=1056, help="decodes' sequence length (1024 + 32 steps)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="the decode graphs' split plan")
    parser.add_argument("--decode-batches", default="16,64")
    parser.add_argument("--decodes", type=int, default=64, help="decodes in the mixed step")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--prefixes", default="0,1536,3584", help="the chunk's cached prefixes")
    parser.add_argument("--copy-gib", type=float, default=2.0)
    parser.add_argument("--gemm-n", type=int, default=8192)
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=400)
    parser.add_argument("--eager", action="store_true",
                        help="time eager launches (host launch cost included) instead of CUDA-graph replays")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: smoke-test at tiny shapes under TRITON_INTERPRET=1 (no real timing)")
    # backend_variants reads it: FLASH_ATTN's decode through flash_attn_with_kvcache, one variant.
    parser.set_defaults(flash_attn_decode_kernels="kvcache")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
    else:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
        from kvloom_backend_triton.interpreter_compat import patch_interpreter_scalar_index

        patch_interpreter_scalar_index()
        props = SimpleNamespace(name="cpu (TRITON_INTERPRET smoke run)", L2_cache_size=0)
    dtype = getattr(torch, args.dtype)
    l2_bytes = int(getattr(props, "L2_cache_size", 50 * 2**20))
    ceilings = {**measure_copy_bandwidth(device, args.copy_gib, args.warmup_ms, args.rep_ms),
                **measure_gemm_rate(device, args.gemm_n, args.warmup_ms, args.rep_ms)}  # fmt: skip
    copy_bps, gemm_fps = ceilings["copy_GBps"] * 1e9, ceilings["gemm_TFLOPs"] * 1e12

    backend = load_backend(args.backend)
    block_size = args.block_size or backend.preferred_block_size(DEFAULT_BLOCK_SIZE)
    shape = {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_size": args.head_size,
             "block_size": block_size}  # fmt: skip
    cases = step_cases(args)
    rows: list[dict[str, Any]] = []
    for label, extra in backend_variants(args.backend, args):
        times: dict[str, float] = {}
        for case in cases:
            batch = make_timing_batch(
                backend, query_lens=case["query_lens"], seq_lens=case["seq_lens"], device=device, dtype=dtype,
                extra=extra, l2_bytes=l2_bytes, max_model_len=max(args.max_model_len, max(case["seq_lens"])),
                **shape,
            )
            ms = time_forward(backend, batch, args.warmup_ms, args.rep_ms, for_cudagraph=case["for_cudagraph"],
                              cuda_graph=not args.eager)
            times[case["name"]] = ms
            row = {"variant": label, "case": case["name"], "kind": case["kind"], "ms": ms,
                   "kv_GBps": batch.kv_bytes_read / ms / 1e6, "TFLOPs": batch.flops / ms / 1e9}  # fmt: skip
            if case["kind"] == "decode":
                row["pct_of_copy"] = 100 * batch.kv_bytes_read / ms / 1e-3 / copy_bps
            if case["kind"] == "chunk":
                row["chunk_flops"] = batch.flops
                row["pct_of_gemm"] = 100 * batch.flops / (ms * 1e-3) / gemm_fps
            if case["kind"] == "mixed":
                chunk = next(r for r in rows if r["variant"] == label and r["case"] == f"chunk alone P={case['prefix']}")
                alone = times[f"decodes {args.decodes} alone"]
                row["decodes_alone_ms"] = alone
                row["chunk_alone_ms"] = chunk["ms"]
                row["extra_us"] = 1e3 * (ms - alone) - 1e6 * chunk["chunk_flops"] / gemm_fps
            rows.append(row)
            print(json.dumps(row), flush=True)
            del batch
            if device.type == "cuda":
                torch.cuda.empty_cache()

    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": props.name, "torch": torch.__version__,
              "timing": "eager launches" if args.eager else "CUDA-graph replay",
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "backend": args.backend,
              "block_size": block_size, "shape": shape, "ceilings": ceilings, "rows": rows}  # fmt: skip
    print(render(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_steps.json"), "w") as f:
            json.dump(result, f, indent=1)


def render(result: dict[str, Any]) -> str:
    c = result["ceilings"]
    lines = [f"== {result['backend']} on {result['device']}: copy {c['copy_GBps']:.0f} GB/s, GEMM "
             f"{c['gemm_TFLOPs']:.0f} TFLOP/s",
             f"{'variant':>34} {'case':>22} {'us':>8} {'GB/s':>6} {'TFLOP/s':>7} {'%copy':>6} {'%GEMM':>6} "
             f"{'extra us':>8}"]  # fmt: skip
    for r in result["rows"]:
        pct_copy = f"{r['pct_of_copy']:.0f}" if "pct_of_copy" in r else "-"
        pct_gemm = f"{r['pct_of_gemm']:.0f}" if "pct_of_gemm" in r else "-"
        extra = f"{r['extra_us']:.1f}" if "extra_us" in r else "-"
        lines.append(f"{r['variant'][:34]:>34} {r['case']:>22} {1e3 * r['ms']:8.1f} {r['kv_GBps']:6.0f} "
                     f"{r['TFLOPs']:7.1f} {pct_copy:>6} {pct_gemm:>6} {extra:>8}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
