"""The MLA decode kernel alone against the copy bandwidth (issue 17).

For each batch x context (defaults: batch 1/16/64/256 x context 1024/4096, DeepSeek-V2-Lite's
attention: 16 heads, kv_lora_rank 512, rope dim 64, bf16, block size 64): a random paged
latent cache (``kvloom.testing.mla_decode.make_decode_case``), then

1. correctness: the first requests' relative error against the float64 reference;
2. time: ``do_bench`` median of one decode launch (split count as the backend plans it for
   this device, plus the reduce when it splits);
3. bandwidth: bytes of latent KV read (every request's ``seq_len x (L + R)`` elements) over
   the time, as GB/s and as % of ``--copy-gbps`` (a device-copy bandwidth measured
   elsewhere, read + write bytes; 3011 GB/s on the H100 of this project).

Next to it FLASHINFER_MLA (``flashinfer.mla.BatchMLAPagedAttentionWrapper``, planned once
outside the timing) when flashinfer imports, on the same cache; otherwise its rows carry the
import error. Writes ``mla_decode.json`` under ``--out`` and prints a table.

CPU smoke (Triton interpreter, tiny shape)::

    TRITON_INTERPRET=1 python benchmarks/bench_mla_decode.py --device cpu --dtype float16 \\
        --batches 2 --contexts 40 --num-heads 4 --kv-lora-rank 32 --rope-dim 16 --block-size 16 --out /tmp/m

On the GPU: ``MLA_ARGS="--variants 'default;decode_num_warps=8'" bash tests/gpu/run.sh mla``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_limits import bench  # noqa: E402

from kvloom.testing.reference import relative_error  # noqa: E402

logger = logging.getLogger("bench_mla_decode")

#: Requests checked against the float64 reference per shape (the reference runs on the CPU).
CHECK_ROWS = 4


def triton_mla_runner(case: Any, args: argparse.Namespace, device: torch.device, variant: str) -> tuple[Any, dict]:
    from kvloom_backend_triton_mla import ops

    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = args.cpu_num_sms
    overrides = ops.parse_overrides(variant) if variant != "default" else None
    cfg = ops.resolve_config(case.q.dtype, overrides)
    num_reqs, num_heads = case.q.shape[:2]
    L = case.kv_lora_rank
    splits = ops.plan_num_kv_splits(num_reqs, num_heads, int(case.seq_lens.max()), num_sms, cfg)
    work = ops.decode_workspace(num_reqs, num_heads, L, splits, device) if splits > 1 else (None, None)
    out = torch.full((num_reqs, num_heads, L), float("nan"), dtype=case.q.dtype, device=device)
    q_nope, q_pe = case.q[..., :L], case.q[..., L:]

    def run() -> torch.Tensor:
        return ops.mla_decode(q_nope, q_pe, case.kv_cache, case.block_table, case.seq_lens, out, case.scale,
                              splits, cfg, *work)

    return run, {"num_kv_splits": splits}


def flashinfer_mla_runner(case: Any, args: argparse.Namespace, device: torch.device, variant: str) -> tuple[Any, dict]:
    import flashinfer.mla  # noqa: F401  (ImportError is reported by the caller)
    from kvloom_backend_flashinfer.mla import FlashInferMLADecoder

    num_reqs, num_heads = case.q.shape[:2]
    L = case.kv_lora_rank
    decoder = FlashInferMLADecoder(device, backend=args.flashinfer_backend)
    seq_lens_cpu = case.seq_lens.cpu()
    decoder.plan_decode(seq_lens_cpu, case.block_table, case.kv_cache.shape[1], num_heads, L,
                        case.q.shape[2] - L, case.scale, case.q.dtype)
    out = torch.empty((num_reqs, num_heads, L), dtype=case.q.dtype, device=device)

    def run() -> torch.Tensor:
        return decoder.run(case.q, case.kv_cache, out)

    return run, {"flashinfer_backend": decoder.backend}


RUNNERS = {"TRITON_MLA": triton_mla_runner, "FLASHINFER_MLA": flashinfer_mla_runner}


def measure(name: str, variant: str, case: Any, args: argparse.Namespace, device: torch.device) -> dict:
    """One kernel on one batch. A kernel that is not importable or fails (e.g. a FlashInfer
    JIT or workspace error) becomes a row with its error, logged, so one failure does not
    cost the other rows of a GPU call."""
    row: dict[str, Any] = {"kernel": name, "variant": variant}
    try:
        run, info = RUNNERS[name](case, args, device, variant)
    except ImportError as exc:
        return {**row, "error": f"not importable: {exc}"}
    except Exception as exc:
        logger.exception("%s [%s] failed to set up", name, variant)
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    row.update(info)
    try:
        out = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rows = min(CHECK_ROWS, case.q.shape[0])
        row["rel_error"] = relative_error(out[:rows], case.reference(rows))
        ms = bench(run, args.warmup_ms, args.rep_ms, device)
    except Exception as exc:
        logger.exception("%s [%s] failed", name, variant)
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    latent_bytes = int(case.seq_lens.sum()) * case.kv_cache.shape[2] * case.kv_cache.element_size()
    gbps = latent_bytes / ms / 1e6
    row.update(ms=ms, latent_bytes=latent_bytes, GBps=gbps, pct_of_copy=100 * gbps / args.copy_gbps)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--copy-gbps", type=float, default=3011.0,
                        help="device-copy bandwidth (read + write bytes per second / 1e9) to compare with")
    parser.add_argument("--variants", default="default",
                        help="TRITON_MLA kernel configs to compare, ';'-separated: 'default' or overrides of "
                             "MLAKernelConfig, e.g. 'default;decode_num_warps=8;decode_block_n=64,decode_num_warps=8'")
    parser.add_argument("--kernels", default="TRITON_MLA,FLASHINFER_MLA")
    parser.add_argument("--flashinfer-backend", default="fa2", help="BatchMLAPagedAttentionWrapper backend")
    parser.add_argument("--cpu-num-sms", type=int, default=4, help="SM count to plan splits for on the CPU")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = torch.device(args.device)
    if device.type == "cpu":
        from kvloom_backend_triton.interpreter_compat import patch_interpreter_scalar_index

        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        patch_interpreter_scalar_index()
    from kvloom.testing.mla_decode import make_decode_case

    dtype = getattr(torch, args.dtype)
    kernels = [k for k in args.kernels.split(",") if k]
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    unknown = set(kernels) - set(RUNNERS)
    if unknown:
        parser.error(f"--kernels: unknown {sorted(unknown)}; choose from {sorted(RUNNERS)}")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            case = make_decode_case([context] * batch, num_heads=args.num_heads, kv_lora_rank=args.kv_lora_rank,
                                    rope_dim=args.rope_dim, block_size=args.block_size, dtype=dtype, device=device,
                                    seed=batch * 7919 + context)
            for name in kernels:
                for variant in variants if name == "TRITON_MLA" else ["default"]:
                    row = {"batch": batch, "context": context, **measure(name, variant, case, args, device)}
                    rows.append(row)
                    label = f"{name}[{variant}]"
                    if "error" in row:
                        logger.info("%-40s B=%-4d ctx=%-5d %s", label, batch, context, row["error"])
                    else:
                        logger.info("%-40s B=%-4d ctx=%-5d %8.4f ms %7.1f GB/s %5.1f%% of copy  rel err %.1e  %s",
                                    label, batch, context, row["ms"], row["GBps"], row["pct_of_copy"],
                                    row["rel_error"],
                                    {k: row[k] for k in ("num_kv_splits", "flashinfer_backend") if k in row})
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "num_heads": args.num_heads, "kv_lora_rank": args.kv_lora_rank,
        "rope_dim": args.rope_dim, "block_size": args.block_size, "copy_gbps": args.copy_gbps,
        "variants": variants, "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mla_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    # FLASHINFER_MLA may be absent (its rows say why); TRITON_MLA is what this measures.
    if any("error" in r for r in rows if r["kernel"] == "TRITON_MLA"):
        sys.exit(1)


if __name__ == "__main__":
    main()
