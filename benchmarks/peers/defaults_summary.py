#!/usr/bin/env python3
"""Summarise the compact defaults check of issue 35 (``tests/gpu/run.sh defaults``): kvloom at its defaults only,
the offline nano-vllm workload (``bench_offline.py``) and served concurrency 64 with kvloom's client
(``bench_serving.py``). Prints one table and writes ``summary.json`` beside the inputs.

    python3 benchmarks/peers/defaults_summary.py $OUT/defaults

These are kvloom's numbers alone: no peer ran in the lease, so nothing here is a ratio to a peer (issue 35's
acceptance needs ``stage peers``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def offline_row(data: dict[str, Any]) -> dict[str, Any]:
    rates = [run["output_tok_s"] for run in data.get("runs", [])]
    return {"workload": "offline (nano-vllm, 256 seqs)", "settings": data.get("settings"), "init_s": data.get("init_s"),
            "output_tok_s": statistics.median(rates) if rates else None, "error": data.get("error")}  # fmt: skip


def serving_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for cap, slot in data.get("runs", {}).items():
        for run in slot.get("kvloom", []):
            rows.append({
                "workload": f"served, concurrency {cap}, {slot['num_prompts']} prompts (kvloom bench serve)",
                "settings": data.get("settings"), "startup_s": data.get("startup_s"),
                "output_tok_s": run.get("output_throughput"), "ttft_p50_ms": run.get("ttft_ms", {}).get("median"),
                "tpot_p50_ms": run.get("tpot_ms", {}).get("median"), "itl_p50_ms": run.get("itl_ms", {}).get("median"),
                "itl_p99_ms": run.get("itl_ms", {}).get("p99"), "prefix_cache": run.get("prefix_cache"),
                "error": run.get("error"),
            })  # fmt: skip
    if not rows:
        rows.append({"workload": "served", "startup_s": data.get("startup_s"), "error": data.get("error", "no runs")})
    return rows


def summarise(folder: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    offline, serving = folder / "kvloom_offline.json", folder / "kvloom_serving.json"
    rows.append(offline_row(json.loads(offline.read_text())) if offline.exists()
                else {"workload": "offline", "error": f"{offline.name} missing"})  # fmt: skip
    rows.extend(serving_rows(json.loads(serving.read_text())) if serving.exists()
                else [{"workload": "served", "error": f"{serving.name} missing"}])  # fmt: skip
    return rows


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="The folder with kvloom_offline.json and kvloom_serving.json.")
    args = parser.parse_args()
    rows = summarise(args.folder)
    (args.folder / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("| workload | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | ITL p99 ms | start s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        start = r.get("startup_s", r.get("init_s"))
        print(f"| {r['workload']} | {fmt(r.get('output_tok_s'), ',.0f')} | {fmt(r.get('ttft_p50_ms'), '.1f')} | "
              f"{fmt(r.get('tpot_p50_ms'), '.2f')} | {fmt(r.get('itl_p50_ms'), '.2f')} | "
              f"{fmt(r.get('itl_p99_ms'), '.2f')} | {fmt(start, '.0f')} |" + (f" ERROR: {r['error'][:300]}"
                                                                            if r.get("error") else ""))  # fmt: skip
    sys.exit(1 if any(r.get("error") for r in rows) else 0)


if __name__ == "__main__":
    main()
