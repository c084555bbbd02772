"""``kvloom bench serve``: load a running server the way users would, and measure it.

Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at
once; ``--burstiness`` other than 1 makes the gaps Gamma-distributed), optionally capped at
``--max-concurrency`` requests in flight. Each request streams ``/v1/completions`` with a
prompt of exactly ``--input-len`` tokens (random slices of a random-word text tokenized by
the server's ``/tokenize``) and ``ignore_eos`` so that it produces exactly
``--output-len`` tokens. Reported: TTFT, TPOT, ITL and E2E latency (mean, p50, p90, p99)
and request / token throughput; ``--json`` writes them to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # httpx and numpy load when the benchmark runs: `kvloom generate` builds this parser too
    import httpx

# Words for the random prompt text; what matters is a realistic token mix.
_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or has had "
    "not but first one their its new after who they have two been more other also into all time can year "
    "city world people state during some over school under about high between most under would made many "
    "later than work only these such music river known where album game could team series while war house "
    "part film since well three both old history village small several each found family county water "
    "light early company place south north season including group them station through life around government"
).split()


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="Benchmark a running kvloom (or any OpenAI-compatible) server.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", default=None, help="Server URL (default: http://HOST:PORT).")
    parser.add_argument("--host", default="127.0.0.1", help="Server host (default: 127.0.0.1).")
    parser.add_argument("--port", type=int, default=8000, help="Server port (default: 8000).")
    parser.add_argument("--api-key", default=None, help="API key, if the server needs one.")
    parser.add_argument("--model", default=None, help="Model name (default: the server's first model).")
    parser.add_argument("--num-prompts", type=int, default=100, help="Requests to send (default: 100).")
    parser.add_argument("--input-len", type=int, default=32, help="Prompt tokens per request (default: 32).")
    parser.add_argument("--output-len", type=int, default=32, help="Output tokens per request (default: 32).")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Mean arrivals per second (default: inf, all at once).")  # fmt: skip
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of the arrival gaps; 1 = Poisson (default: 1).")  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, default=None, help="Max requests in flight (default: no cap).")
    parser.add_argument("--seed", type=int, default=0, help="Seed for prompts and arrivals (default: 0).")
    parser.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout in seconds (default: 600).")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="Write the results as JSON here.")  # fmt: skip
    parser.set_defaults(func=run, parser=parser)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    problems = []
    if args.num_prompts < 1:
        problems.append(f"--num-prompts: {args.num_prompts} (allowed: >= 1)")
    if args.input_len < 1:
        problems.append(f"--input-len: {args.input_len} (allowed: >= 1)")
    if args.output_len < 1:
        problems.append(f"--output-len: {args.output_len} (allowed: >= 1)")
    if not args.request_rate > 0:
        problems.append(f"--request-rate: {args.request_rate} (allowed: > 0, or inf)")
    if not args.burstiness > 0:
        problems.append(f"--burstiness: {args.burstiness} (allowed: > 0)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        problems.append(f"--max-concurrency: {args.max_concurrency} (allowed: >= 1)")
    if problems:
        args.parser.error("; ".join(problems))


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    results = asyncio.run(benchmark(args))
    print(format_report(results))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if results["completed"] > 0 else 1


# ----------------------------------------------------------------- the workload


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: Gamma(burstiness, 1/(rate*burstiness)) gaps
    (exponential, i.e. Poisson arrivals, when burstiness is 1); 0 at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def make_prompts(
    client: httpx.AsyncClient, model: str, n: int, input_len: int, rng: random.Random
) -> list[list[int]]:
    """n prompts of exactly input_len token ids, cut from one tokenized random text."""
    words = max(2 * input_len, 256)
    while True:
        text = " ".join(rng.choice(_WORDS) for _ in range(words))
        response = await client.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        response.raise_for_status()
        pool = response.json()["tokens"]
        if len(pool) > input_len:
            break
        words *= 2
    prompts = []
    for _ in range(n):
        start = rng.randrange(len(pool) - input_len + 1)
        prompts.append(pool[start : start + input_len])
    return prompts


async def send_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> RequestResult:
    import httpx

    result = RequestResult()
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage in the stream (the server must support stream_options.include_usage)"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or args.num_prompts
    rng = random.Random(args.seed)
    import httpx

    async with httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(args.timeout),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    ) as client:
        model = args.model
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        prompts = await make_prompts(client, model, args.num_prompts, args.input_len, rng)
        gaps = arrival_gaps(args.num_prompts, args.request_rate, args.burstiness, rng)
        semaphore = asyncio.Semaphore(limit)

        async def limited(prompt: list[int]) -> RequestResult:
            async with semaphore:
                return await send_request(client, model, prompt, args.output_len)

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary["config"] = {
        "base_url": base_url,
        "model": model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
    }
    return summary


# ----------------------------------------------------------------- statistics and report


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    import numpy as np

    array = np.asarray(values, dtype=np.float64) * 1000.0
    return {
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in done]),
        "tpot_ms": _stats_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itl]),
        "e2e_latency_ms": _stats_ms([r.e2e for r in done]),
    }


def format_report(s: dict[str, Any]) -> str:
    lines = ["{:=^56}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40}{value:>16}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_latency_ms", "End-to-end Latency")):  # fmt: skip
        lines.append("{:-^56}".format(f" {title} "))
        short = key.removesuffix("_ms").upper().replace("_LATENCY", "")
        for stat in ("mean", "p50", "p90", "p99"):
            row(f"{stat.capitalize() if stat == 'mean' else stat.upper()} {short} (ms):", f"{s[key][stat]:.2f}")
    for error in s["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 56)
    return "\n".join(lines)

