#!/usr/bin/env python3
"""Medians of an A/B run of tests/gpu/run.sh's ``ab`` stage: the base tree against this one.

    python benchmarks/ab_report.py OUT/ab        # prints a Markdown table

Reads ``WORKLOAD/{base,new}/runI/*.json``: the offline nano-vllm workload's output tok/s
(``offline_nanovllm.json``) and the decode step's tok/s per batch (``decode_roofline.json``).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _values(run_dir: Path) -> dict[str, float]:
    """The numbers of one run, by label."""
    values: dict[str, float] = {}
    offline = run_dir / "offline_nanovllm.json"
    if offline.exists():
        for run in json.loads(offline.read_text())["runs"]:
            if "output_tok_s" in run:
                values[f"offline {run['backend']} output tok/s"] = run["output_tok_s"]
    decode = run_dir / "decode_roofline.json"
    if decode.exists():
        for row in json.loads(decode.read_text())["rows"]:
            values[f"decode {row['mode']} batch {row['batch']} tok/s"] = row["tok_s"]
    return values


def collect(root: Path) -> dict[str, dict[str, list[float]]]:
    """label -> tree -> the runs' values, in run order."""
    table: dict[str, dict[str, list[float]]] = {}
    for run_dir in sorted(root.glob("*/*/run*")):
        tree = run_dir.parent.name
        for label, value in _values(run_dir).items():
            table.setdefault(label, {}).setdefault(tree, []).append(value)
    return table


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    table = collect(Path(argv[0]))
    print("| measure | base runs | new runs | base median | new median | new / base |")
    print("|---|---|---|---|---|---|")
    for label, trees in sorted(table.items()):
        base, new = trees.get("base", []), trees.get("new", [])
        if not base or not new:
            print(f"| {label} | {len(base)} | {len(new)} | | | incomplete |")
            continue
        b, n = statistics.median(base), statistics.median(new)
        runs = ", ".join(f"{v:,.0f}" for v in base), ", ".join(f"{v:,.0f}" for v in new)
        print(f"| {label} | {runs[0]} | {runs[1]} | {b:,.0f} | {n:,.0f} | {n / b:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
