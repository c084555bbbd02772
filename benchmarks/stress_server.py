"""Stress a running (or a freshly started) ``kvloom serve`` and measure how responsive it
stays: many concurrent requests, several of them with bodies just under the body-size
limit, while ``/health`` is polled; prints the status codes per kind of request and the
``/health`` latency (p50 / p99 / max). Not a unit test: run it by hand.

    python benchmarks/stress_server.py --start                  # starts `kvloom serve` (the default model)
    python benchmarks/stress_server.py --start -- --max-model-len 2048   # extra serve flags after --
    python benchmarks/stress_server.py --base-url http://127.0.0.1:8000 --api-key KEY

``/health`` is probed every ``--health-interval`` seconds (default 0.05) in an open loop:
a probe does not wait for the previous one, so a stall shows in every probe that arrives
during it. The mix (``--num-requests``, default 200, all sent at once): short completions and chats,
half of them streamed; completions with prompts x n at the server's sequence limit;
``--big`` requests (default 6) whose bodies are just under ``--max-request-body-bytes``:
a text prompt for /v1/completions (refused: longer than the context), the same text for
/tokenize (tokenized in full), and a token-id list; and a few clients that disconnect
mid-stream. The target: ``/health`` p99 under 1 s while all this runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvloom.entrypoints.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--disable-uvicorn-access-log", *extra]  # fmt: skip
    log = open(f"/tmp/kvloom-stress-{port}.log", "w")
    print("starting:", " ".join(cmd), f"(log: {log.name})", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())


def wait_healthy(url: str, process: subprocess.Popen | None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"kvloom serve exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server not healthy in time")


def build_requests(args: argparse.Namespace, max_model_len: int, body_limit: int, max_seqs: int) -> list[dict]:
    """(kind, path, body bytes, stream, disconnect) for the whole run."""
    requests: list[dict] = []

    def add(kind: str, path: str, body: dict | bytes, stream: bool = False, disconnect: bool = False) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        requests.append(dict(kind=kind, path=path, body=raw, stream=stream, disconnect=disconnect))

    # Bodies just under the limit (1 KB of room for the JSON around the payload).
    room = body_limit - 1024
    text = ("All work and no play makes Jack a dull boy. " * (room // 44 + 1))[:room]
    ids = ",".join(["1234"] * (room // 5))
    for i in range(args.big):
        which = i % 3
        if which == 0:
            add("big completion (text)", "/v1/completions", {"prompt": text, "max_tokens": 4})
        elif which == 1:
            add("big tokenize (text)", "/tokenize", {"prompt": text})
        else:
            add("big completion (token ids)", "/v1/completions", b'{"max_tokens": 4, "prompt": [' + ids.encode() + b"]}")
    n_prompts = max(1, min(4, max_seqs))
    n = max(1, max_seqs // n_prompts)
    for i in range(args.num_requests - len(requests)):
        kind = i % 10
        prompt = f"Request {i}: write one sentence about the number {i}."
        if kind < 4:
            add("completion", "/v1/completions", {"prompt": prompt, "max_tokens": args.max_tokens, "stream": kind % 2 == 0},
                stream=kind % 2 == 0)  # fmt: skip
        elif kind < 7:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
                    "stream": kind == 5}  # fmt: skip
            add("chat", "/v1/chat/completions", body, stream=kind == 5)
        elif kind == 7:
            add(f"completion {n_prompts} prompts x n={n}", "/v1/completions",
                {"prompt": [prompt] * n_prompts, "n": n, "max_tokens": 4, "temperature": 1.0})  # fmt: skip
        elif kind == 8:
            add("stream, client disconnects", "/v1/completions",
                {"prompt": prompt, "max_tokens": 64, "stream": True}, stream=True, disconnect=True)  # fmt: skip
        else:
            add("tokenize", "/tokenize", {"prompt": prompt})
    return requests


async def send(client: httpx.AsyncClient, request: dict, results: list[dict]) -> None:
    start = time.monotonic()
    status: int | str
    try:
        async with client.stream("POST", request["path"], content=request["body"],
                                 headers={"Content-Type": "application/json"}) as response:  # fmt: skip
            status = response.status_code
            if request["disconnect"] and status == 200:
                async for _ in response.aiter_raw():
                    break
                status = "200 (disconnected)"
            else:
                await response.aread()
    except httpx.HTTPError as exc:
        status = f"client error {type(exc).__name__}"
    results.append(dict(kind=request["kind"], status=status, seconds=time.monotonic() - start))


async def poll_health(url: str, stop: asyncio.Event, interval: float, latencies: list[float], failures: Counter) -> None:
    """One GET /health every ``interval`` seconds, each on its own schedule (open loop: a
    probe does not wait for the previous one), so a stall of the server shows in every
    probe that arrives during it, as it would for clients arriving at random."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def probe() -> None:
            start = time.monotonic()
            try:
                response = await client.get("/health")
                if response.status_code != 200:
                    failures[response.status_code] += 1
            except httpx.HTTPError as exc:
                failures[type(exc).__name__] += 1
            latencies.append(time.monotonic() - start)

        probes = []
        while not stop.is_set():
            probes.append(asyncio.create_task(probe()))
            await asyncio.sleep(interval)
        await asyncio.gather(*probes)


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    card = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    max_model_len = card["max_model_len"]
    body_limit = args.max_request_body_bytes
    if body_limit is None:
        from kvloom.entrypoints.openai.limits import default_max_body_bytes

        body_limit = default_max_body_bytes(max_model_len)
    requests = build_requests(args, max_model_len, body_limit, args.max_sequences_per_request)
    print(f"model {card['id']}, max_model_len {max_model_len}, body limit {body_limit} bytes; "
          f"{len(requests)} requests ({sum(len(r['body']) for r in requests) / 2**20:.1f} MiB of bodies)", flush=True)  # fmt: skip

    latencies: list[float] = []
    failures: Counter = Counter()
    results: list[dict] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_health(url, stop, args.health_interval, latencies, failures))
    await asyncio.sleep(1.0)  # a baseline of idle /health latencies
    idle = list(latencies)
    num_idle = len(idle)
    limits = httpx.Limits(max_connections=len(requests) + 10, max_keepalive_connections=len(requests) + 10)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as client:
        await asyncio.gather(*(send(client, r, results) for r in requests))
    elapsed = time.monotonic() - start
    stop.set()
    await poller
    loaded = latencies[num_idle:]
    by_kind: dict[str, Counter] = {}
    for r in results:
        by_kind.setdefault(r["kind"], Counter())[str(r["status"])] += 1
    return {
        "requests": len(results),
        "seconds": elapsed,
        "statuses": {kind: dict(c) for kind, c in sorted(by_kind.items())},
        "slowest_request_s": max(r["seconds"] for r in results),
        "health": {
            "polls": len(loaded),
            "failures": dict(failures),
            "idle_p50_ms": 1000 * percentile(idle, 0.5),
            "p50_ms": 1000 * percentile(loaded, 0.5),
            "p99_ms": 1000 * percentile(loaded, 0.99),
            "max_ms": 1000 * max(loaded, default=float("nan")),
            "mean_ms": 1000 * statistics.fmean(loaded) if loaded else float("nan"),
        },
        "server_5xx": sum(1 for r in results if isinstance(r["status"], int) and r["status"] >= 500),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="A running server (default: start one with --start).")
    parser.add_argument("--start", action="store_true", help="Start `kvloom serve` (flags after -- are passed on).")
    parser.add_argument("--port", type=int, default=8765, help="Port of the started server.")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--big", type=int, default=6, help="Requests whose bodies are just under the limit.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-request-body-bytes", type=int, default=None, help="The server's limit, if not default.")
    parser.add_argument("--max-sequences-per-request", type=int, default=256, help="The server's limit.")
    parser.add_argument("--health-interval", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=900.0, help="Per request, seconds.")
    parser.add_argument("--json", default=None, help="Also write the result here.")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if (args.base_url is None) == (not args.start):
        parser.error("give --base-url URL or --start")
    process = None
    url = args.base_url
    if args.start:
        if args.api_key:
            extra += ["--api-key", args.api_key]
        if args.max_request_body_bytes:
            extra += ["--max-request-body-bytes", str(args.max_request_body_bytes)]
        process = start_server(args.port, extra)
        url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, process)
        result = asyncio.run(run(args, url))
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    print(json.dumps(result, indent=2))
    h = result["health"]
    print(f"/health while loaded: p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, max {h['max_ms']:.1f} ms "
          f"({h['polls']} polls, idle p50 {h['idle_p50_ms']:.1f} ms); {result['requests']} requests in "
          f"{result['seconds']:.1f} s, {result['server_5xx']} server errors")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["server_5xx"] == 0 and h["p99_ms"] < 1000 else 1


if __name__ == "__main__":
    sys.exit(main())
