"""The two serving clients of the peer runs, each in a process of its own, with results in one shape.

- ``kvloom``: ``kvloom bench serve`` (kvloom's site);
- ``vllm``: ``vllm bench serve --dataset-name random`` (vLLM's site, ``PYTHONPATH`` alone), its saved result turned
  into ``kvloom bench serve``'s keys (``from_vllm``).

Both send independent random-token prompts of the same lengths (each client its own, with its own seed) as text
through the model's tokenizer, ``ignore_eos``, streamed ``/v1/completions``. Around every client run the server's
``/metrics`` is read (``kvloom.entrypoints.cli.bench_serve_metrics.prefix_cache_delta``): the prefix-cache hit rate of
that run, whichever client.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

CLIENTS = ("vllm", "kvloom")


def metrics_text(url: str) -> str | None:
    try:
        response = httpx.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def _stats(data: dict[str, Any], metric: str) -> dict[str, float | None]:
    return {stat: data.get(f"{stat}_{metric}_ms") for stat in ("mean", "median", "p90", "p99")}


def from_vllm(data: dict[str, Any], num_prompts: int) -> dict[str, Any]:
    """``vllm bench serve --save-result`` JSON in ``kvloom bench serve``'s keys."""
    completed = int(data.get("completed", 0))
    return {
        "completed": completed,
        "failed": int(data.get("failed", num_prompts - completed)),
        "duration_s": data.get("duration"),
        "request_throughput": data.get("request_throughput"),
        "output_throughput": data.get("output_throughput"),
        "total_token_throughput": data.get("total_token_throughput"),
        "peak_output_throughput": data.get("max_output_tokens_per_s"),
        "ttft_ms": _stats(data, "ttft"),
        "tpot_ms": _stats(data, "tpot"),
        "itl_ms": _stats(data, "itl"),
        "e2e_latency_ms": _stats(data, "e2el"),
    }


def run_client(client: str, url: str, model: str, tokenizer: str, cap: int | None, num_prompts: int,
               args: Any, work: Path, sites: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """One run of ``client`` against the server at ``url``; raises RuntimeError with the output on failure."""
    from kvloom.entrypoints.cli.bench_serve_metrics import prefix_cache_delta

    seed = random.SystemRandom().randrange(2**31)
    path = work / f"{client}_{cap or 'inf'}_{seed}.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    common = ["--num-prompts", str(num_prompts), "--seed", str(seed), *(["--max-concurrency", str(cap)] if cap else [])]
    if client == "kvloom":
        cmd = [sys.executable, "-m", "kvloom.entrypoints.cli.main", "bench", "serve", "--base-url", url,
               "--model", model, "--tokenizer", tokenizer, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--json", str(path), *common]  # fmt: skip
    else:
        env["PYTHONPATH"] = sites["vllm"]
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
               "--base-url", url, "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--save-result",
               "--result-dir", str(work), "--result-filename", path.name, *common]  # fmt: skip
    before = metrics_text(url)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.client_timeout, check=False, env=env,
                          cwd="/" if client == "vllm" else None)  # fmt: skip
    after = metrics_text(url)
    if done.returncode != 0 or not path.exists():
        raise RuntimeError(f"{shlex.join(cmd)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    data = json.loads(path.read_text())
    run = data if client == "kvloom" else from_vllm(data, num_prompts)
    run["prefix_cache"] = prefix_cache_delta(before, after)
    return {"client": client, "client_command": shlex.join(cmd), "seed": seed, **run}
