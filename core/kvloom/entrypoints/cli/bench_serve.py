"""``kvloom bench serve``: load a running server the way users would, and measure it as
``vllm bench serve`` does (kvloom's, vLLM's or SGLang's OpenAI server, or any other).

Prompts are independent by default: each is ``--input-len`` random token ids (drawn from
the tokenizer's vocabulary), with no prefix shared with another unless ``--prefix-len N``
puts the same N random tokens in front of every prompt; ``--dataset FILE`` reads prompts
instead (JSON lines with ``"prompt"`` text or ``"prompt_token_ids"``, optionally
``"output_len"``). A run draws a fresh seed, printed with the results (``--seed`` fixes
it), so two runs never send the same prompts to a prefix cache. Prompts go out as text,
as vLLM's client sends them: the ids decoded with ``--tokenizer`` (a local HF tokenizer
directory) or the server's ``/detokenize``, re-tokenized and trimmed to the length asked
for; ``--prompt-format token-ids`` sends the ids themselves.

Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at
once; ``--burstiness`` other than 1 makes the gaps Gamma-distributed), at most
``--max-concurrency`` in flight. Each streams ``/v1/completions`` with ``ignore_eos`` and
``max_tokens`` ``--output-len``, and without ``temperature`` unless ``--temperature`` is
given (the server's default, as vLLM's client leaves it).

Reported (``bench_serve_metrics`` defines each, as vLLM does): request, output and total
token throughput, peak output tok/s, TTFT, TPOT, ITL and E2E latency (mean, median, p90,
p99), output tokens per stream event, and the server's prefix-cache hit rate over the run,
read from its ``/metrics`` before and after (kvloom's, vLLM's and SGLang's counters; SGLang
needs ``--enable-metrics``). ``--json PATH`` (or vLLM's ``--result-filename``) writes it all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvloom.entrypoints.cli.bench_http import BenchHTTPClient, HTTPError
from kvloom.entrypoints.cli.bench_serve_metrics import (
    RequestResult,
    format_report,
    prefix_cache_delta,
    summarize,
)

__all__ = ["RequestResult", "arrival_gaps", "format_report", "register", "run", "send_request", "summarize"]

#: Words for the text whose tokens sample the server's vocabulary (no --tokenizer).
_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or has had "
    "not but first one their its new after who they have two been more other also into all time can year "
    "city world people state during some over school under about high between most would made many later "
    "than work only these such music river known where album game could team series while war house part "
    "film since well three both old history village small several each found family county water light "
    "early company place south north season including group them station through life around government"
).split()


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="Benchmark a running kvloom, vLLM, SGLang (or any OpenAI-compatible) server.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--base-url", default=None, help="Server URL (default: http://HOST:PORT).")
    add("--host", default="127.0.0.1", help="Server host (default: 127.0.0.1).")
    add("--port", type=int, default=8000, help="Server port (default: 8000).")
    add("--api-key", default=None, help="API key, if the server needs one.")
    add("--model", default=None, help="Model name (default: the server's first model).")
    add("--tokenizer", default=None, help="Local HF tokenizer directory (default: the server's /tokenize, /detokenize).")
    add("--num-prompts", type=int, default=1000, help="Requests to send (default: 1000, as vLLM).")
    add("--input-len", "--random-input-len", dest="input_len", type=int, default=1024,
        help="Random prompt tokens per request (default: 1024, as vLLM).")  # fmt: skip
    add("--output-len", "--random-output-len", dest="output_len", type=int, default=128,
        help="Output tokens per request (default: 128, as vLLM).")  # fmt: skip
    add("--prefix-len", "--random-prefix-len", dest="prefix_len", type=int, default=0,
        help="Random tokens shared by every prompt, before its own (default: 0).")  # fmt: skip
    add("--dataset", default=None, metavar="FILE", help="JSON lines of prompts instead of random ones.")
    add("--prompt-format", choices=("text", "token-ids"), default="text",
        help="Send prompts as text (as vLLM's client) or as token ids (default: text).")  # fmt: skip
    add("--temperature", type=float, default=None, help="Sampling temperature (default: the server's).")
    add("--request-rate", type=float, default=math.inf, help="Mean arrivals per second (default: inf, all at once).")
    add("--burstiness", type=float, default=1.0, help="Gamma shape of the arrival gaps; 1 = Poisson (default: 1).")
    add("--max-concurrency", type=int, default=None, help="Max requests in flight (default: no cap).")
    add("--seed", type=int, default=None, help="Seed of prompts and arrivals (default: a fresh one, printed).")
    add("--timeout", type=float, default=600.0, help="Per-request timeout in seconds (default: 600).")
    add("--json", "--result-filename", dest="json_path", default=None, metavar="PATH",
        help="Write the results as JSON here.")  # fmt: skip
    parser.set_defaults(func=run, parser=parser)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    problems = []
    for flag, value, low in (("--num-prompts", args.num_prompts, 1), ("--input-len", args.input_len, 1),
                             ("--output-len", args.output_len, 1), ("--prefix-len", args.prefix_len, 0)):  # fmt: skip
        if value < low:
            problems.append(f"{flag}: {value} (allowed: >= {low})")
    if not args.request_rate > 0:
        problems.append(f"--request-rate: {args.request_rate} (allowed: > 0, or inf)")
    if not args.burstiness > 0:
        problems.append(f"--burstiness: {args.burstiness} (allowed: > 0)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        problems.append(f"--max-concurrency: {args.max_concurrency} (allowed: >= 1)")
    if args.dataset is not None and not Path(args.dataset).is_file():
        problems.append(f"--dataset: {args.dataset} is not a file")
    if problems:
        args.parser.error("; ".join(problems))


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
    results = asyncio.run(benchmark(args))
    print(format_report(results))
    print(f"Seed: {args.seed} (--seed {args.seed} sends the same prompts again)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    return 0 if results["completed"] > 0 else 1


# ----------------------------------------------------------------- the workload


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: Gamma(burstiness, 1/(rate*burstiness)) gaps
    (exponential, i.e. Poisson arrivals, when burstiness is 1); 0 at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


class Tokenizer:
    """Token ids <-> text for the prompts: a local HF tokenizer, or the server's
    ``/tokenize`` and ``/detokenize`` (kvloom's and vLLM's)."""

    def __init__(self, client: BenchHTTPClient, model: str, local: Any = None) -> None:
        self.client, self.model, self.local = client, model, local

    async def encode(self, text: str) -> list[int]:
        if self.local is not None:
            return list(self.local.encode(text, add_special_tokens=False))
        response = await self.client.post("/tokenize", {"model": self.model, "prompt": text,
                                                         "add_special_tokens": False})  # fmt: skip
        response.raise_for_status()
        return list(response.json()["tokens"])

    async def decode(self, ids: list[int]) -> str:
        if self.local is not None:
            return str(self.local.decode(ids))
        response = await self.client.post("/detokenize", {"model": self.model, "tokens": ids})
        response.raise_for_status()
        return str(response.json()["prompt"])

    async def vocabulary(self, rng: random.Random) -> list[int]:
        """Token ids to draw prompts from: the local tokenizer's (special ids left out), or
        the distinct ids of a random text the server tokenized."""
        if self.local is not None:
            special = set(getattr(self.local, "all_special_ids", []) or [])
            return [i for i in range(len(self.local)) if i not in special]
        text = " ".join(rng.choice(_WORDS) + str(rng.randrange(100)) * (rng.random() < 0.3) for _ in range(4000))
        return sorted(set(await self.encode(text)))


async def text_of_length(tokenizer: Tokenizer, ids: list[int], vocab: list[int], rng: random.Random) -> tuple[str, int]:
    """A text of ``len(ids)`` tokens made from ``ids``: decoded, re-tokenized and cut or
    topped up until its length holds (a few rounds; else the nearest, with its length)."""
    target, length = len(ids), 0
    text = ""
    for _ in range(4):
        text = await tokenizer.decode(ids)
        again = await tokenizer.encode(text)
        length = len(again)
        if length == target:
            break
        ids = again[:target] if length > target else again + rng.choices(vocab, k=target - length)
    return text, length


async def make_prompts(args: argparse.Namespace, tokenizer: Tokenizer, rng: random.Random) -> list[dict[str, Any]]:
    """``--num-prompts`` request bodies' prompt parts: {"prompt", "input_len", "output_len"}."""
    if args.dataset is not None:
        rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
        if not rows:
            raise SystemExit(f"kvloom: error: --dataset: {args.dataset} holds no prompts")
        picked = [rows[rng.randrange(len(rows))] for _ in range(args.num_prompts)]
        return [{"prompt": row.get("prompt", row.get("prompt_token_ids")), "output_len":
                 int(row.get("output_len", args.output_len))} for row in picked]  # fmt: skip
    vocab = await tokenizer.vocabulary(rng)
    prefix = rng.choices(vocab, k=args.prefix_len)
    ids = [prefix + rng.choices(vocab, k=args.input_len) for _ in range(args.num_prompts)]
    if args.prompt_format == "token-ids":
        return [{"prompt": p, "output_len": args.output_len} for p in ids]
    semaphore = asyncio.Semaphore(32)

    async def as_text(p: list[int]) -> dict[str, Any]:
        async with semaphore:
            text, _ = await text_of_length(tokenizer, p, vocab, rng)
        return {"prompt": text, "output_len": args.output_len}

    return list(await asyncio.gather(*(as_text(p) for p in ids)))


