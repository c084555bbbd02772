"""GGUF on the CPU: kvloom with kvloom-quant-gguf (the file's quantized weights as stored)
against kvloom's dequantized float32 path (``--quantization none``), HF transformers (the
same GGUF dequantized to float32) and, when ``llama_cpp`` imports, llama.cpp (its batched
low-level API, ``benchmarks/llama_cpp_batched.py``), all at the same thread count, on the
default model unless ``--model`` says otherwise.

Workloads (random prompt tokens, greedy, EOS ignored):

* decode at batch 1 and batch 16: ``(time for N tokens - time for 1 token)`` per step,
  so prefill is not counted;
* prefill: one 512-token prompt, one output token;
* offline: 64 prompts of 128 tokens, 128 new tokens each, all submitted at once (the
  workload of ``docs/benchmarks/cpu_throughput.md``): input plus output tokens per second
  of the whole run.

Every engine runs on ``--threads`` threads (kvloom's engine core through
``KVLOOM_CPU_THREADS``, which otherwise subtracts the load average); ``--repeats N`` reports
each workload's median of N runs.

Usage: ``python benchmarks/bench_gguf_cpu.py [--model X.gguf] [--threads 2] [--repeats 3]
[--engines gguf,hf] [--workloads "decode batch 1,offline 64"] [--markdown docs/benchmarks/cpu_gguf.md]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvloom.entrypoints.cli.bench_throughput import _hf_model, make_prompts, report_header

#: (name, prompts, input tokens, output tokens)
WORKLOADS = (
    ("decode batch 1", 1, 32, 33),
    ("decode batch 16", 16, 32, 17),
    ("prefill 512", 1, 512, 1),
    ("offline 64", 64, 128, 128),
)

Runner = Callable[[list[list[int]], int], float]  # (prompts, output tokens) -> seconds


def kvloom_runner(model: str | None, quantization: str | None) -> tuple[Runner, Any]:
    from kvloom import LLM, SamplingParams

    kwargs: dict[str, Any] = {"dtype": "float32", "quantization": quantization}
    if model:
        kwargs["model"] = model
    llm = LLM(**kwargs)

    def run(prompts: list[list[int]], output_len: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.llm_engine.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    run([[100, 200, 300]], 4)  # warm-up: kernels built, caches filled
    return run, llm


def hf_runner(path: str) -> Runner:
    model = _hf_model({"model": path, "dtype": "float32", "device_type": "cpu"})

    def run(prompts: list[list[int]], output_len: int) -> float:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                           min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        return time.perf_counter() - start

    run([[100, 200, 300]], 2)
    return run


def llama_cpp_runner(path: str, threads: int) -> Runner | None:
    try:
        from llama_cpp_batched import LlamaCppBatched
    except ImportError:
        return None
    llama = LlamaCppBatched(path, threads, n_seq_max=max(n for _, n, _, _ in WORKLOADS),
                            seq_len=max(i + o for _, _, i, o in WORKLOADS))  # fmt: skip

    def run(prompts: list[list[int]], output_len: int) -> float:
        start = time.perf_counter()
        llama.generate(prompts, output_len)
        return time.perf_counter() - start

    run([[100, 200, 300]], 2)
    return run


def measure(workload: str, run: Runner, prompts: list[list[int]], output_len: int, repeats: int) -> dict[str, float]:
    """The workload's rate, the median of ``repeats`` runs (a shared machine's noise)."""
    runs = [measure_once(workload, run, prompts, output_len) for _ in range(repeats)]
    key = next(k for k in runs[0] if k.endswith("tok_s"))
    runs.sort(key=lambda r: r[key])
    return {**runs[len(runs) // 2], f"all_{key}": [round(r[key], 1) for r in runs]}


def measure_once(workload: str, run: Runner, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    if workload.startswith("offline"):
        wall = run(prompts, output_len)
        return {"wall_s": wall, "total_tok_s": len(prompts) * (len(prompts[0]) + output_len) / wall}
    if output_len == 1:
        wall = run(prompts, 1)
        return {"wall_s": wall, "prefill_tok_s": sum(map(len, prompts)) / wall}
    first = run(prompts, 1)
    wall = run(prompts, output_len)
    return {"wall_s": wall, "decode_tok_s": len(prompts) * (output_len - 1) / (wall - first)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="A .gguf file (default: the default model).")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--engines", default="gguf,dequantized,hf,llama.cpp",
                        help="Which to run, comma-separated (default: all of gguf, dequantized, hf, llama.cpp).")
    parser.add_argument("--workloads", default=",".join(w for w, *_ in WORKLOADS),
                        help="Which workloads, comma-separated (default: all).")
    parser.add_argument("--repeats", type=int, default=1, help="Runs per workload; the median is reported.")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--markdown", default=None, help="Append the results here (with machine, date, command).")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    # The engine core's worker (its own process) takes its threads from here, not from the
    # load average it would otherwise subtract: every engine runs on ns.threads threads.
    os.environ["KVLOOM_CPU_THREADS"] = str(ns.threads)
    chosen = set(ns.engines.split(",")) - ({"hf"} if ns.skip_hf else set())
    workloads = [w for w in WORKLOADS if w[0] in ns.workloads.split(",")]

    results: dict[str, dict[str, dict[str, float]]] = {}
    gguf_run, llm = kvloom_runner(ns.model, None)
    config = llm.config
    path = str(config.model.model)
    engines: list[tuple[str, str, Callable[[], Runner | None]]] = [
        ("gguf", "kvloom, kvloom-quant-gguf", lambda: gguf_run),
        ("dequantized", "kvloom, dequantized fp32 (--quantization none)", lambda: kvloom_runner(path, "none")[0]),
        ("hf", "HF transformers fp32", lambda: hf_runner(path)),
        ("llama.cpp", "llama.cpp (llama-cpp-python, batched low-level API)", lambda: llama_cpp_runner(path, ns.threads)),
    ]
    for key, name, make in engines:
        if key not in chosen:
            continue
        run = make()
        if run is None:
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        results[name] = {}
        for workload, n, input_len, output_len in workloads:
            prompts = make_prompts(n, input_len, config.model.vocab_size)
            results[name][workload] = measure(workload, run, prompts, output_len, ns.repeats)
            print(f"{name} / {workload}: {results[name][workload]}", file=sys.stderr, flush=True)
        del run
    if ns.json_path:
        Path(ns.json_path).write_text(json.dumps(results, indent=2) + "\n")
    table = to_markdown(results, Path(path).name, ns.threads)
    print(table)
    if ns.markdown:
        with open(ns.markdown, "a") as f:
            f.write(table)
    return 0


def to_markdown(results: dict[str, dict[str, dict[str, float]]], model: str, threads: int) -> str:
    lines = [
        *report_header(f"{model}, {threads} threads", f"python {' '.join(sys.argv)}"),
        "",
        "| engine | decode batch 1 (tok/s) | decode batch 16 (tok/s) | prefill 512 (tok/s) | offline 64 (tok/s) |",
        "|---|---|---|---|---|",
    ]
    nan = {"decode_tok_s": math.nan, "prefill_tok_s": math.nan, "total_tok_s": math.nan}
    for name, by_workload in results.items():
        cells = [by_workload.get("decode batch 1", nan)["decode_tok_s"],
                 by_workload.get("decode batch 16", nan)["decode_tok_s"],
                 by_workload.get("prefill 512", nan)["prefill_tok_s"],
                 by_workload.get("offline 64", nan)["total_tok_s"]]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join("-" if math.isnan(c) else f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines) + "\n\n"


if __name__ == "__main__":
    raise SystemExit(main())
