#!/usr/bin/env python3
"""CPU offload of the KV cache (issue 41): one multi-turn chat workload served twice, in one
run, with the same device KV pool, first without a host tier, then with one.

    python benchmarks/bench_kv_offload.py --tokenizer TOKENIZER_DIR --kv-cache-memory 16GiB \\
        --kv-offloading-size 80 [--conversations 96 --turns 3 --prefix-ratio 4] [--engine-args "..."]

The model: ``--model DIR``, or the Llama-3-8B shape with dummy bf16 weights and the tokenizer
files of ``--tokenizer`` (128 KiB of KV cache per token). Each server is ``kvloom serve`` with
``--kv-cache-memory`` (the device pool), the second one also ``--kv-offloading-size`` GiB of
host memory (the ``OffloadingConnector``); ``--engine-args`` go to both.

The workload: ``--conversations`` chats, each opening with a system message of its own
(random tokens), sized so that the distinct prefixes add up to ``--prefix-ratio`` times the
pool's tokens (read from the first server's ``kvloom:cache_config_info``, else its "KV cache
size: N tokens" log line). Each turn sends the conversation so far plus a new user message
of ``--user-len`` random tokens, streamed (``/v1/chat/completions``), temperature 0,
``ignore_eos``, ``--output-len`` tokens; the reply joins the history. Turns go round robin
(every conversation's turn 1, then every turn 2, ...), at most ``--max-concurrency`` in
flight, so that when a conversation comes back its prefix has left the device pool: without
a host tier it is computed again, with one it is loaded back (the host tier must hold the
prefixes beyond the pool: a least-recently-used cache smaller than a round-robin working set
keeps none of it). Both servers get the same prefixes and user messages (``--seed``).

Reported per server: TTFT p50 / p90 of first turns and of later turns (only later turns can
hit), request and output-token throughput, the local prefix-cache hit rate, and the
connector's counters over the run from ``/metrics``: tokens supplied per tier and, per
transfer type, blocks, bytes and the summed transfer time (GB/s per direction, bytes per
block). Then later turns' TTFT p50 without / with offloading against the issue's target
(>= 2x), and each direction's bandwidth against ``--pcie-gbps`` (default 55 GB/s: what a
PCIe Gen5 x16 link, 64 GB/s a direction in theory, carries in practice for large pinned
copies; the H200's host link). ``--json`` / ``--markdown`` write it all (the markdown with
machine, date and command, as docs/benchmarks/*.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import start_server, with_tokenizer

from kvloom.entrypoints.cli.bench_http import BenchHTTPClient
from kvloom.entrypoints.cli.bench_serve import Tokenizer, send_request, text_of_length
from kvloom.entrypoints.cli.bench_serve_metrics import (
    RequestResult,
    prefix_cache_delta,
    stats_ms,
    summarize,
)
from kvloom.entrypoints.cli.bench_throughput import machine_description

TARGET_TTFT_SPEEDUP = 2.0
#: A plain template for a tokenizer without one (said so in the report).
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
TEMPLATE_TOKENS_PER_MESSAGE = 16  # room the chat template's markup may take around each message


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="A model directory (else the Llama-3-8B shape: dummy weights, --tokenizer's files).")
    p.add_argument("--tokenizer", help="Tokenizer files for the Llama-3-8B shape (e.g. .benchtok).")
    p.add_argument("--kv-cache-memory", default="16GiB", help="The device KV pool of both servers (default 16GiB).")
    p.add_argument("--kv-offloading-size", type=float, default=80.0, help="Host tier, GiB (default 80).")
    p.add_argument("--engine-args", default="", help="More kvloom serve flags, for both servers.")
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prefix-ratio", type=float, default=4.0,
                   help="Distinct prefixes / pool tokens (default 4).")
    p.add_argument("--user-len", type=int, default=32, help="Tokens of each new user message (default 32).")
    p.add_argument("--output-len", type=int, default=64, help="Tokens of each reply (default 64).")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--pcie-gbps", type=float, default=55.0, help="The host link's practical GB/s a direction.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout, seconds.")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"), help="Servers' logs go here.")
    p.add_argument("--json", dest="json_path", help="Write the results as JSON here.")
    p.add_argument("--markdown", help="Write the report as markdown here.")
    args = p.parse_args()
    if (args.model is None) == (args.tokenizer is None):
        p.error("give --model DIR, or --tokenizer DIR for the Llama-3-8B shape (not both)")
    for flag in ("conversations", "turns", "user_len", "output_len", "max_concurrency"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: {getattr(args, flag)} (allowed: >= 1)")
    for flag in ("prefix_ratio", "kv_offloading_size", "pcie_gbps"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')}: {getattr(args, flag)} (allowed: > 0)")
    return args


def model_and_flags(args: argparse.Namespace, tmp: Path) -> tuple[Path, list[str], str | None]:
    """The model directory, the flags both servers share, and a note when the script
    supplied the chat template."""
    from bench_decode_roofline import write_llama3_config
    from transformers import AutoTokenizer

    flags = shlex.split(args.engine_args)
    model = Path(args.model) if args.model else with_tokenizer(write_llama3_config(tmp / "8b-shape"), args.tokenizer)
    if args.model is None:
        flags = ["--load-format", "dummy", "--dtype", "bfloat16", *flags]
    note = None
    has_template = getattr(AutoTokenizer.from_pretrained(model), "chat_template", None)
    if not has_template and not any(f.split("=")[0] == "--chat-template" for f in flags):
        flags += ["--chat-template", PLAIN_CHAT_TEMPLATE]
        note = "the tokenizer has no chat template: the script's plain one (role: content lines)"
    return model, flags, note


# ----------------------------------------------------------------- the server's numbers


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each sample of metric ``name`` (a counter's ``_total`` too)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in (name, name + "_total")]  # fmt: skip


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for labels, value in samples(text, name):
        sums[labels[label]] = sums.get(labels[label], 0.0) + value
    return sums


def pool_tokens(metrics: str, log: str) -> tuple[int, str]:
    """The device pool's tokens, and where they were read."""
    for labels, _ in samples(metrics, "kvloom:cache_config_info"):
        if labels.get("num_blocks", "None") != "None":
            return int(labels["num_blocks"]) * int(labels["block_size"]), "kvloom:cache_config_info"
    found = re.search(r"KV cache size: (\d+) tokens", log)
    if found is None:
        raise SystemExit("bench_kv_offload: the server reports its pool neither at /metrics nor in its log")
    return int(found.group(1)), "the server's log"