def _stream_text(choice: dict[str, Any]) -> str | None:
    """The text a stream event's choice carries (a completion's ``text``, a chat delta's
    ``content``); None for chat's opening ``{"role": "assistant", "content": ""}``, sent
    before any token is computed (not a first token)."""
    if "delta" not in choice:
        return str(choice.get("text") or "")
    delta = choice["delta"] or {}
    if "role" in delta and not delta.get("content") and choice.get("finish_reason") is None:
        return None
    return str(delta.get("content") or "")


async def send_request(
    client: BenchHTTPClient,
    body: dict[str, Any],
    clock: Callable[[], float] = time.perf_counter,
    path: str = "/v1/completions",
) -> RequestResult:
    """Stream one completion (or, with ``path="/v1/chat/completions"``, a chat completion);
    times as ``bench_serve_metrics`` defines them, the streamed text in ``result.text``."""
    result = RequestResult()
    result.start = start = last = clock()
    first = True
    try:
        async with client.stream(path, body) as (response, lines):
            if response.status != 200:
                result.error = f"HTTP {response.status}: {''.join([line async for line in lines])[:200]}"
                return result
            async for line in lines:
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                    result.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                if not chunk.get("choices") or (piece := _stream_text(chunk["choices"][0])) is None:
                    continue
                result.text += piece
                now = clock()
                if first:
                    result.ttft, first = now - start, False
                else:
                    result.itl.append(now - last)
                last = now
        result.e2e = last - start
        result.ok = not first and result.output_tokens > 0
        if not result.ok:
            result.error = ("no token in the stream" if first else
                            "no usage in the stream (the server must support stream_options.include_usage)")  # fmt: skip
    except (HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _metrics_text(client: BenchHTTPClient) -> str | None:
    try:
        response = await client.get("/metrics")
    except HTTPError:
        return None
    return response.text if response.status == 200 else None


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or args.num_prompts
    rng = random.Random(args.seed)
    local = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        local = AutoTokenizer.from_pretrained(args.tokenizer)
    async with BenchHTTPClient(base_url, headers=headers, timeout=args.timeout) as client:
        model = args.model
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        prompts = await make_prompts(args, Tokenizer(client, model, local), rng)
        gaps = arrival_gaps(args.num_prompts, args.request_rate, args.burstiness, rng)
        semaphore = asyncio.Semaphore(limit)
        sampling = {"temperature": args.temperature} if args.temperature is not None else {}

        async def limited(prompt: dict[str, Any]) -> RequestResult:
            body = {"model": model, "prompt": prompt["prompt"], "max_tokens": prompt["output_len"], "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, **sampling}  # fmt: skip
            async with semaphore:
                return await send_request(client, body)

        metrics_before = await _metrics_text(client)
        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        metrics_after = await _metrics_text(client)
    summary = summarize(results, duration)
    summary["prefix_cache"] = prefix_cache_delta(metrics_before, metrics_after)
    summary["config"] = {
        "base_url": base_url,
        "model": model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "dataset": args.dataset,
        "prompt_format": args.prompt_format,
        "tokenizer": args.tokenizer or "the server's",
        "temperature": args.temperature,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
    }
    return summary
