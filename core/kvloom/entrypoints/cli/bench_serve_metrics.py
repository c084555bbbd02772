"""The numbers ``kvloom bench serve`` reports, defined as ``vllm bench serve`` defines them,
and the server's prefix-cache hit rate read from its ``/metrics``.

Per request (streamed ``/v1/completions``, or ``/v1/chat/completions``, times from sending it):

* TTFT: until the first stream event that carries a choice (chat's opening event, the
  assistant role with empty content, sent before any token is computed, does not count);
* ITL: the gaps between successive such events of one stream (one per token when the
  server sends one token per event; an event carrying several tokens is one gap);
* E2E latency: until the last event that carries a choice (the usage event and
  ``[DONE]`` after it are not counted);
* TPOT: ``(E2E - TTFT) / (output tokens - 1)``, the first token excluded; only requests
  with at least two output tokens (output tokens: the usage event's count).

Over the run (``duration``: from the first request sent to the last finished): request,
output-token and total-token throughput; peak output tok/s, the most stream events in
one 1-second bucket counted from the earliest request's start (vLLM counts one token per
event); the most requests in flight at once; mean tokens per stream event (1.0 when the
server never coalesces). Statistics of each latency: mean, median, p90 and p99 in ms.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: (hits counter, queries counter) per server family, as each names them at ``/metrics``;
#: SGLang counts queries as prompt tokens and sums its hits over ``cache_source`` labels.
PREFIX_CACHE_COUNTERS: dict[str, tuple[str, str]] = {
    "kvloom": ("kvloom:prefix_cache_hits_total", "kvloom:prefix_cache_queries_total"),
    "vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    "sglang": ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
}


@dataclass
class RequestResult:
    """One request as the client saw it (seconds; ``start`` on the client's clock)."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""  # the streamed output text

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def num_events(self) -> int:
        """Stream events that carried a choice."""
        return len(self.itl) + 1 if self.ok else 0

    def event_times(self) -> list[float]:
        """When each choice-carrying event arrived (client clock)."""
        times = [self.start + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


def stats_ms(values: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 of ``values`` (seconds) in milliseconds; zeros when empty."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    import numpy as np  # loaded when a report is made: `kvloom generate` builds the bench parser too

    array = np.asarray(values, dtype=np.float64) * 1000.0
    return {
        "mean": float(array.mean()),
        "median": float(np.median(array)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
    }


def peak_output_rate(done: list[RequestResult]) -> float:
    """The most stream events in one 1-second bucket, counted from the earliest start."""
    if not done:
        return 0.0
    origin = min(r.start for r in done)
    counts: dict[int, int] = {}
    for r in done:
        for t in r.event_times():
            bucket = int(t - origin)
            counts[bucket] = counts.get(bucket, 0) + 1
    return float(max(counts.values()))


def peak_concurrency(done: list[RequestResult]) -> int:
    """The most requests in flight at once (intervals [start, start + e2e); an end before a
    start at the same instant)."""
    events = sorted([(r.start, 1) for r in done] + [(r.start + r.e2e, -1) for r in done])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    events = sum(r.num_events for r in done)
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
        "peak_output_throughput": peak_output_rate(done),
        "peak_concurrent_requests": peak_concurrency(done),
        "tokens_per_event": output_tokens / events if events else 0.0,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl]),
        "e2e_latency_ms": stats_ms([r.e2e for r in done]),
    }


# ----------------------------------------------------------------- the server's prefix cache

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_counters(text: str, names: Iterable[str]) -> dict[str, float]:
    """The sum over label sets of each metric in ``names`` present in a Prometheus text
    exposition (absent names are left out)."""
    wanted = set(names)
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in wanted:
            try:
                value = float(match.group(3))
            except ValueError:
                continue
            if math.isfinite(value):
                sums[match.group(1)] = sums.get(match.group(1), 0.0) + value
    return sums


def prefix_cache_snapshot(text: str) -> tuple[str, float, float] | None:
    """(server family, hits, queries) from ``/metrics`` text; None when it has none of the
    known prefix-cache counters."""
    for family, (hits, queries) in PREFIX_CACHE_COUNTERS.items():
        found = parse_counters(text, (hits, queries))
        if queries in found:
            return family, found.get(hits, 0.0), found[queries]
    return None


def prefix_cache_delta(before: str | None, after: str | None) -> dict[str, Any]:
    """The hit rate of the tokens queried between two ``/metrics`` readings; ``hit_rate``
    None (with ``note`` saying why) when the server does not expose the counters."""
    first = prefix_cache_snapshot(before) if before is not None else None
    last = prefix_cache_snapshot(after) if after is not None else None
    if first is None or last is None or first[0] != last[0]:
        return {"hit_rate": None, "note": "the server exposes no prefix-cache counters at /metrics "
                f"(known: {', '.join(q for _, q in PREFIX_CACHE_COUNTERS.values())})"}  # fmt: skip
    hits, queries = last[1] - first[1], last[2] - first[2]
    return {"server": last[0], "hits": hits, "queries": queries, "hit_rate": hits / queries if queries > 0 else None}


# ----------------------------------------------------------------- the report


def format_report(s: dict[str, Any]) -> str:
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<44}{value:>16}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if "max_concurrency" in s.get("config", {}):
        row("Maximum request concurrency:", s["config"]["max_concurrency"] or "none")
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Peak output token throughput (tok/s):", f"{s['peak_output_throughput']:.2f}")
    row("Peak concurrent requests:", s["peak_concurrent_requests"])
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    row("Output tokens per stream event:", f"{s['tokens_per_event']:.2f}")
    cache = s.get("prefix_cache")
    if cache is not None:
        rate = cache.get("hit_rate")
        row("Server prefix-cache hit rate:", "n/a" if rate is None else f"{100 * rate:.1f}%")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_latency_ms", "End-to-end Latency")):  # fmt: skip
        lines.append("{:-^60}".format(f" {title} "))
        short = key.removesuffix("_ms").upper().replace("_LATENCY", "L")
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {short} (ms):",
                f"{s[key][stat]:.2f}")  # fmt: skip
    if cache is not None and cache.get("note"):
        lines.append(f"prefix cache: {cache['note']}")
    for error in s["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)
