#!/usr/bin/env python3
"""Mixed prefill/decode step time: eager vs PIECEWISE vs FULL_AND_PIECEWISE (issue 19).

Llama-3-8B shape with random (dummy) bf16 weights (``--num-layers`` to shorten the model;
the JSON records the count). 64 requests with 1024-token prompts are prefilled and
decode; then a request with a ``--chunk`` x ``--chunks`` token prompt is added, and with
``max_num_batched_tokens = 64 + chunk`` every step while it prefills is one mixed batch:
64 decode tokens plus one ``--chunk``-token prefill chunk. Per mode the median wall time of
those steps (full engine steps: schedule + forward + sampling) is reported, next to

    model = pure decode graph step (64 requests, FULL_AND_PIECEWISE's decode step; a mode's
            own decode step when that mode is not run) + chunk matmul FLOPs / (--gemm-tflops)

where the chunk's matmul FLOPs are 2 x chunk x (the parameters of every projection of
every layer); the LM head (one row per request) is left out. A second line, ``model+attn``,
adds the chunk's attention matmuls (QK^T and PV of its 512 queries over the causal prefix,
which grows by one chunk per step) at the same rate, step by step: the issue's "chunk's
matmul FLOPs" read literally includes them, and without them the line ignores work that
grows to ~1 TFLOP by the 8th chunk of the 32-layer model. Both ratios are reported. Capture sizes are just
64 and 64 + chunk, so the graphs of these two steps are captured and nothing else.

    python benchmarks/bench_mixed_step.py --out $OUT [--backend TRITON_ATTN] [--num-layers 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_roofline import H, HD, I, NH, NKV, V  # noqa: E402  (Llama-3-8B shape)

DECODES = 64
CONTEXT = 1024

MODES: dict[str, dict[str, Any]] = {
    "eager": {"optimization_level": 0},
    "PIECEWISE": {"optimization_level": 2, "torch_compile": True, "cudagraph_mode": "PIECEWISE"},
    "FULL_AND_PIECEWISE": {"optimization_level": 2, "torch_compile": True, "cudagraph_mode": "FULL_AND_PIECEWISE"},
    # Not run by default: the platform's Triton layer kernels inside the compiled pieces
    # instead of Inductor's fusions (Dynamo traces the kernel launches).
    "FULL_AND_PIECEWISE+ops": {"optimization_level": 2, "torch_compile": True,
                               "cudagraph_mode": "FULL_AND_PIECEWISE", "custom_ops": "all"},
}
DEFAULT_MODES = "eager,PIECEWISE,FULL_AND_PIECEWISE"


def write_config(path: Path, layers: int) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=layers, num_attention_heads=NH,
        num_key_value_heads=NKV, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.eos_token_id = cfg.bos_token_id = None
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    return path


def chunk_matmul_flops(chunk: int, layers: int) -> float:
    per_layer = H * (NH * HD) + 2 * H * (NKV * HD) + (NH * HD) * H + 3 * H * I  # qkv, o, gate+up, down
    return 2.0 * chunk * layers * per_layer


def chunk_attention_flops(chunk: int, index: int, layers: int) -> float:
    """QK^T + PV FLOPs of prefill chunk ``index`` (0-based) over its causal prefix: each of
    its query tokens attends to the ``index * chunk`` earlier tokens and to itself and the
    chunk's tokens before it."""
    keys = chunk * index * chunk + chunk * (chunk + 1) // 2
    return 4.0 * NH * HD * keys * layers


