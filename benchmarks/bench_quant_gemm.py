#!/usr/bin/env python3
"""The quantized GEMMs of one decode step alone (issue 37): each linear layer of the
Llama-3-8B shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) at 1, 16,
64 and 128 rows (and 4), bf16 (cuBLAS through F.linear) against the kernels of the quantization
plugins as their layers call them: fp8 per-channel and 128x128-block
(``torch.ops.kvloom_quant_fp8.linear``: activation quantizer + split-K Triton GEMM or
``_scaled_mm``), AWQ int4 with groups of 128 (``torch.ops.kvloom_quant_int4.linear``), and, for
reference, the fp8 path before the Triton GEMM (torch's per-token quantization and
``_scaled_mm``). ``--sweep`` also times other launch configs of the fp8 GEMM and ``_scaled_mm`` after the
Triton quantizer (the table that chose ``gemm.gemm_config`` and ``SCALED_MM_MIN_ROWS``).

Each time is one call's share of a CUDA graph of 20 calls (no launch gaps), the median of
triton.testing.do_bench_cudagraph; GB/s are the weight bytes it reads over that time, to set
against the device's read bandwidth (measured here too). The per-step line adds the four
layers times 32.

    python benchmarks/bench_quant_gemm.py --out $OUT/quant_gemm.json [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_limits import measure_read_bandwidth

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
#: --sweep: rows -> launches of the fp8 GEMM tried beside gemm_config's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages,
#: waves); a BLOCK_K other than 128 runs only per-channel weights (the block kernel's K tile is the group).
SWEEP = {
    1: [(16, 16, 512, 4, 4, 1), (16, 32, 256, 4, 4, 1), (16, 32, 256, 4, 4, 2), (16, 32, 512, 4, 3, 1),
        (16, 64, 512, 4, 3, 1), (16, 64, 128, 4, 5, 1), (16, 32, 128, 4, 5, 1), (16, 16, 256, 2, 4, 1)],
    16: [(16, 32, 256, 4, 4, 1), (16, 64, 512, 4, 3, 1), (16, 64, 128, 4, 5, 1), (16, 32, 128, 4, 5, 1)],
    64: [(64, 64, 128, 4, 4, 1), (64, 128, 128, 4, 4, 1), (64, 128, 128, 8, 3, 1), (32, 64, 128, 4, 4, 2),
         (64, 32, 256, 4, 4, 1), (64, 64, 256, 4, 3, 1)],
    128: [(64, 64, 128, 4, 4, 1), (64, 128, 128, 4, 4, 1), (64, 128, 128, 8, 3, 1), (128, 64, 128, 4, 4, 1),
          (128, 128, 128, 8, 4, 1)],
}


def timed(fn: Callable[[], Any], calls: int = 20) -> float:
    """Seconds per call, from a CUDA graph of ``calls`` calls."""
    import triton.testing

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(lambda: [fn() for _ in range(calls)], rep=200) / 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write.")
    parser.add_argument("--rows", default="1,4,16,64,128")
    parser.add_argument("--sweep", action="store_true", help="Also time other fp8 GEMM configs (1 and 16 rows).")
    args = parser.parse_args()
    import kvloom_quant_fp8.gemm as fp8
    from kvloom_quant_fp8.ops import quantize_per_token, quantize_weight
    from kvloom_quant_int4.kernels import op_args
    from kvloom_quant_int4.layout import to_kernel_layout
    from kvloom_quant_int4.packing import quantize_int4

    device = torch.device("cuda")
    read = measure_read_bandwidth(device, 2.0, 25, 200)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0),
                              "torch": torch.__version__, "command": " ".join(["python3", *sys.argv]), "read": read,
                              "rows": []}  # fmt: skip
    for layer, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=device) * k**-0.5
        w16 = w.to(torch.bfloat16)
        wc, sc = quantize_weight(w, "channel")
        wb, sb = quantize_weight(w, "block", (128, 128))
        sb_rows = fp8.row_block_scales(sb, [n], 128)
        u = to_kernel_layout(quantize_int4(w.cpu(), 128, True))
        w4 = op_args(dataclasses.replace(u, **{f: t.to(device) for f, t in u.tensors().items()}))
        del w
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)

            # Every callable below runs (timed) within this iteration: the layer's tensors bound by value.
            def scaled_mm_before(x: torch.Tensor = x, wc: torch.Tensor = wc, sc: torch.Tensor = sc) -> torch.Tensor:
                q, s = quantize_per_token(x)
                return torch._scaled_mm(q, wc.t(), scale_a=s, scale_b=sc.reshape(1, -1), out_dtype=x.dtype,
                                        use_fast_accum=True)  # fmt: skip

            cases: dict[str, tuple[Callable[[], Any], float]] = {
                "bf16": (lambda x=x, w=w16: F.linear(x, w), 2.0),
                "fp8-channel": (lambda x=x, w=wc, s=sc: torch.ops.kvloom_quant_fp8.linear(x, w, s.reshape(-1), 0, None),
                                1.0),
                "fp8-channel-scaled_mm-before": (scaled_mm_before, 1.0),
                "fp8-block": (lambda x=x, w=wb, s=sb_rows: torch.ops.kvloom_quant_fp8.linear(x, w, s, 128, None), 1.0),
                "awq-int4": (lambda x=x, w=w4: torch.ops.kvloom_quant_int4.linear(x, *w), 0.5 + 2.5 / 128),
            }
            for config in SWEEP.get(m, []) if args.sweep else []:
                tag = "x".join(map(str, config))
                for name, (wq, scales, group) in {"channel": (wc, sc.reshape(-1, 1), 0),
                                                  "block": (wb, sb_rows, 128)}.items():  # fmt: skip
                    if group and config[2] != group:
                        continue

                    def swept(x: torch.Tensor = x, wq=wq, scales=scales, group=group, config=config):  # type: ignore[no-untyped-def]
                        q, s = fp8.quantize_activation(x, group)
                        return fp8.fp8_gemm(q, s, wq, scales, x.dtype, group, config)

                    cases[f"fp8-{name}-sweep-{tag}"] = (swept, 1.0)
            if args.sweep and m >= 64:
                def scaled_mm_now(x: torch.Tensor = x, wc: torch.Tensor = wc, sc: torch.Tensor = sc) -> torch.Tensor:
                    q, s = fp8.quantize_activation(x, 0)
                    return torch._scaled_mm(q, wc.t(), scale_a=s, scale_b=sc.reshape(1, -1), out_dtype=x.dtype,
                                            use_fast_accum=True)  # fmt: skip

                cases["fp8-channel-sweep-scaled_mm"] = (scaled_mm_now, 1.0)
            for name, (fn, bytes_per_weight) in cases.items():
                seconds = timed(fn)
                row = {"layer": layer, "n": n, "k": k, "rows": m, "kernel": name, "us": 1e6 * seconds,
                       "GBps": bytes_per_weight * n * k / seconds / 1e9}  # fmt: skip
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    kernels = sorted({r["kernel"] for r in result["rows"] if "sweep" not in r["kernel"]})
    print(f"\n== per decode step (4 layers x {LAYERS}), ms; read bandwidth {read['read_GBps']:.0f} GB/s")
    for m in sorted({r["rows"] for r in result["rows"]}):
        per = {kn: LAYERS * sum(r["us"] for r in result["rows"] if r["rows"] == m and r["kernel"] == kn) / 1e3
               for kn in kernels}  # fmt: skip
        print(f"rows {m:4d}: " + "  ".join(f"{kn} {v:.3f} ({per['bf16'] / v:.2f}x)" for kn, v in per.items()))


if __name__ == "__main__":
    main()
