#!/usr/bin/env python3
"""Where the nano-vllm workload's time goes, step by step (issue 19: offline vs its byte floor).

Runs ``benchmarks/bench_offline_nanovllm.py``'s workload (Qwen3-0.6B shape, dummy bf16
weights, 256 sequences) once, timed as that benchmark times it (its ``timed_generate``),
with the engine core in this process (``KVLOOM_ENABLE_MULTIPROCESSING=0``), and times, for every engine step: scheduling, the
launch of the model step (input preparation and the forward's launch), the wait for its
tokens (``get_output``: the device still busy), applying them (``update_from_output``),
and the front end's work between two ``EngineCore.step`` calls (output processing). Steps
are grouped by kind (pure decode, or with prefill tokens) and by batch size, each group
with its share of the wall time and its host time per step; a step whose wait is near zero
was host-bound.

    python benchmarks/trace_offline_steps.py --out $OUT [--backend TRITON_ATTN+async+compile]

Writes ``$OUT/offline_steps.json`` (every step and the summary) and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["KVLOOM_ENABLE_MULTIPROCESSING"] = "0"  # one process: the core's steps are observable here

from bench_offline_nanovllm import timed_generate, workload, write_qwen3_config
from run_spec import parse_run_spec


class StepTrace:
    """Wraps the engine core's scheduler and executor methods with timers; one record per
    scheduler output, completed when its tokens are applied."""

    def __init__(self, core: Any) -> None:
        self.records: list[dict[str, Any]] = []
        self._open: dict[int, dict[str, Any]] = {}
        self.front_s = 0.0
        self._core_left: float | None = None
        sched, ex = core.scheduler, core.executor
        self._wrap(sched, "schedule", self._on_schedule)
        self._wrap(ex, "execute_model", self._on_launch)
        self._wrap(sched, "update_from_output", self._on_update)
        self._wrap(core, "step", self._on_core_step)

    @staticmethod
    def _wrap(obj: Any, name: str, hook: Any) -> None:
        if not hasattr(obj, name):
            return
        inner = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: hook(inner, *a, **k))

    def _on_core_step(self, inner: Any, *a: Any, **k: Any) -> Any:
        now = time.perf_counter()
        if self._core_left is not None:
            self.front_s += now - self._core_left  # output processing, request intake
        out = inner(*a, **k)
        self._core_left = time.perf_counter()
        return out

    def _on_schedule(self, inner: Any) -> Any:
        t0 = time.perf_counter()
        so = inner()
        if not so.is_empty():
            decodes = sum(1 for n in so.num_scheduled_tokens.values() if n == 1)
            self._open[id(so)] = {"t_start": t0, "schedule_s": time.perf_counter() - t0, "reqs": so.num_reqs,
                                  "tokens": so.total_num_scheduled_tokens, "decodes": decodes}  # fmt: skip
        return so

    def _on_launch(self, inner: Any, so: Any, *a: Any) -> Any:
        t0 = time.perf_counter()
        pending = inner(so, *a)
        rec = self._open.get(id(so))
        if rec is not None:
            rec["launch_s"] = time.perf_counter() - t0
            if pending is not None and hasattr(pending, "get_output"):
                get = pending.get_output

                def timed_get() -> Any:
                    t1 = time.perf_counter()
                    out = get()
                    rec["wait_s"] = rec.get("wait_s", 0.0) + time.perf_counter() - t1
                    return out

                pending.get_output = timed_get
        return pending

    def _on_update(self, inner: Any, so: Any, runner_output: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(so, runner_output)
        rec = self._open.pop(id(so), None)
        if rec is not None:
            rec["update_s"] = time.perf_counter() - t0
            rec["t_done"] = time.perf_counter()
            self.records.append(rec)
        return out


def summarize(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Per group (``decode`` or ``mixed`` x batch bucket): steps, the wall time between
    consecutive step completions, and the host parts per step."""
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    prev = records[0]["t_start"] if records else 0.0
    for r in records:
        interval = r["t_done"] - prev
        prev = r["t_done"]
        kind = "decode" if r["decodes"] == r["reqs"] else "mixed"
        b = r["reqs"]
        bucket = next(x for x in (1, 8, 16, 32, 64, 128, 192, 256, 10**9) if b <= x)
        g = groups[f"{kind} reqs<={bucket}"]
        g["steps"] += 1
        g["interval_s"] += interval
        g["tokens"] += r["tokens"]
        for key in ("schedule_s", "launch_s", "wait_s", "update_s"):
            g[key] += r.get(key, 0.0)
    table = {}
    for name, g in sorted(groups.items()):
        n = g["steps"]
        table[name] = {
            "steps": int(n),
            "share_of_wall": g["interval_s"] / wall,
            "ms_per_step": 1e3 * g["interval_s"] / n,
            "tokens_per_step": g["tokens"] / n,
            **{f"{k[:-2]}_ms": 1e3 * g[k] / n for k in ("schedule_s", "launch_s", "wait_s", "update_s")},
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--backend", default="TRITON_ATTN+async",
                        help="NAME[+async][+compile][+ops|+noops] (+ops / +noops: --custom-ops all / none; neither: the default)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    args = parser.parse_args()

    from kvloom import LLM, SamplingParams

    backend, options, _ = parse_run_spec(args.backend, ("async", "compile", "ops", "noops"))
    custom_ops = {"all"} if "ops" in options else {"none"} if "noops" in options else set()
    prompts, out_lens = workload(args.num_seqs)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_qwen3_config(Path(tmp) / "qwen3-0.6b-shape")
        llm = LLM(str(model), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=4096,
                  attention_backend=backend, max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
                  async_scheduling="async" in options, torch_compile=True if "compile" in options else None,
                  disable_log_stats=True, **({"custom_ops": custom_ops.pop()} if custom_ops else {}))  # fmt: skip
        warm = SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p[:64]} for p in prompts[:8]], warm, use_tqdm=False)
        trace = StepTrace(llm.llm_engine.engine_core.core)
        params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
        wall, tokens = timed_generate(llm, prompts, params, sum(out_lens), args.backend)
    table = summarize(trace.records, wall)
    result = {"backend": args.backend, "wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
              "steps": len(trace.records), "front_end_s": trace.front_s, "groups": table, "records": trace.records}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offline_steps.json").write_text(json.dumps(result))
    print(f"{args.backend}: {tokens / wall:,.0f} tok/s, {wall:.2f} s, {len(trace.records)} steps, "
          f"front end {trace.front_s:.2f} s")  # fmt: skip
    print(f"{'group':>20} {'steps':>6} {'wall%':>6} {'ms/step':>8} {'tok/step':>8} {'sched':>6} {'launch':>6} "
          f"{'wait':>6} {'update':>6}")  # fmt: skip
    for name, g in table.items():
        print(f"{name:>20} {g['steps']:>6} {100 * g['share_of_wall']:>5.1f}% {g['ms_per_step']:>8.2f} "
              f"{g['tokens_per_step']:>8.0f} {g['schedule_ms']:>6.2f} {g['launch_ms']:>6.2f} {g['wait_ms']:>6.2f} "
              f"{g['update_ms']:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