def _timed_steps(engine: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def measure(llm: Any, chunk: int, chunks: int, decode_steps: int) -> dict[str, Any]:
    from kvloom import SamplingParams
    from kvloom.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    scheduler = engine.engine_core.core.scheduler
    runner = engine.engine_core.core.worker.runner
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    ids = [f"d{i}" for i in range(DECODES)]
    for request_id in ids:
        engine.add_request(request_id, {"prompt_token_ids": torch.randint(0, V, (CONTEXT,), generator=g).tolist()},
                           params)  # fmt: skip
    while len(scheduler.running) < DECODES or any(r.num_output_tokens < 2 for r in scheduler.running):
        engine.step()
    modes: list[str] = []
    dispatch = runner.dispatcher.dispatch
    runner.dispatcher.dispatch = lambda n, u: (lambda r: modes.append(f"{r[0].value}:{n}") or r)(dispatch(n, u))
    decode = _timed_steps(engine, decode_steps)
    decode_modes, modes[:] = list(modes), []
    long_prompt = torch.randint(0, V, (chunk * chunks,), generator=g).tolist()
    engine.add_request("long", {"prompt_token_ids": long_prompt}, SamplingParams(temperature=0, max_tokens=1))
    mixed = _timed_steps(engine, chunks - 1)  # the last chunk's step also samples the long request
    mixed_modes = list(modes)
    runner.dispatcher.dispatch = dispatch
    engine.abort_request([*ids, "long"])
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "decode_median_s": statistics.median(decode), "mixed_median_s": statistics.median(mixed),
        "mixed_min_s": min(mixed), "mixed_steps_s": mixed,
        "decode_dispatch": sorted(set(decode_modes)), "mixed_dispatch": sorted(set(mixed_modes)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--backend", default=None, help="Attention backend (default: selection by priority).")
    parser.add_argument("--num-layers", type=int, default=32, help="Layers of the Llama-3-8B shape (32: the model).")
    parser.add_argument("--chunk", type=int, default=512, help="Prefill chunk tokens per mixed step.")
    parser.add_argument("--chunks", type=int, default=9, help="Chunks of the long prompt (mixed steps + 1).")
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--gemm-tflops", type=float, default=786.0, help="GEMM rate of the model line (TFLOP/s).")
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)}")
    args = parser.parse_args()
    os.environ.setdefault("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the runner's dispatcher is observed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flops = chunk_matmul_flops(args.chunk, args.num_layers)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "num_layers": args.num_layers,
        "decodes": DECODES, "context": CONTEXT, "chunk": args.chunk, "gemm_tflops": args.gemm_tflops,
        "chunk_matmul_flops": flops, "rows": [],
    }  # fmt: skip
    from kvloom import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "llama3-8b-shape", args.num_layers)
        for mode in args.modes.split(","):
            if mode not in MODES:
                raise SystemExit(f"unknown mode {mode!r}: one of {sorted(MODES)}")
            start = time.perf_counter()
            llm = LLM(
                str(model_dir), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                max_model_len=args.chunk * args.chunks + 64, max_num_seqs=DECODES + 1,
                max_num_batched_tokens=DECODES + args.chunk, attention_backend=args.backend,
                cudagraph_capture_sizes=[DECODES, DECODES + args.chunk], gpu_memory_utilization=0.85,
                disable_log_stats=True, **MODES[mode],
            )  # fmt: skip
            startup = time.perf_counter() - start
            m = measure(llm, args.chunk, args.chunks, args.decode_steps)
            row = {"mode": mode, "backend": llm.config.attention.backend.NAME, "startup_s": startup, **m}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out / "mixed_step.json").write_text(json.dumps(result, indent=1))
            llm.llm_engine.shutdown()
            del llm
            torch._dynamo.reset()  # drop the compiled code (and the graphs it holds) of this engine
            gc.collect()
            torch.cuda.empty_cache()

    graph_decode = {r["mode"]: r["decode_median_s"] for r in result["rows"]}.get("FULL_AND_PIECEWISE")
    for r in result["rows"]:
        r["model_s"] = (graph_decode or r["decode_median_s"]) + flops / (args.gemm_tflops * 1e12)
        r["mixed_over_model"] = r["mixed_median_s"] / r["model_s"]
        attn = [chunk_attention_flops(args.chunk, k, args.num_layers) for k in range(len(r["mixed_steps_s"]))]
        r["model_attn_steps_s"] = [r["model_s"] + a / (args.gemm_tflops * 1e12) for a in attn]
        r["mixed_over_model_attn"] = statistics.median(t / m for t, m in zip(r["mixed_steps_s"], r["model_attn_steps_s"]))
    (out / "mixed_step.json").write_text(json.dumps(result, indent=1))
    print(f"\n== mixed step: {DECODES} decodes + {args.chunk}-token chunk, Llama-3-8B shape x {args.num_layers} "
          f"layers, {result['gpu']}, model at {args.gemm_tflops:.0f} TFLOP/s")  # fmt: skip
    print(f"{'mode':>20} {'decode ms':>9} {'mixed ms':>9} {'model ms':>9} {'x model':>7} {'x model+attn':>12} "
          f"{'startup s':>9}")  # fmt: skip
    for r in result["rows"]:
        print(f"{r['mode']:>20} {1e3 * r['decode_median_s']:9.2f} {1e3 * r['mixed_median_s']:9.2f} "
              f"{1e3 * r['model_s']:9.2f} {r['mixed_over_model']:7.2f} {r['mixed_over_model_attn']:12.2f} "
              f"{r['startup_s']:9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