def connector_delta(before: str, after: str) -> dict[str, Any]:
    """The connector's counters over the run: tokens per tier, and per transfer type blocks,
    bytes, seconds, GB/s and bytes per block."""

    def delta(name: str, label: str) -> dict[str, float]:
        first = by_label(before, name, label)
        return {k: v - first.get(k, 0.0) for k, v in by_label(after, name, label).items()}

    blocks = delta("kvloom:kv_offload_total_blocks", "transfer_type")
    nbytes = delta("kvloom:kv_offload_total_bytes", "transfer_type")
    seconds = delta("kvloom:kv_offload_total_time", "transfer_type")
    transfers = {}
    for kind, count in blocks.items():
        size, took = nbytes.get(kind, 0.0), seconds.get(kind, 0.0)
        transfers[kind] = {"blocks": int(count), "bytes": int(size), "seconds": took,
                           "GB_per_s": size / took / 1e9 if took else None,
                           "bytes_per_block": size / count if count else None}  # fmt: skip
    return {"hits_by_tier": delta("kvloom:kv_connector_hits", "tier"), "transfers": transfers}


# ----------------------------------------------------------------- the workload


async def make_workload(args: argparse.Namespace, model: Path, pool: int, max_model_len: int | None) -> dict[str, Any]:
    """Each conversation's system prefix and its user messages (the same for both servers)."""
    from transformers import AutoTokenizer

    prefix_len = math.ceil(args.prefix_ratio * pool / args.conversations)
    need = prefix_len + args.turns * (args.user_len + args.output_len + 2 * TEMPLATE_TOKENS_PER_MESSAGE)
    if max_model_len is not None and need > max_model_len:
        raise SystemExit(f"bench_kv_offload: a conversation reaches ~{need} tokens (a prefix of {prefix_len} = "
                         f"{args.prefix_ratio} x {pool} pool tokens / {args.conversations} conversations, then "
                         f"{args.turns} turns) > max_model_len {max_model_len}: raise --conversations or "
                         "--max-model-len, or lower --turns")  # fmt: skip
    rng = random.Random(args.seed)
    tokenizer = Tokenizer(None, str(model), AutoTokenizer.from_pretrained(model))  # type: ignore[arg-type]
    vocab = await tokenizer.vocabulary(rng)

    async def text(n: int) -> str:
        return (await text_of_length(tokenizer, rng.choices(vocab, k=n), vocab, rng))[0]

    prefixes = [await text(prefix_len) for _ in range(args.conversations)]
    users = [[await text(args.user_len) for _ in range(args.turns)] for _ in range(args.conversations)]
    return {"prefix_len": prefix_len, "prefixes": prefixes, "users": users}


