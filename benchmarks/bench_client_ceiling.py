#!/usr/bin/env python3
"""How many stream events a second a benchmark client can read: ``kvloom bench serve``'s
client (``kvloom.entrypoints.cli.bench_http``, its ``send_request``) beside httpx's streaming
reader (what ``kvloom bench serve`` used before 2026-11-29), one after the other in one run,
against one fake OpenAI server that writes as fast as it can.

    python benchmarks/bench_client_ceiling.py [--requests 512 --concurrency 64 --events 256] [--markdown FILE]

The fake server (this script with ``--serve PORT``, its own process) answers every
``/v1/completions`` with ``--events`` SSE events of one token each in HTTP chunks, one chunk
an event as uvicorn sends them, then a usage event and ``[DONE]``. A client that reads
slower than a real server writes measures itself: on the H200 (2026-11-29) kvloom's old
client read 28-29% below ``vllm bench serve`` on both vLLM's and kvloom's server.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

EVENT = b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                                "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                             "finish_reason": None}]}).encode() + b"\n\n"  # fmt: skip


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def fake_server(port: int, events: int) -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": events, "total_tokens": events + 8}}
    tail = chunk(b"data: " + json.dumps(usage).encode() + b"\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for _ in range(events):
                    writer.write(chunk(EVENT))
                    await writer.drain()
                    await asyncio.sleep(0)  # other streams get their turn, as a server's would
                writer.write(tail)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


async def kvloom_client(url: str, body: dict, n: int, concurrency: int) -> list[list[float]]:
    from kvloom.entrypoints.cli.bench_http import BenchHTTPClient
    from kvloom.entrypoints.cli.bench_serve import send_request

    semaphore = asyncio.Semaphore(concurrency)
    async with BenchHTTPClient(url) as client:

        async def one() -> list[float]:
            async with semaphore:
                result = await send_request(client, body)
            assert result.ok, result.error
            return result.itl

        return list(await asyncio.gather(*(one() for _ in range(n))))


async def httpx_client(url: str, body: dict, n: int, concurrency: int) -> list[list[float]]:
    """The old reader: httpx's ``stream`` and ``aiter_lines``, one JSON parse an event."""
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def one() -> list[float]:
            itl, last = [], None
            async with semaphore, client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if (
                        line.startswith("data:")
                        and line.strip() != "data: [DONE]"
                        and json.loads(line[5:]).get("choices")
                    ):
                        now = time.perf_counter()
                        if last is not None:
                            itl.append(now - last)
                        last = now
            return itl

        return list(await asyncio.gather(*(one() for _ in range(n))))


Client = Callable[[str, dict, int, int], Awaitable[list[list[float]]]]


def measure(name: str, client: Client, url: str, args: argparse.Namespace) -> dict:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": args.events, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    asyncio.run(client(url, body, args.concurrency, args.concurrency))  # warm-up: connections, imports
    start = time.perf_counter()
    itls = asyncio.run(client(url, body, args.requests, args.concurrency))
    wall = time.perf_counter() - start
    flat = [x for itl in itls for x in itl]
    row = {"client": name, "requests": args.requests, "events": args.requests * args.events, "wall_s": wall,
           "events_per_s": args.requests * args.events / wall, "itl_median_ms": 1e3 * statistics.median(flat),
           "itl_p99_ms": 1e3 * statistics.quantiles(flat, n=100)[98]}  # fmt: skip
    print(f"{name:>8}: {row['events_per_s']:,.0f} events/s ({wall:.2f} s), ITL median {row['itl_median_ms']:.3f} ms, "
          f"p99 {row['itl_p99_ms']:.3f} ms", flush=True)  # fmt: skip
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--events", type=int, default=256, help="Token events per response (default 256).")
    parser.add_argument("--repeats", type=int, default=2, help="Interleaved rounds of both clients (default 2).")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the fake server's process
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(fake_server(args.serve, args.events))
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--events", str(args.events)])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        rows = [measure(name, client, url, args) for _ in range(args.repeats)
                for name, client in (("kvloom", kvloom_client), ("httpx", httpx_client))]  # fmt: skip
    finally:
        server.terminate()
        server.wait()
    if args.markdown:
        cpu = platform.processor() or platform.machine()
        machine = f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        command = (f"python benchmarks/bench_client_ceiling.py --requests {args.requests} --concurrency "
                   f"{args.concurrency} --events {args.events} --repeats {args.repeats}")  # fmt: skip
        lines = [
            f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: {machine}",
            f"- Command: `{command}`",
            "",
            "| client | requests | events | wall s | events/s | ITL median ms | ITL p99 ms |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['client']} | {r['requests']} | {r['events']:,} | {r['wall_s']:.2f} | {r['events_per_s']:,.0f} "
            f"| {r['itl_median_ms']:.3f} | {r['itl_p99_ms']:.3f} |"
            for r in rows
        ]
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
