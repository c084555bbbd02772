#!/usr/bin/env python3
"""Offline and served throughput on one workload, in one run, side by side.

The workload of the process-architecture issue: the Qwen3-0.6B shape with dummy bf16
weights, ``--num-prompts`` requests of ``--input-len`` tokens in and ``--output-len`` out
(greedy, EOS ignored). First ``kvloom bench throughput`` (offline ``LLM``), then
``kvloom serve`` with the same engine flags, driven by ``kvloom bench serve`` with all
requests at once and at each ``--concurrency``. Every piece runs in its own process (the
bench client never shares the server's interpreter), one after the other on one machine.

    python benchmarks/bench_serving.py --tokenizer TOKENIZER_DIR --out $OUT \\
        [--engine-args "--async-scheduling --max-model-len 2048 --max-num-seqs 256"] [--concurrency inf,1,16,64,256]

``--serve-args`` may be repeated (``--serve-args "" --serve-args "--api-server-count 2"``):
one server per value, one after the other, against the same offline runs.
``TOKENIZER_DIR`` holds the tokenizer files the served model uses (the vLLM peer's numbers
in ``docs/benchmarks/`` used SmolLM2's, saved from the GGUF). Writes ``serving.json`` and
prints a table (also in ``serving.md``): output tok/s, the ratio to offline, TTFT / TPOT medians and p99 ITL, and
the offline decode step at the batch size of each concurrency (``kvloom bench
throughput`` with that many prompts: its wall time over the output length), for the
"TPOT within 1.3x of the offline step" target.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pstats
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline_nanovllm import write_qwen3_config  # noqa: E402

from kvloom.testing.install import KvloomServer  # noqa: E402


def kvloom(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvloom.entrypoints.cli.main", *args]


def run_logged(cmd: list[str], log: Path, timeout: float) -> None:
    """Run ``cmd`` to completion, its output in ``log``; raise with the log's tail if it fails."""
    with open(log, "w") as f:
        status = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if status != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {status}:\n{log.read_text()[-3000:]}")


def offline(model_dir: Path, engine_args: list[str], num_prompts: int, args: argparse.Namespace, out: Path) -> dict:
    path = out / f"offline_{num_prompts}.json"
    run_logged(kvloom("bench", "throughput", "--model", str(model_dir), *engine_args, "--num-prompts", str(num_prompts),
                      "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--json", str(path)),
               out / f"offline_{num_prompts}.log", args.timeout)  # fmt: skip
    result = json.loads(path.read_text())["kvloom"]
    result["step_ms"] = 1000 * result["wall_s"] / args.output_len  # prefill included: an upper bound of the step
    return result


def with_tokenizer(model_dir: Path, tokenizer_dir: str | Path) -> Path:
    """``model_dir`` (a config written for dummy weights) with the tokenizer files of
    ``tokenizer_dir`` copied in."""
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, model_dir / f.name)
    return model_dir


