"""The ``fused_moe`` custom op: the CUDA platform's Triton grouped GEMMs against the torch path
(``kvloom.layers.fused_moe.fused_moe_torch``: a loop over the experts with tokens, three
``torch.mm``-class GEMMs each), on one MoE layer of DeepSeek-V2-Lite's shape (hidden 2048,
moe_intermediate 1408, 64 routed experts, top-6, bf16) at 1, 16, 64 and 256 tokens.

For each batch: softmax top-6 routing of random router logits; correctness first (both
paths within ``check_custom_op``'s tolerance of the float64 definition); then the median
time of each path (``triton.testing.do_bench``: CUDA events, L2 flushed between calls), of
the Triton op replayed in a CUDA graph (as decode steps run it), the speedup over the
torch loop, and the bytes of the experts the batch touches (each read once: the floor)
over the Triton time, next to the measured device-copy bandwidth.

Writes JSON to ``--out`` (a file path). ``--device cpu`` is a smoke test: a tiny shape
(``--tiny``), the Triton kernels in Triton's interpreter, wall-clock timing, no graphs.

Example (GPU)::

    python benchmarks/bench_fused_moe.py --out "$OUT/fused_moe.json"
    python benchmarks/bench_fused_moe.py --device cpu --out /tmp/fused_moe_cpu.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_limits import bench, measure_copy_bandwidth  # noqa: E402
from kernel_bench_cli import kernel_bench_device, kernel_bench_parser, write_result  # noqa: E402

logger = logging.getLogger("bench_fused_moe")

#: DeepSeek-V2-Lite's routed experts (per layer).
LITE = {"hidden": 2048, "intermediate": 1408, "experts": 64, "top_k": 6}
#: The CPU smoke test's shape.
TINY = {"hidden": 64, "intermediate": 32, "experts": 8, "top_k": 2}


def make_layer(shape: dict[str, int], dtype: torch.dtype, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["intermediate"]
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=device) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen, device=device) * i**-0.5).to(dtype)
    return w13, w2


def measure(batch: int, shape: dict[str, int], w13: torch.Tensor, w2: torch.Tensor, device: torch.device,
            args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    from kvloom_platform_cuda.fused_moe import fused_moe

    from kvloom.interfaces.models import select_experts
    from kvloom.testing import check_custom_op, custom_op_reference

    fused_moe_torch = custom_op_reference("fused_moe")

    gen = torch.Generator(device=device).manual_seed(batch)
    hidden = torch.randn(batch, shape["hidden"], generator=gen, device=device).to(w13.dtype)
    logits = torch.randn(batch, shape["experts"], generator=gen, device=device)
    weights, ids = select_experts(logits, shape["top_k"], renormalize=False)
    triton_check = check_custom_op("fused_moe", fused_moe, hidden, w13, w2, weights, ids)
    torch_check = check_custom_op("fused_moe", fused_moe_torch, hidden, w13, w2, weights, ids)

    touched = int(torch.unique(ids).numel())
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    moved = touched * expert_bytes + 2 * hidden.numel() * hidden.element_size()
    row: dict[str, Any] = {
        "tokens": batch, "experts_touched": touched, "bytes_touched": moved,
        "triton_max_rel": triton_check["max_rel"], "torch_max_rel": torch_check["max_rel"],
    }  # fmt: skip
    row["torch_ms"] = bench(lambda: fused_moe_torch(hidden, w13, w2, weights, ids), args.warmup_ms, args.rep_ms, device)
    row["triton_ms"] = bench(lambda: fused_moe(hidden, w13, w2, weights, ids), args.warmup_ms, args.rep_ms, device)
    row["speedup"] = row["torch_ms"] / row["triton_ms"]
    row["triton_GBps"] = moved / row["triton_ms"] / 1e6
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(hidden, w13, w2, weights, ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe(hidden, w13, w2, weights, ids)), "graph replay differs from eager"
        row["triton_graph_ms"] = bench(graph.replay, args.warmup_ms, args.rep_ms, device)
        row["graph_speedup"] = row["torch_ms"] / row["triton_graph_ms"]
        row["triton_graph_GBps"] = moved / row["triton_graph_ms"] / 1e6
    return row


def main() -> None:
    parser = kernel_bench_parser(__doc__, batches="1,16,64,256")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (default on the CPU)")
    args = parser.parse_args()
    device = kernel_bench_device(args)  # before kvloom_platform_cuda.fused_moe defines its kernels
    shape = TINY if (args.tiny or device.type == "cpu") else LITE
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "shape": shape, "dtype": args.dtype, "rows": [],
    }  # fmt: skip
    if device.type == "cuda":
        result["copy"] = measure_copy_bandwidth(device, 1.0, args.warmup_ms, args.rep_ms)
    w13, w2 = make_layer(shape, dtype, device, seed=0)
    logger.info("%6s %8s %10s %10s %10s %8s %8s %10s", "tokens", "experts", "torch_ms", "triton_ms", "graph_ms",
                "speedup", "GB/s", "graph GB/s")  # fmt: skip
    for batch in batches:
        row = measure(batch, shape, w13, w2, device, args)
        result["rows"].append(row)
        logger.info("%6d %8d %10.4f %10.4f %10s %8.2f %8.0f %10s", batch, row["experts_touched"], row["torch_ms"],
                    row["triton_ms"], f"{row.get('triton_graph_ms', float('nan')):.4f}", row["speedup"],
                    row["triton_GBps"], f"{row.get('triton_graph_GBps', float('nan')):.0f}")  # fmt: skip
    if "copy" in result:
        bw = result["copy"]["copy_GBps"]
        logger.info("device copy bandwidth %.0f GB/s (read + write)", bw)
        for row in result["rows"]:
            row["graph_fraction_of_copy_bw"] = row["triton_graph_GBps"] / bw
    write_result(args.out, result)


if __name__ == "__main__":
    main()
