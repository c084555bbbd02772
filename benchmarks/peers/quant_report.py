#!/usr/bin/env python3
"""Quantized decode against bf16 (issue 37), from the bench_decode.py results of ``tests/gpu/run.sh quant-decode``:
every JSON in DIR whose spec names a quantization or a KV cache dtype. For each engine and lease, each row (batch,
context, quantization, KV dtype) is divided into the same engine's bf16 row (same batch and context, bf16 KV) of the
same lease: speed-up = bf16 step / this step, and its byte ceiling = bf16 bytes / these bytes (what the step would
gain if it ran at the same bandwidth). Where vLLM ran the same config in the same lease, kvloom / vLLM is the ratio
of their steps (above 1: kvloom faster).

    python benchmarks/peers/quant_report.py DIR [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

Key = tuple[str, int, float, str, str]  # lease, batch, context, quantization, kv_cache_dtype


def load(directory: Path) -> dict[str, dict[Key, dict[str, Any]]]:
    """engine -> (lease, batch, context, quantization, kv dtype) -> row (with ``step_s`` and ``total_bytes``)."""
    rows: dict[str, dict[Key, dict[str, Any]]] = {}
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        spec = data.get("spec", {})
        if data.get("workload") != "decode" or "quantization" not in spec:
            continue
        for row in data["rows"]:
            key = (data["lease"], row["batch"], spec["context"], spec["quantization"], spec["kv_cache_dtype"])
            rows.setdefault(data["engine"], {})[key] = row
    return rows


def table(rows: dict[str, dict[Key, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One line per engine and quantized (or fp8-KV) row that has a bf16 row to divide into."""
    lines = []
    for engine, by_key in sorted(rows.items()):
        for key, row in sorted(by_key.items()):
            lease, batch, context, quantization, kv = key
            base = by_key.get((lease, batch, context, "none", "auto"))
            if base is None or base is row:
                continue
            peer = rows.get("vllm", {}).get(key) if engine == "kvloom" else None
            lines.append({
                "engine": engine, "lease": lease, "batch": batch, "context": context, "quantization": quantization,
                "kv_cache_dtype": kv, "step_ms": 1e3 * row["step_s"], "bf16_step_ms": 1e3 * base["step_s"],
                "speedup": base["step_s"] / row["step_s"], "ceiling": base["total_bytes"] / row["total_bytes"],
                "vs_vllm": peer["step_s"] / row["step_s"] if peer else None,
            })  # fmt: skip
    return lines


def markdown(lines: list[dict[str, Any]]) -> str:
    out = [
        "| engine | batch | context | weights | KV | step ms | bf16 step ms | speed-up | byte ceiling | kvloom / vLLM |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for x in lines:
        peer = f"{x['vs_vllm']:.2f}x" if x["vs_vllm"] is not None else "not measured"
        out.append(
            f"| {x['engine']} | {x['batch']} | {x['context']} | {x['quantization']} | {x['kv_cache_dtype']} | "
            f"{x['step_ms']:.2f} | {x['bf16_step_ms']:.2f} | {x['speedup']:.2f}x | {x['ceiling']:.2f}x | {peer} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--markdown", type=Path, default=None, help="Also write the table to this file.")
    args = parser.parse_args()
    if not args.directory.is_dir():
        raise SystemExit(f"results directory {args.directory} does not exist")
    text = markdown(table(load(args.directory)))
    print(text, end="")
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
