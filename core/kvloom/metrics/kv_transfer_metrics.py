"""A KV connector's counts (``KVTransferStats``) in the stat loggers: Prometheus series
under the ``kvloom:`` prefix and a part of the periodic log line.

The series, each labelled ``model_name`` and ``engine``: vLLM's
``external_prefix_cache_queries`` / ``external_prefix_cache_hits`` (tokens looked up in
the connector, tokens it supplied), ``kv_connector_hits`` by ``tier`` (the connector's
names: ``cpu``, ``disk``, ``remote``), ``kv_connector_failed_loads`` /
``kv_connector_failed_saves``, and per ``transfer_type`` (``CPU_to_GPU``, ...) vLLM's
offloading ``kv_offload_total_bytes`` / ``kv_offload_total_time`` (seconds) and
``kv_offload_total_blocks``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from kvloom.metrics.scheduler_stats import KVTransferStats


class KVTransferPrometheus:
    """The connector's Prometheus series (module docstring)."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str, engines: list[str]) -> None:
        self.model_name, self.engines = model_name, engines

        def per_engine(metric: str, doc: str) -> list[Any]:
            family = Counter(prefix + metric, doc, ["model_name", "engine"], registry=registry)
            return [family.labels(model_name, engine) for engine in engines]

        def keyed(metric: str, doc: str, key: str) -> Counter:
            return Counter(prefix + metric, doc, ["model_name", "engine", key], registry=registry)

        self.queries = per_engine("external_prefix_cache_queries",
                                  "External prefix cache queries (KV connector), in terms of number of queried tokens.")  # fmt: skip
        self.hits = per_engine("external_prefix_cache_hits",
                               "External prefix cache hits (KV connector), in terms of number of cached tokens.")  # fmt: skip
        self.failed_loads = per_engine("kv_connector_failed_loads", "Requests whose KV failed to load.")
        self.failed_saves = per_engine("kv_connector_failed_saves", "KV saves that failed.")
        self.tier_hits = keyed("kv_connector_hits", "Tokens the KV connector supplied, by tier.", "tier")
        self.bytes = keyed("kv_offload_total_bytes", "Bytes the KV connector moved, by transfer type.", "transfer_type")
        self.seconds = keyed("kv_offload_total_time", "Seconds the KV connector's transfers took, by transfer type.",
                             "transfer_type")  # fmt: skip
        self.blocks = keyed("kv_offload_total_blocks", "KV-cache blocks the KV connector moved, by transfer type.",
                            "transfer_type")  # fmt: skip

    def record(self, stats: KVTransferStats, engine_idx: int) -> None:
        engine = self.engines[engine_idx]
        self.queries[engine_idx].inc(stats.queries)
        self.hits[engine_idx].inc(stats.hits)
        self.failed_loads[engine_idx].inc(stats.failed_loads)
        self.failed_saves[engine_idx].inc(stats.failed_saves)
        for tier, tokens in stats.hits_by_tier.items():
            self.tier_hits.labels(self.model_name, engine, tier).inc(tokens)
        for kind, counts in stats.transfers.items():
            self.bytes.labels(self.model_name, engine, kind).inc(counts.bytes)
            self.seconds.labels(self.model_name, engine, kind).inc(counts.seconds)
            self.blocks.labels(self.model_name, engine, kind).inc(counts.blocks)


def kv_transfer_summary(stats: KVTransferStats) -> str:
    """The log line's part for one interval's counts: the external hit rate, hits per
    tier, and each transfer type's blocks and bandwidth ("" without lookups or transfers)."""
    if stats.is_empty():
        return ""
    parts = [f"External prefix cache hit rate: {stats.hits / stats.queries * 100 if stats.queries else 0.0:.1f}%"]
    if stats.hits_by_tier:
        parts.append("hits by tier: " + " ".join(f"{t}={n}" for t, n in sorted(stats.hits_by_tier.items())))
    for kind, c in sorted(stats.transfers.items()):
        rate = f" {c.bytes / c.seconds / 1e9:.2f} GB/s" if c.seconds > 0 else ""
        parts.append(f"{kind}: {c.blocks} blocks{rate}")
    if stats.failed_loads or stats.failed_saves:
        parts.append(f"KV load failures: {stats.failed_loads}, save failures: {stats.failed_saves}")
    return ", ".join(parts)
