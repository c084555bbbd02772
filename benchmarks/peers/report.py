#!/usr/bin/env python3
"""The peers side by side as markdown: reads the JSON files of ``tests/gpu/run.sh peers`` (``ENGINE_WORKLOAD.json``
for engines vllm and kvloom, workloads offline, decode and serving, plus ``kvloom_decode_steps.json``) from one or
more directories (the later wins on a clash) and writes one table per workload with the engines' versions and flags,
machine, date, command lines and kvloom's ratio to vLLM. A missing file is reported as not measured; a failed run
as its error.

    python benchmarks/peers/report.py DIR [DIR...] [--out docs/benchmarks/peers_h100.md]

Ratios are kvloom / vLLM in throughput: above 1, kvloom is faster (for step times: vLLM's step / kvloom's step).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

ENGINES = ("vllm", "kvloom")
WORKLOADS = ("offline", "decode", "serving")
NANO_VLLM = (
    "nano-vllm is not run: PyPI has no package of GeeeekExplorer/nano-vllm's own code (only forks that change it), "
    "and it needs flash-attn, which has no wheel for the GPU image's torch 2.11 (a ~21 min build per machine); see "
    "benchmarks/peers/README.md."
)

log = logging.getLogger("peers.report")

Results = dict[str, dict[str, Any]]  # "vllm_offline" -> that file's JSON


def load(dirs: list[Path]) -> Results:
    results: Results = {}
    names = [f"{e}_{w}" for w in WORKLOADS for e in ENGINES] + ["kvloom_decode_steps"]
    for d in dirs:
        if not d.is_dir():
            raise SystemExit(f"results directory {d} does not exist")
        for name in names:
            path = d / f"{name}.json"
            if path.exists():
                results[name] = json.loads(path.read_text())
        for path in sorted(d.glob("kvloom-*_serving.json")):  # kvloom variants (PEERS_KVLOOM_EXTRA)
            results[path.stem] = json.loads(path.read_text())
    return results


def _ratio(kvloom: float | None, vllm: float | None) -> str:
    return f"**{kvloom / vllm:.2f}x**" if kvloom and vllm else "–"


def _num(x: float | None, fmt: str = ",.0f") -> str:
    return format(x, fmt) if x is not None else "–"


def _flags(settings: Any) -> str:
    if isinstance(settings, dict):
        return ", ".join(f"`{k}={v}`" for k, v in settings.items())
    return f"`{' '.join(settings)}`" if settings else "–"


def _engine_line(name: str, r: dict[str, Any]) -> str:
    return f"- {r['engine']} {r['version']} ({name}): {_flags(r.get('settings'))}; `{r['command']}`"


def _runs(res: Results, workload: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Each engine's results of ``workload`` (None: not measured), then any kvloom variants (``kvloom-LABEL``), and
    the workload's spec (None: measured by none)."""
    runs = {e: res.get(f"{e}_{workload}") for e in ENGINES}
    suffix = f"_{workload}"
    runs |= {k.removesuffix(suffix): r for k, r in sorted(res.items()) if k.startswith("kvloom-") and k.endswith(suffix)}
    return runs, next((r["spec"] for r in runs.values() if r), None)