def start_server(model_dir: Path, engine_args: list[str], serve_args: list[str], workdir: Path,
                 profile: Path | None) -> KvloomServer:  # fmt: skip
    """``kvloom serve`` on a free port, healthy (``kvloom.testing.install.KvloomServer``),
    with this process's ``KVLOOM_*`` variables (the GPU runner's cache directory, ...)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("KVLOOM_")}
    if profile is not None:  # every API server and engine core writes its cProfile there (kvloom.profiling)
        profile.mkdir(parents=True, exist_ok=True)
        env["KVLOOM_CPROFILE_DIR"] = str(profile)
    return KvloomServer([str(model_dir), *engine_args, *serve_args], workdir, **env).__enter__()


def served(port: int, concurrency: float, num_prompts: int, args: argparse.Namespace, out: Path) -> dict:
    name = "inf" if math.isinf(concurrency) else str(int(concurrency))
    path = out / f"served_{name}.json"
    cap = [] if math.isinf(concurrency) else ["--max-concurrency", name]
    run_logged(kvloom("bench", "serve", "--port", str(port), "--num-prompts", str(num_prompts), "--input-len",
                      str(args.input_len), "--output-len", str(args.output_len), *cap, "--json", str(path)),
               out / f"served_{name}.log", args.timeout)  # fmt: skip
    return json.loads(path.read_text())


def write_profile(profile_dir: Path, path: Path, top: int = 30) -> None:
    """Every process's profile (``<role>_<index>_<pid>.prof``) as one text file: its top
    functions by own time and by cumulative time."""
    text = io.StringIO()
    for prof in sorted(profile_dir.glob("*.prof")):
        text.write(f"\n#################### {prof.stem}\n")
        stats = pstats.Stats(str(prof), stream=text)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
    path.write_text(text.getvalue())


def prompts_for(concurrency: float, total: int) -> int:
    """Enough requests for a steady state at that concurrency, without running for minutes
    at concurrency 1: eight rounds of ``concurrency`` requests, at most ``total``."""
    return total if math.isinf(concurrency) else min(total, max(8, 8 * int(concurrency)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="Directory with the tokenizer files to serve with.")
    parser.add_argument("--model", help="A model directory to use instead of the Qwen3-0.6B shape (a smoke test).")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", default="inf,1,16,64,256",
                        help="Comma-separated max concurrencies for the served runs; inf = all at once.")  # fmt: skip
    parser.add_argument("--engine-args", default="--async-scheduling --max-model-len 2048 --max-num-seqs 256",
                        help="Engine flags for both paths (dummy weights and bf16 are set here; a later --dtype wins).")  # fmt: skip
    parser.add_argument("--serve-args", action="append", default=None,
                        help="Extra flags for kvloom serve only (--api-server-count 2); repeat it to serve once per "
                             "value, each against the same offline runs (default: one server, no extra flags).")  # fmt: skip
    parser.add_argument("--profile-server", action="store_true",
                        help="Profile every API server and engine core process (KVLOOM_CPROFILE_DIR); their top "
                             "functions go to server_profile.txt.")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=420.0, help="Seconds each piece may take.")
    args = parser.parse_args()
    args.serve_args = args.serve_args or [""]
    if (args.model is None) == (args.tokenizer is None):
        parser.error("give --tokenizer (the Qwen3-0.6B shape with that tokenizer) or --model, not both")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    concurrencies = [math.inf if c.strip() == "inf" else float(int(c)) for c in args.concurrency.split(",")]
    engine_args = ["--load-format", "dummy", "--dtype", "bfloat16", *shlex.split(args.engine_args)]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "command": shlex.join([Path(sys.executable).name,
                              *sys.argv]), "engine_args": engine_args, "offline": {}, "served": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)  # each piece's JSON and log; what is kept goes to serving.json (and serve.log)
        if args.model is not None:
            model_dir = Path(args.model)
        else:
            model_dir = with_tokenizer(write_qwen3_config(Path(tmp) / "qwen3-0.6b-shape"), args.tokenizer)
        batch_sizes = sorted({args.num_prompts, *(int(c) for c in concurrencies if not math.isinf(c))})
        for n in batch_sizes:
            result["offline"][n] = offline(model_dir, engine_args, n, args, work)
            print(f"offline {n}: {result['offline'][n]['output_tok_s']:.0f} tok/s", flush=True)
        for i, serve_args in enumerate(args.serve_args):
            label = serve_args or "kvloom serve"
            runs = result["served"][label] = {}
            profile = work / f"profiles{i}" if args.profile_server else None
            suffix = f"_{i}" if len(args.serve_args) > 1 else ""
            server = start_server(model_dir, engine_args, shlex.split(serve_args), work, profile)
            try:
                for c in concurrencies:
                    key = "inf" if math.isinf(c) else int(c)
                    runs[key] = served(server.port, c, prompts_for(c, args.num_prompts), args, work)
                    print(f"served {label!r} {key}: {runs[key]['output_throughput']:.0f} tok/s", flush=True)
            finally:
                server.stop()
                shutil.copy(server.log_path, out / f"serve{suffix}.log")
            if profile is not None:
                write_profile(profile, out / f"server_profile{suffix}.txt")
    (out / "serving.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "serving.md").write_text(table(result, args.num_prompts) + "\n")
    print(table(result, args.num_prompts))
    return 0


def table(result: dict[str, Any], num_prompts: int) -> str:
    full = result["offline"][num_prompts]
    lines = [f"offline ({num_prompts} prompts): {full['output_tok_s']:.0f} output tok/s", "",
             "| server | concurrency | requests | output tok/s | / offline | TTFT p50 ms | TPOT p50 ms | ITL p99 ms "
             "| offline step at that batch, ms | TPOT / step |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, key, s in [(label, key, s) for label, runs in result["served"].items() for key, s in runs.items()]:
        step = result["offline"].get(key if key != "inf" else num_prompts, {}).get("step_ms")
        tpot = s["tpot_ms"]["median"]
        lines.append(f"| {label} | {key} | {s['completed']} ({s['failed']} failed) | {s['output_throughput']:.0f} | "
                     f"{s['output_throughput'] / full['output_tok_s']:.2f} | {s['ttft_ms']['median']:.1f} | {tpot:.2f} | "
                     f"{s['itl_ms']['p99']:.1f} | {f'{step:.2f}' if step else '-'} | "
                     f"{f'{tpot / step:.2f}' if step else '-'} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