async def run_workload(url: str, model: str, workload: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Every turn, round robin over the conversations; a turn waits for its conversation's
    previous one (its reply is in the history)."""
    n, turns = args.conversations, args.turns
    histories = [[{"role": "system", "content": p}] for p in workload["prefixes"]]
    done = [[asyncio.get_running_loop().create_future() for _ in range(turns)] for _ in range(n)]
    order = iter([(t, c) for t in range(turns) for c in range(n)])
    results: list[tuple[int, RequestResult]] = []
    async with BenchHTTPClient(url, timeout=args.timeout) as client:

        async def worker() -> None:
            for turn, c in order:
                if turn:
                    await done[c][turn - 1]
                user = {"role": "user", "content": workload["users"][c][turn]}
                body = {"model": model, "messages": [*histories[c], user], "max_tokens": args.output_len,
                        "temperature": 0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip
                result = await send_request(client, body, path="/v1/chat/completions")
                histories[c] += [user, {"role": "assistant", "content": result.text}]
                results.append((turn, result))
                done[c][turn].set_result(None)

        before = (await client.get("/metrics")).text
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.max_concurrency)))
        duration = time.perf_counter() - start
        after = (await client.get("/metrics")).text
    summary = summarize([r for _, r in results], duration)
    kept = ("completed", "failed", "errors", "duration_s", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput")  # fmt: skip
    return {
        **{k: summary[k] for k in kept},
        "ttft_ms_first_turns": stats_ms([r.ttft for t, r in results if r.ok and t == 0]),
        "ttft_ms_later_turns": stats_ms([r.ttft for t, r in results if r.ok and t > 0]),
        "prefix_cache": prefix_cache_delta(before, after),
        "connector": connector_delta(before, after),
    }


# ----------------------------------------------------------------- both servers, the comparison


def serve_and_run(label: str, model: Path, flags: list[str], args: argparse.Namespace, work: Path,
                  state: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One server up, the workload (made on the first server, from its pool), the server down."""
    out = Path(args.out)
    server = start_server(model, flags, [], work, None)
    try:
        card = server.get("/v1/models").json()["data"][0]
        pool, source = pool_tokens(server.get("/metrics").text, server.log())
        if "workload" not in state:
            state["pool_tokens"], state["pool_source"] = pool, source
            state["workload"] = asyncio.run(make_workload(args, model, pool, card.get("max_model_len")))
        elif pool != state["pool_tokens"]:
            raise SystemExit(f"bench_kv_offload: the {label} server's pool holds {pool} tokens, the first's "
                             f"{state['pool_tokens']}: not the same pool")  # fmt: skip
        print(f"{label}: pool {pool} tokens; running {args.conversations} x {args.turns} turns", flush=True)
        return asyncio.run(run_workload(server.url, card["id"], state["workload"], args))
    finally:
        server.stop()
        shutil.copy(server.log_path, out / f"serve_{label.replace(' ', '_')}.log")


def compare(runs: dict[str, dict[str, Any]], pcie_gbps: float) -> dict[str, Any]:
    base, off = runs["no offload"], runs["offload"]
    later = base["ttft_ms_later_turns"]["median"], off["ttft_ms_later_turns"]["median"]
    speedup = later[0] / later[1] if later[1] > 0 else None
    bandwidth = {kind: {"GB_per_s": t["GB_per_s"], "bytes_per_block": t["bytes_per_block"],
                        "fraction_of_pcie": t["GB_per_s"] / pcie_gbps if t["GB_per_s"] else None}
                 for kind, t in off["connector"]["transfers"].items()}  # fmt: skip
    throughput = off["output_throughput"] / base["output_throughput"] if base["output_throughput"] else None
    return {"ttft_p50_later_turns_speedup": speedup, "target": TARGET_TTFT_SPEEDUP,
            "target_met": speedup is not None and speedup >= TARGET_TTFT_SPEEDUP,
            "output_throughput_ratio": throughput,
            "pcie_gbps": pcie_gbps, "bandwidth": bandwidth}  # fmt: skip


def to_markdown(result: dict[str, Any]) -> str:
    cfg, cmp = result["config"], result["comparison"]
    lines = [
        "## KV-cache CPU offload: multi-turn chat, prefixes beyond the device pool",
        "",
        f"- Date: {result['date']}",
        f"- Machine: {result['machine']}",
        f"- Command: `{result['command']}`",
        f"- Model: {cfg['model']}; flags of both servers: `{shlex.join(cfg['flags'])}`"
        + (f"; chat template: {cfg['chat_template_note']}" if cfg["chat_template_note"] else ""),
        (f"- Device pool: `--kv-cache-memory {cfg['kv_cache_memory']}` = {result['pool_tokens']} tokens "
         f"({result['pool_source']}); host tier: `--kv-offloading-size {cfg['kv_offloading_size']}` GiB"),
        (f"- Workload: {cfg['conversations']} conversations x {cfg['turns']} turns, round robin, at most "
         f"{cfg['max_concurrency']} in flight; a system prefix of {result['prefix_len']} tokens each "
         f"({cfg['prefix_ratio']}x the pool in all), {cfg['user_len']}-token user messages, {cfg['output_len']} "
         "tokens out (temperature 0, EOS ignored), streamed chat completions"),
        "",
        ("| server | requests | TTFT p50 / p90 first turns (ms) | TTFT p50 / p90 later turns (ms) | req/s "
         "| output tok/s | local prefix-cache hit rate | tokens from the connector, by tier |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in result["runs"].items():
        first, later, rate = r["ttft_ms_first_turns"], r["ttft_ms_later_turns"], r["prefix_cache"].get("hit_rate")
        tiers = ", ".join(f"{t} {int(n)}" for t, n in sorted(r["connector"]["hits_by_tier"].items())) or "-"
        hit_rate = "n/a" if rate is None else f"{100 * rate:.1f}%"
        lines.append(f"| {label} | {r['completed']} ({r['failed']} failed) | {first['median']:.1f} / "
                     f"{first['p90']:.1f} | {later['median']:.1f} / {later['p90']:.1f} | {r['request_throughput']:.2f} "
                     f"| {r['output_throughput']:.1f} | {hit_rate} | {tiers} |")  # fmt: skip
    speedup = cmp["ttft_p50_later_turns_speedup"]
    ratio = f"**{speedup:.2f}x**" if speedup else "n/a (no later turn completed)"
    lines += ["", (f"Later turns' TTFT p50, without / with offloading: {ratio} (target >= {cmp['target']:.0f}x: "
                   f"{'met' if cmp['target_met'] else 'NOT met'}); output tok/s with / without: "
                   f"{cmp['output_throughput_ratio'] or 0:.2f}x."), "",
              (f"Transfers with offloading (the connector's counters; GB/s = bytes over the summed transfer time; "
               f"PCIe limit assumed {cmp['pcie_gbps']:g} GB/s a direction):"), "",
              "| transfer | blocks | bytes per block | GB | seconds | GB/s | of the PCIe limit |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind, t in sorted(result["runs"]["offload"]["connector"]["transfers"].items()):
        frac = cmp["bandwidth"][kind]["fraction_of_pcie"]
        share = "-" if frac is None else f"{100 * frac:.1f}%"
        lines.append(f"| {kind} | {t['blocks']} | {t['bytes_per_block'] or 0:.0f} | {t['bytes'] / 1e9:.3f} | "
                     f"{t['seconds']:.3f} | {t['GB_per_s'] or 0:.2f} | {share} |")  # fmt: skip
    errors = [f"- {label}: {e}" for label, r in result["runs"].items() for e in r["errors"]]
    return "\n".join(lines + (["", "Errors:", *errors] if errors else [])) + "\n"


def main() -> int:
    args = parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    state: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, flags, note = model_and_flags(args, Path(tmp))
        pool = ["--kv-cache-memory", args.kv_cache_memory]
        runs["no offload"] = serve_and_run("no offload", model, [*flags, *pool], args, Path(tmp), state)
        host = ["--kv-offloading-size", str(args.kv_offloading_size)]
        runs["offload"] = serve_and_run("offload", model, [*flags, *pool, *host], args, Path(tmp), state)
    result = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": machine_description(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "config": {**{k: v for k, v in vars(args).items() if k not in ("json_path", "markdown", "out")},
                   "model": args.model or "Llama-3-8B shape, dummy weights", "flags": flags,
                   "chat_template_note": note},
        "pool_tokens": state["pool_tokens"], "pool_source": state["pool_source"],
        "prefix_len": state["workload"]["prefix_len"],
        "runs": runs, "comparison": compare(runs, args.pcie_gbps),
    }  # fmt: skip
    report = to_markdown(result)
    print(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(report)
    return 0 if all(r["completed"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
