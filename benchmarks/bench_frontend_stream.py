#!/usr/bin/env python3
"""The API server's cost per streamed token, on the CPU, with an engine that costs nothing.

``kvloom serve``'s front end (HTTP, the output handler, detokenizing, SSE) runs in a
server process of its own here, on a scripted engine core (``tests/helpers/scripted_core.py``:
every step gives each running request its next token at once, ``--steps-per-read`` steps
ready together, as when the engine runs ahead of the front end). The client (this
process) streams ``/v1/completions`` with token-id prompts (``--endpoint chat``:
``/v1/chat/completions`` with one user message) for C requests at once, each ``--tokens``
tokens, for each C of ``--concurrency``, and reads the server process's CPU
time before and after: its CPU microseconds per token are the front end's per-token cost
(the engine's share is nil). Also reported: tokens per stream event (1.0: one token per
SSE event) and the wall-clock token rate (client and server share the machine's cores).
With ``--step-delay 0`` the engine is infinitely fast and the front end saturated (behind
the engine, so its streams coalesce by design); with a step delay the front end keeps up
and sends one token per event.

    python benchmarks/bench_frontend_stream.py --out docs/benchmarks/data/frontend_stream_cpu/after.json

A "before" tree is measured by running the same script with ``--kvloom-path DIR`` (the
``core`` folder of another checkout, put first on the server's path).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def serve(port: int, steps_per_read: int, step_delay: float) -> None:
    """The server process: a tiny Llama's config and tokenizer, the scripted engine core."""
    sys.path.insert(0, str(REPO))
    import uvicorn

    from kvloom.engine.async_llm import AsyncLLM
    from kvloom.engine.core_client import EngineCoreClient
    from kvloom.entrypoints.openai.api_server import build_app
    from kvloom.testing.models import tiny_model_dir
    from tests.helpers.model_fixtures import make_test_engine_config
    from tests.helpers.scripted_core import ScriptedEngineCore, word_token_ids

    config = make_test_engine_config(tiny_model_dir("llama"))
    tokens = word_token_ids(config.model.tokenizer, 5)  # each a text delta of its own: an event per token
    core = ScriptedEngineCore(tokens, steps_per_read=steps_per_read, step_delay=step_delay)
    EngineCoreClient.make_client = staticmethod(lambda *args, **kwargs: core)  # type: ignore[method-assign]

    async def main() -> None:
        engine = AsyncLLM(config, log_stats=False)
        server = uvicorn.Server(uvicorn.Config(build_app(engine, log_stats=False), host="127.0.0.1", port=port,
                                               log_level="warning", access_log=False))  # fmt: skip
        await server.serve()

    try:  # the server's own event loop (uvloop where installed); a tree from before 2026-11-29 ran asyncio's
        from kvloom.entrypoints.openai.event_loop import run
    except ImportError:
        run = asyncio.run
    profile = os.environ.get("BENCH_PROFILE")  # a file: the server process's cProfile stats
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            run(main())
        finally:
            profiler.disable()
            profiler.dump_stats(profile)
    else:
        run(main())


async def stream_all(url: str, concurrency: int, tokens: int, endpoint: str = "completions") -> tuple[int, int, float]:
    """(tokens, events, seconds) of ``concurrency`` streams of ``/v1/completions`` or
    ``/v1/chat/completions`` started at once, read by ``kvloom bench serve``'s client (it
    costs the shared cores less than httpx's). A chat stream's opening role event counts as
    an event."""
    from kvloom.entrypoints.cli.bench_http import BenchHTTPClient

    body: dict[str, Any] = {"max_tokens": tokens, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Hello there"}]
    else:
        body["prompt"] = [5, 6, 7, 8]
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    counts = [0, 0]  # tokens (the usage events'), events with a choice

    async def one(client: BenchHTTPClient) -> None:
        async with client.stream(path, body) as (_, lines):
            async for line in lines:
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        counts[1] += 1
                    if chunk.get("usage"):
                        counts[0] += chunk["usage"]["completion_tokens"]

    async with BenchHTTPClient(url, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
        return counts[0], counts[1], time.perf_counter() - start


def cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the server process's port
    parser.add_argument("--concurrency", default="1,64,256", help="comma-separated streams at once")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions (default) or /v1/chat/completions")  # fmt: skip
    parser.add_argument("--steps-per-read", type=int, default=2, help="engine steps ready together")
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds per batch of engine steps (0: the engine is never the bottleneck)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3, help="runs per concurrency (the median is reported)")
    parser.add_argument("--kvloom-path", default=None, help="a core/ folder to put first on the server's path")
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.steps_per_read, args.step_delay)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, KVLOOM_CONFIGURE_LOGGING="0")
    if args.kvloom_path:
        env["PYTHONPATH"] = os.pathsep.join([args.kvloom_path, env.get("PYTHONPATH", "")])
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--steps-per-read",
                               str(args.steps_per_read), "--step-delay", str(args.step_delay)], env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        asyncio.run(stream_all(url, 8, 16, args.endpoint))  # warm-up
        runs: list[dict[str, Any]] = []
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            samples = []
            for _ in range(args.repeat):
                before = cpu_seconds(server.pid)
                tokens, events, seconds = asyncio.run(stream_all(url, concurrency, args.tokens, args.endpoint))
                cpu = cpu_seconds(server.pid) - before
                samples.append({"tokens": tokens, "events": events, "wall_s": seconds, "server_cpu_s": cpu,
                                "server_cpu_us_per_token": 1e6 * cpu / tokens, "tokens_per_event": tokens / events,
                                "wall_tok_s": tokens / seconds})  # fmt: skip
            samples.sort(key=lambda s: s["server_cpu_us_per_token"])
            median = samples[len(samples) // 2]
            runs.append({"concurrency": concurrency, **median, "samples": samples})
            print(f"c={concurrency:4d}: {median['server_cpu_us_per_token']:7.1f} server CPU us/token, "
                  f"{median['tokens_per_event']:.2f} tokens/event, {median['wall_tok_s']:8.0f} tok/s wall")
    finally:
        server.send_signal(signal.SIGINT)  # uvicorn's graceful stop (the profile, if any, is written)
        server.wait(timeout=30)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "load_avg_1m": os.getloadavg()[0]},  # fmt: skip
        "endpoint": args.endpoint,
        "tokens_per_stream": args.tokens,
        "steps_per_read": args.steps_per_read,
        "step_delay_s": args.step_delay,
        "kvloom_path": args.kvloom_path,
        "runs": runs,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
