#!/usr/bin/env python3
"""The serving workload through vLLM's, SGLang's or kvloom's own OpenAI server, each at its defaults, driven by vLLM's
client (``vllm bench serve``) and kvloom's (``kvloom bench serve``).

The model is the Qwen3-0.6B shape of benchmarks/bench_offline_nanovllm.py (``write_qwen3_config``) with dummy bf16
weights and the tokenizer files of ``--tokenizer`` (SmolLM2's in ``.benchtok``). The server starts in its own process
group (timed until ``GET /health`` answers 200; with ``--warm-start`` it is stopped and started again, its compile
caches kept, and timed again). Then, for each run of ``--runs`` (``CAP:PROMPTS``; CAP ``inf`` = all at once), each
client of ``--clients`` in turn, ``--repeats`` times interleaved, sends PROMPTS requests of ``--input-len`` random
tokens in and ``--output-len`` out (streamed completions, EOS ignored, a fresh seed per run: independent prompts, no
shared prefix), the server's prefix-cache hit rate read from ``/metrics`` around each run. Then the server is stopped
(SIGINT, SIGKILL to the group after 30 s).

Only the workload's flags reach a server (dummy weights, bf16, 256 sequences, the context); SGLang also gets
``--enable-metrics`` (its ``/metrics`` is off by default; the hit rate needs it).

    python3 benchmarks/peers/bench_serving.py --engine vllm --tokenizer .benchtok --out $OUT/peers/vllm_serving.json
    python3 benchmarks/peers/bench_serving.py --engine sglang --tokenizer .benchtok --out $OUT/peers/sglang_serving.json
    python3 benchmarks/peers/bench_serving.py --engine kvloom --tokenizer .benchtok --out $OUT/peers/kvloom_serving.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_offline_nanovllm import write_qwen3_config
from engines import SITES, check_engine, run_header
from serve_clients import CLIENTS, run_client

log = logging.getLogger("peers.serving")

#: Each engine's own server flags beyond the workload's: none (every engine at its defaults), but SGLang's metrics.
ENGINE_FLAGS: dict[str, list[str]] = {"vllm": [], "sglang": ["--enable-metrics"], "kvloom": []}
#: The default runs: all at once and concurrency 16/64/256 with 1,000 prompts, concurrency 1 with 64.
DEFAULT_RUNS = "inf:1000,16:1000,64:1000,256:1000,1:64"


def server_command(engine: str, model_dir: Path, port: int, engine_flags: list[str], max_model_len: int) -> list[str]:
    """The server's command line: the workload's flags in each engine's names, then its own."""
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if check_engine(engine) == "sglang":
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--load-format", "dummy",
                "--dtype", "bfloat16", "--max-running-requests", "256", "--context-length", str(max_model_len),
                *engine_flags, *where]  # fmt: skip
    module = {"vllm": "vllm.entrypoints.cli.main", "kvloom": "kvloom"}[engine]
    return [sys.executable, "-m", module, "serve", str(model_dir), "--load-format", "dummy", "--dtype", "bfloat16",
            "--max-num-seqs", "256", "--max-model-len", str(max_model_len), *engine_flags, *where]  # fmt: skip


def server_env(engine: str, sites: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if engine in sites:  # a peer's modules alone: kvloom's site holds other versions of shared ones
        env["PYTHONPATH"] = sites[engine]
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, timeout: float, log_path: Path) -> float:
    """Seconds until ``url``/health answers 200; raises with the log's end if the server exits or times out."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{log_path.read_text()[-4000:]}")


def stop(process: subprocess.Popen) -> None:
    """SIGINT to the server's process group (its engine processes too), SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def parse_runs(text: str) -> list[tuple[int | None, int]]:
    """``inf:1000,64:1000,1:64`` -> [(None, 1000), (64, 1000), (1, 64)] (cap None: all at once)."""
    runs = []
    for item in text.split(","):
        cap, _, prompts = item.strip().partition(":")
        try:
            runs.append((None if cap == "inf" else int(cap), int(prompts)))
        except ValueError:
            raise ValueError(f"--runs: {item!r} (allowed: CAP:PROMPTS, CAP inf or >= 1)") from None
        if (runs[-1][0] is not None and runs[-1][0] < 1) or runs[-1][1] < 1:
            raise ValueError(f"--runs: {item!r} (allowed: CAP:PROMPTS, CAP inf or >= 1, PROMPTS >= 1)")
    return runs