def offline_section(res: Results) -> list[str]:
    lines = ["## 1. Offline: nano-vllm's workload", ""]
    runs, spec = _runs(res, "offline")
    if spec is None:
        return lines + ["Not measured.", ""]
    lines += [(f"{spec['model']}, {spec['num_seqs']} sequences, {spec['prompt_tokens']:,} prompt tokens, "
              f"{spec['output_tokens']:,} output tokens, temperature {spec['temperature']}, EOS ignored; the same "
              "prompts for both engines. Each timed run follows a warm-up and a prefix-cache reset."), "",
              "| engine | version | start-up s | output tok/s, each run | best output tok/s | kvloom / vLLM |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    best = {e: max((x["output_tok_s"] for x in r["runs"]), default=None) if r else None for e, r in runs.items()}
    for e, r in runs.items():
        if r is None:
            lines.append(f"| {e} | – | – | not measured | – | – |")
            continue
        each = ", ".join(_num(x["output_tok_s"]) for x in r["runs"]) or "no run"
        ratio = _ratio(best["kvloom"], best["vllm"]) if e == "kvloom" else "1"
        lines.append(f"| {e} | {r['version']} | {r['init_s']:.0f} | {each} | {_num(best[e])} | {ratio} |")
    lines += [""] + [_engine_line("offline", r) for r in runs.values() if r] + [""]
    return lines


def decode_section(res: Results) -> list[str]:
    lines = ["## 3. Decode latency: Llama-3-8B shape", ""]
    runs, spec = _runs(res, "decode")
    steps = res.get("kvloom_decode_steps")
    if spec is None:
        return lines + ["Not measured.", ""]
    lines += [(f"{spec['model']}, prompts of {spec['context']} tokens, greedy. Step time = (T(max_tokens="
              f"{spec['long']}) - T(max_tokens={spec['short']})) / {spec['long'] - spec['short']}, T the median of "
              f"{spec['repeats']} `generate` calls of fresh prompts (mean context {spec['mean_context']:.0f}); the "
              "same code on both engines (benchmarks/peers/bench_decode.py). The last column is kvloom's own "
              "in-engine timing of consecutive engine steps (benchmarks/bench_decode_roofline.py), a cross-check "
              "of the method."), "",
              "| batch | vLLM step ms | kvloom step ms | kvloom / vLLM (tok/s) | kvloom engine-step ms |",
              "|---|---|---|---|---|"]  # fmt: skip
    by_batch = {e: {row["batch"]: row["step_s"] for row in r["rows"]} if r else {} for e, r in runs.items()}
    step_rows = {row["batch"]: row["mean_s"] for row in (steps or {}).get("rows", [])}
    for batch in sorted(set(by_batch["vllm"]) | set(by_batch["kvloom"]) | set(step_rows)):
        v, k, s = by_batch["vllm"].get(batch), by_batch["kvloom"].get(batch), step_rows.get(batch)
        # throughput ratio kvloom / vLLM = vLLM step / kvloom step
        lines.append(f"| {batch} | {_num(v and 1e3 * v, '.2f')} | {_num(k and 1e3 * k, '.2f')} | {_ratio(v, k)} | "
                     f"{_num(s and 1e3 * s, '.2f')} |")  # fmt: skip
    lines += [""] + [_engine_line("decode", r) for r in runs.values() if r]
    if steps:
        lines.append(f"- kvloom engine steps: `{steps['command']}`")
    return lines + [""]


def serving_section(res: Results) -> list[str]:
    lines = ["## 2. Serving: each engine's OpenAI server, one client", ""]
    runs, spec = _runs(res, "serving")
    if spec is None:
        return lines + ["Not measured.", ""]
    lines += [(f"{spec['model']}, tokenizer `{spec['tokenizer']}`, {spec['num_prompts']:,} requests of "
              f"{spec['input_len']} tokens in and {spec['output_len']} out (EOS ignored, streamed), driven by "
              "`kvloom bench serve` against each server in turn."), "",
              ("| concurrency | engine | server start s | completed (failed) | output tok/s | TTFT p50 ms | TPOT p50 ms "
              "| ITL p99 ms | kvloom / vLLM |"), "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    keys = sorted({k for r in runs.values() if r for k in r["runs"]}, key=lambda k: (k != "inf", k.zfill(8)))
    for key in keys:
        tput = {e: r["runs"][key].get("output_throughput") if r and key in r["runs"] else None for e, r in runs.items()}
        for e, r in runs.items():
            run = r["runs"].get(key) if r else None
            if run is None:
                lines.append(f"| {key} | {e} | – | not measured | – | – | – | – | – |")
            elif "error" in run:
                lines.append(
                    f"| {key} | {e} | {r['startup_s']:.0f} | failed: {run['error'][:120]!r} | – | – | – | – | – |"
                )
            else:
                ratio = _ratio(tput[e], tput["vllm"]) if e != "vllm" else "1"
                lines.append(f"| {key} | {e} | {r['startup_s']:.0f} | {run['completed']} ({run['failed']}) | "
                             f"{run['output_throughput']:,.0f} | {run['ttft_ms']['p50']:.1f} | "
                             f"{run['tpot_ms']['p50']:.2f} | {run['itl_ms']['p99']:.1f} | {ratio} |")  # fmt: skip
    lines.append("")
    for e, r in runs.items():
        if r is None:
            continue
        lines.append(f"- {e} ({r['engine']} {r['version']}) server: `{r['server_command']}`")
        if "error" in r:
            lines.append(f"  - FAILED: `{r['error'][:300]}`")
    client = next((run["client_command"] for r in runs.values() if r for run in r["runs"].values()
                   if "client_command" in run), None)  # fmt: skip
    if client:
        lines.append(f"- client (one of the runs): `{client}`")
    return lines + [""]


def render(res: Results) -> str:
    if not res:
        raise SystemExit("no peer results found (expected ENGINE_WORKLOAD.json files from tests/gpu/run.sh peers)")
    machines = sorted({f"{r['gpu']}, torch {r['torch']}" for r in res.values() if "gpu" in r})
    dates = sorted({r["date"] for r in res.values() if "date" in r})
    versions = sorted({f"{r['engine']} {r['version']}" for r in res.values() if "engine" in r})
    lines = ["# kvloom and its peers side by side on the H100", "",
             f"Machine: {'; '.join(machines)}. Runs: {dates[0]} to {dates[-1]}. Engines: {', '.join(versions)}.",
             ("Written by `python benchmarks/peers/report.py` from the JSON files of `bash tests/gpu/run.sh peers` "
             "(vLLM, then kvloom, on one machine, back to back); the device calls are in the README's GPU section."),
             ("vLLM runs at its defaults (`-O2`: torch.compile, FULL_AND_PIECEWISE CUDA graphs); kvloom with "
             "`TRITON_ATTN`, async scheduling and CUDA graphs. Ratios are kvloom / vLLM in throughput (above 1: "
             "kvloom faster)."), "", NANO_VLLM, ""]  # fmt: skip
    if len(machines) > 1:
        lines += [(f"**Warning**: the results come from {len(machines)} different machines; ratios across them "
                  "compare machines too."), ""]  # fmt: skip
    lines += offline_section(res) + serving_section(res) + decode_section(res)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="Directories with the peers' JSON files.")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[2] / "docs/benchmarks/peers_h100.md"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.write_text(render(load(args.dirs)))
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
