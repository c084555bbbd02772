#!/usr/bin/env python3
"""The serving workload through vLLM's or kvloom's own OpenAI server, driven by one client: ``kvloom bench serve``.

The model is the Qwen3-0.6B shape of benchmarks/bench_offline_nanovllm.py (``write_qwen3_config``) with dummy bf16
weights and the tokenizer files of ``--tokenizer`` (SmolLM2's in ``.benchtok``), as benchmarks/bench_serving.py
serves it. The server starts in its own process group (timed until ``GET /health`` answers 200), then the client
sends ``--num-prompts`` requests of ``--input-len`` tokens in and ``--output-len`` out (streamed completions,
EOS ignored; prompts cut from a seeded random text tokenized by the server's ``/tokenize``) once with all requests
at once and once per ``--concurrency`` cap; every run uses the same number of requests and the same seed. Then the
server is stopped (SIGINT, SIGKILL to the group after 30 s).

Run it with kvloom's site on the path (the client is kvloom's); the vLLM server gets ``PYTHONPATH=--vllm-site`` only.

    python3 benchmarks/peers/bench_serving.py --engine vllm --tokenizer .benchtok --out $OUT/peers/vllm_serving.json
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
from engines import check_engine, run_header

log = logging.getLogger("peers.serving")

# The flags both servers get; then each engine's own (kvloom: its fastest H100 configuration, as engines.KVLOOM_FLAGS).
SHARED_FLAGS = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-num-seqs", "256"]
ENGINE_FLAGS = {"vllm": [], "kvloom": ["--attention-backend", "TRITON_ATTN", "--async-scheduling",
                                       "--disable-uvicorn-access-log"]}  # fmt: skip


def server_command(engine: str, model_dir: Path, port: int, engine_flags: list[str], max_model_len: int) -> list[str]:
    module = {"vllm": "vllm.entrypoints.cli.main", "kvloom": "kvloom"}[check_engine(engine)]
    return [sys.executable, "-m", module, "serve", str(model_dir), *SHARED_FLAGS, "--max-model-len", str(max_model_len),
            *engine_flags,
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip


def server_env(engine: str, vllm_site: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if engine == "vllm":  # vLLM's modules alone: kvloom's site holds other versions of shared ones
        env["PYTHONPATH"] = vllm_site
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


def client(port: int, concurrency: int | None, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    name = "inf" if concurrency is None else str(concurrency)
    path = work / f"client_{name}.json"
    cmd = [sys.executable, "-m", "kvloom.entrypoints.cli.main", "bench", "serve", "--port", str(port),
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--json", str(path)]  # fmt: skip
    if concurrency is not None:
        cmd += ["--max-concurrency", name]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.client_timeout, check=False)
    if done.returncode != 0 or not path.exists():
        raise RuntimeError(f"{shlex.join(cmd)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return {"client_command": shlex.join(cmd), **json.loads(path.read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="vllm or kvloom")
    parser.add_argument("--tokenizer", help="Directory with the tokenizer files to serve with.")
    parser.add_argument("--out", required=True, help="JSON file to write.")
    parser.add_argument(
        "--vllm-site", default="/tmp/vsite", help="vLLM's install (benchmarks/peers/vllm/stash_install.sh)."
    )
    parser.add_argument(
        "--model", help="A model directory instead of the Qwen3-0.6B shape + --tokenizer (smoke tests)."
    )
    parser.add_argument(
        "--engine-flags",
        default=None,
        help="Replace the engine's own server flags (default: ENGINE_FLAGS[engine]); recorded.",
    )
    parser.add_argument(
        "--extra-flags",
        default="",
        help="Flags appended to the engine's own (a variant of it, e.g. kvloom's --torch-compile); recorded.",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", default="inf,64", help="Comma-separated caps; inf = all at once.")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    parser.add_argument("--client-timeout", type=float, default=300.0)
    args = parser.parse_args()
    check_engine(args.engine)
    if (args.model is None) == (args.tokenizer is None):
        parser.error("give --tokenizer (the Qwen3-0.6B shape with that tokenizer) or --model, not both")
    engine_flags = ENGINE_FLAGS[args.engine] if args.engine_flags is None else shlex.split(args.engine_flags)
    engine_flags = [*engine_flags, *shlex.split(args.extra_flags)]
    caps = [None if c.strip() == "inf" else int(c) for c in args.concurrency.split(",")]
    if any(c is not None and c < 1 for c in caps):
        parser.error(f"--concurrency: {args.concurrency} (allowed: inf or integers >= 1)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per health poll
    version = None
    if args.engine == "vllm":  # vLLM is not importable here (kvloom's site): ask its install
        found = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, env=server_env("vllm", args.vllm_site), cwd="/", check=False)  # fmt: skip
        if found.returncode != 0:
            raise SystemExit(f"vLLM does not import from --vllm-site {args.vllm_site}:\n{found.stderr[-2000:]}")
        version = found.stdout.strip()
    header = run_header(args.engine, "serving", version)
    result: dict[str, Any] = {
        **header,
        "spec": {
            "model": "Qwen3-0.6B shape, dummy bf16 weights" if args.model is None else args.model,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "tokenizer": Path(args.tokenizer or args.model).name,
        },
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
        cmd = server_command(args.engine, model_dir, port, engine_flags, args.max_model_len)
        result["server_command"] = shlex.join(cmd)
        result["settings"] = [*SHARED_FLAGS, "--max-model-len", str(args.max_model_len), *engine_flags]
        log_path = work / "server.log"
        with open(log_path, "w") as log_file:
            process = subprocess.Popen(cmd, env=server_env(args.engine, args.vllm_site), stdout=log_file,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            result["startup_s"] = wait_healthy(process, f"http://127.0.0.1:{port}", args.startup_timeout, log_path)
            log.info("%s server healthy after %.0f s", args.engine, result["startup_s"])
            for cap in caps:
                key = "inf" if cap is None else str(cap)
                try:
                    result["runs"][key] = client(port, cap, args, work)
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # recorded; the other caps still run
                    result["runs"][key] = {"error": str(e)[-3000:]}
                run = result["runs"][key]
                log.info(
                    "%s concurrency %s: %s",
                    args.engine,
                    key,
                    f"{run['output_throughput']:.0f} output tok/s" if "error" not in run else run["error"][:200],
                )
                out.write_text(json.dumps(result, indent=1) + "\n")
        except RuntimeError as e:
            result["error"] = str(e)[-4000:]
            log.error("%s", e)
        finally:
            stop(process)
            result["server_log_tail"] = log_path.read_text()[-6000:]
    out.write_text(json.dumps(result, indent=1) + "\n")
    if "error" in result or any("error" in r for r in result["runs"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
