#!/usr/bin/env python3
"""Cold and warm engine start-up for ``-O0`` .. ``-O3`` (issue 19).

For each model shape (Qwen3-0.6B and Llama-3-8B, dummy bf16 weights) and level, a fresh
Python process builds ``LLM(..., optimization_level=L)`` and generates one token:

- cold: an empty ``KVLOOM_CACHE_DIR`` and ``TRITON_CACHE_DIR`` (torch.compile's Inductor
  and Triton artefacts are built from scratch);
- warm: the same directories again right after (the compiled pieces are loaded; Dynamo
  still traces, CUDA graphs are captured again).

FlashInfer's own JIT cache (``~/.cache/flashinfer``) is left alone: it is built once per
machine, not per start. Each row records the process wall time, the time to a ready
``LLM`` and the engine's own breakdown (the "Engine core ready" and torch.compile log lines).

    python benchmarks/bench_startup.py --out $OUT [--shapes qwen3-0.6b,llama3-8b] [--levels 0,1,2,3] [--torch-compile]

``--torch-compile``: -O1 and above compile the model also where the platform does not by
default (CUDA does; the CPU platform does not).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from kvloom import LLM, SamplingParams
t_import = time.perf_counter() - t0
model, level, backend, compile_flag = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, sys.argv[4] == "1"
llm = LLM(model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2048,
          max_num_seqs=256, optimization_level=level, attention_backend=backend, gpu_memory_utilization=0.85,
          torch_compile=True if compile_flag and level > 0 else None)
t_ready = time.perf_counter() - t0
llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1), use_tqdm=False)
t_first = time.perf_counter() - t0
comp = llm.config.compilation
print("RESULT " + json.dumps({"import_s": t_import, "ready_s": t_ready, "first_token_s": t_first,
      "backend": llm.config.attention.backend.NAME, "compiled": comp.compile_model,
      "cudagraph_mode": comp.cudagraph_mode.value}))
llm.llm_engine.shutdown()
"""

# The engine's own breakdown, from its log lines (core.py and model_runner.py).
LOG_FIELDS = {
    "engine_ready_s": re.compile(r"Engine core ready in ([\d.]+) s"),
    "compile_s": re.compile(r"torch\.compile for \d+ tokens: [\d.]+ s \(Dynamo \+ backend; ([\d.]+) s in all"),
    "graph_capture_s": re.compile(r"CUDA graphs \(\w+\) captured in ([\d.]+) s"),
}


def write_shape(name: str, path: Path) -> Path:
    if name == "llama3-8b":
        from bench_decode_roofline import write_llama3_config

        return write_llama3_config(path)
    if name == "qwen3-0.6b":
        from bench_offline_nanovllm import write_qwen3_config

        return write_qwen3_config(path)
    raise SystemExit(f"--shapes: unknown shape {name!r}; allowed: qwen3-0.6b, llama3-8b")


def start_once(model: Path, level: int, backend: str, cache: Path, torch_compile: bool = False) -> dict[str, object]:
    env = dict(os.environ, KVLOOM_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton-o0"),
               KVLOOM_ENABLE_MULTIPROCESSING="0")  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(level), backend, "1" if torch_compile else "0"],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"start-up at -O{level} failed (exit {proc.returncode}):\n{out[-3000:]}")
    row: dict[str, object] = {"process_wall_s": wall, **json.loads(lines[-1][len("RESULT ") :])}
    for key, pattern in LOG_FIELDS.items():
        found = pattern.findall(out)
        row[key] = float(found[-1]) if found else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--shapes", default="qwen3-0.6b,llama3-8b")
    parser.add_argument("--levels", default="0,1,2,3")
    parser.add_argument("--backend", default="", help="Attention backend (default: selection by priority).")
    parser.add_argument("--torch-compile", action="store_true",
                        help="-O1 and above with --torch-compile (CUDA compiles there by default anyway); -O0 stays eager")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    result: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "rows": [],
    }  # fmt: skip
    rows: list[dict[str, object]] = result["rows"]  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            model = write_shape(shape, Path(tmp) / shape)
            for level in (int(x) for x in args.levels.split(",")):
                cache = Path(tmp) / f"cache-{shape}-O{level}"
                for kind in ("cold", "warm"):
                    row = {"shape": shape, "level": level, "start": kind,
                           **start_once(model, level, args.backend, cache, args.torch_compile)}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    (out / "startup.json").write_text(json.dumps(result, indent=1))

    print(f"\n== start-up, {result['gpu']}")
    print(
        f"{'shape':>11} {'level':>5} {'start':>5} {'process s':>9} {'LLM ready s':>11} {'compile s':>9} {'capture s':>9}"
    )
    for r in rows:
        print(
            f"{r['shape']:>11} {'-O' + str(r['level']):>5} {r['start']:>5} {r['process_wall_s']:9.1f} "
            f"{r['ready_s']:11.1f} {r['compile_s'] or 0:9.1f} {r['graph_capture_s'] or 0:9.1f}"
        )


if __name__ == "__main__":
    main()
