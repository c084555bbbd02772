#!/usr/bin/env python3
"""Start-up of the default model on the CPU, as a new user meets it (issue 40).

Each case is a fresh process; the cases of one round run one after the other and the
rounds repeat, so every case sees the same load of a shared machine:

- ``generate-cold``: ``kvloom generate`` with an empty ``KVLOOM_CACHE_DIR`` (the GGUF
  metadata converted, the weights dequantized and cached);
- ``generate-warm``: the same command again on that cache;
- ``llm-mp`` / ``llm-inproc``: a script that makes ``LLM()`` (warm cache) and generates 4
  tokens, with the engine core in a process of its own (the default) or in the script's.

Each row records the wall time to exit, the CPU time (user + system, children included),
the load average before, whether the answer says "Paris", and whether stderr shows an
unclean exit (a C++ abort message, a traceback, a resource-tracker warning).

    python benchmarks/bench_cpu_startup.py [--rounds 3] [--cases generate-cold,...] [--tree DIR] [--out DIR]

``--tree DIR``: run the ``kvloom`` core of another source tree (e.g. ``git worktree add
/tmp/base main``) through ``PYTHONPATH``, with this environment's packages: the
"before" of a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "What is the capital of France?"
GENERATE = ["-m", "kvloom", "generate", "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "16"]
LLM_SCRIPT = (
    "from kvloom import LLM, SamplingParams\n"
    "llm = LLM()\n"
    "out = llm.generate(['The capital of France is'], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)\n"
    "print(out[0].outputs[0].text)\n"
)
CASES = ("generate-cold", "generate-warm", "llm-mp", "llm-inproc")
#: stderr lines that mean the process did not end cleanly.
UNCLEAN_EXIT_MARKERS = ("terminate called", "Traceback (most recent call last)", "resource_tracker", "leaked")


def run_case(case: str, cache: Path, tree: Path | None) -> dict[str, object]:
    env = dict(os.environ, KVLOOM_CACHE_DIR=str(cache))
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "core"), str(tree / "registry"), env.get("PYTHONPATH", "")])
    if case == "generate-cold":
        cache = Path(tempfile.mkdtemp(prefix="cold-", dir=cache.parent))
        env["KVLOOM_CACHE_DIR"] = str(cache)
    if case.startswith("llm-"):
        env["KVLOOM_ENABLE_MULTIPROCESSING"] = "1" if case == "llm-mp" else "0"
        argv = [sys.executable, "-c", LLM_SCRIPT]
    else:
        argv = [sys.executable, *GENERATE]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    unclean = [m for m in UNCLEAN_EXIT_MARKERS if m in proc.stderr]
    return {"case": case, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_1min": round(load, 2),
            "exit": proc.returncode, "paris": "Paris" in proc.stdout, "unclean_exit": unclean}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help=f"Comma-separated, of: {', '.join(CASES)}.")
    parser.add_argument("--tree", type=Path, default=None, help="Source tree whose core runs (default: installed).")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/kvloom-bench")))
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)} (allowed: {', '.join(CASES)})")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        warm_cache = Path(tmp) / "warm"
        if any(c != "generate-cold" for c in cases):  # fill the warm cache first
            run_case("generate-warm", warm_cache, args.tree)
        for round_index in range(args.rounds):
            for case in cases:
                row = {"round": round_index, **run_case(case, warm_cache, args.tree)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "tree": str(args.tree or "installed"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "rows": rows}  # fmt: skip
    (args.out / "cpu_startup.json").write_text(json.dumps(result, indent=1))
    print("\n| case | wall s (each round) | CPU s | load | Paris | unclean exit |\n|---|---|---|---|---|---|")
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        print(f"| {case} | {' / '.join(str(r['wall_s']) for r in mine)} | {' / '.join(str(r['cpu_s']) for r in mine)} "
              f"| {' / '.join(str(r['load_1min']) for r in mine)} | {all(r['paris'] for r in mine)} "
              f"| {sorted({m for r in mine for m in r['unclean_exit']}) or 'none'} |")  # fmt: skip


if __name__ == "__main__":
    main()