def start_server(cmd: list[str], env: dict[str, str], url: str, timeout: float, log_path: Path) -> tuple[Any, float]:
    with open(log_path, "a") as log_file:
        process = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process, wait_healthy(process, url, timeout, log_path)
    except RuntimeError:
        stop(process)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="vllm, sglang or kvloom")
    parser.add_argument("--tokenizer", help="Directory with the tokenizer files to serve with.")
    parser.add_argument("--out", required=True, help="JSON file to write.")
    parser.add_argument("--model", help="A model directory instead of the Qwen3-0.6B shape + --tokenizer.")
    parser.add_argument("--engine-flags", default=None,
                        help="Replace the engine's own server flags (default: ENGINE_FLAGS); recorded.")  # fmt: skip
    parser.add_argument("--extra-flags", default="",
                        help="Flags appended to the engine's own (a variant, e.g. -O0); recorded.")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"CAP:PROMPTS,... (default {DEFAULT_RUNS}).")
    parser.add_argument("--clients", default=",".join(CLIENTS), help="vllm,kvloom (default: both, vLLM's first).")
    parser.add_argument("--repeats", type=int, default=1, help="Interleaved repeats of each run (default 1).")
    parser.add_argument("--warm-start", action="store_true", help="Also time a second start, compile caches kept.")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    parser.add_argument("--client-timeout", type=float, default=300.0)
    args = parser.parse_args()
    check_engine(args.engine)
    if (args.model is None) == (args.tokenizer is None):
        parser.error("give --tokenizer (the Qwen3-0.6B shape with that tokenizer) or --model, not both")
    try:
        runs = parse_runs(args.runs)
    except ValueError as e:
        parser.error(str(e))
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if not clients or set(clients) - set(CLIENTS) or args.repeats < 1:
        parser.error(f"--clients: {args.clients} (allowed: {', '.join(CLIENTS)}); --repeats >= 1")
    engine_flags = ENGINE_FLAGS[args.engine] if args.engine_flags is None else shlex.split(args.engine_flags)
    engine_flags = [*engine_flags, *shlex.split(args.extra_flags)]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per health poll
    version = None
    if args.engine in SITES:  # a peer is not importable here (kvloom's site): ask its install
        found = subprocess.run([sys.executable, "-c", f"import {args.engine}; print({args.engine}.__version__)"],
                               capture_output=True, text=True, env=server_env(args.engine, SITES), cwd="/",
                               check=False)  # fmt: skip
        if found.returncode != 0:
            raise SystemExit(f"{args.engine} does not import from {SITES[args.engine]}:\n{found.stderr[-2000:]}")
        version = found.stdout.strip()
    result: dict[str, Any] = {
        **run_header(args.engine, "serving", version),
        "spec": {"model": "Qwen3-0.6B shape, dummy bf16 weights" if args.model is None else args.model,
                 "input_len": args.input_len, "output_len": args.output_len,
                 "tokenizer": Path(args.tokenizer or args.model).name, "repeats": args.repeats},  # fmt: skip
        "runs": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model is not None:
            model_dir = Path(args.model)
        else:
            model_dir = write_qwen3_config(work / "qwen3-0.6b-shape")
            for f in Path(args.tokenizer).iterdir():
                shutil.copy(f, model_dir / f.name)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = server_command(args.engine, model_dir, port, engine_flags, args.max_model_len)
        result["server_command"] = shlex.join(cmd)
        result["settings"] = cmd[cmd.index(str(model_dir)) + 1 : -4]
        log_path, env = work / "server.log", server_env(args.engine, SITES)
        process = None
        try:
            process, result["startup_s"] = start_server(cmd, env, url, args.startup_timeout, log_path)
            log.info("%s server healthy after %.0f s", args.engine, result["startup_s"])
            if args.warm_start:
                stop(process)
                process, result["startup_warm_s"] = start_server(cmd, env, url, args.startup_timeout, log_path)
                log.info("%s server healthy again (warm) after %.0f s", args.engine, result["startup_warm_s"])
            for cap, prompts in runs:
                key = "inf" if cap is None else str(cap)
                slot = result["runs"].setdefault(key, {"num_prompts": prompts, **{c: [] for c in clients}})
                for _ in range(args.repeats):
                    for client in clients:
                        try:
                            run = run_client(client, url, str(model_dir), str(model_dir), cap, prompts, args, work,
                                             SITES)  # fmt: skip
                        except (RuntimeError, subprocess.TimeoutExpired) as e:  # recorded; the other runs go on
                            run = {"client": client, "error": str(e)[-3000:]}
                        slot[client].append(run)
                        log.info("%s concurrency %s, %s client: %s", args.engine, key, client,
                                 f"{run['output_throughput']:.0f} output tok/s" if "error" not in run
                                 else run["error"][:200])  # fmt: skip
                        out.write_text(json.dumps(result, indent=1) + "\n")
        except RuntimeError as e:
            result["error"] = str(e)[-4000:]
            log.error("%s", e)
        finally:
            if process is not None:
                stop(process)
            result["server_log_tail"] = log_path.read_text()[-6000:] if log_path.exists() else ""
    out.write_text(json.dumps(result, indent=1) + "\n")
    failed = any("error" in run for slot in result["runs"].values() for c in clients for run in slot.get(c, []))
    if "error" in result or failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
