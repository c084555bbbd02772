"""A KV connector's counts in the stat loggers: the kvloom:-prefixed Prometheus series
(only with a connector) and the periodic log line's part."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvloom.kv_transfer.config import KVTransferConfig
from kvloom.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from kvloom.metrics.scheduler_stats import KVTransferStats, SchedulerStats
from tests.helpers.serve_fakes import make_config


def _stats() -> KVTransferStats:
    stats = KVTransferStats(queries=200, hits=150, failed_loads=1)
    stats.count_hit("cpu", 100)
    stats.count_hit("disk", 50)
    stats.count_transfer("CPU_to_GPU", 4, 4 * 2**20, 0.002)
    return stats


def _connector_config() -> object:
    config = make_config()
    config.kv_transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
    return config


def test_prometheus_series_of_a_connector() -> None:
    logger = PrometheusStatLogger(_connector_config())  # type: ignore[arg-type]
    for _ in range(2):
        logger.record(SchedulerStats(kv_transfer_stats=_stats()), None)
    text = generate_latest(logger.registry).decode()
    for line in ('kvloom:external_prefix_cache_queries_total{engine="0",model_name="m"} 400.0',
                 'kvloom:external_prefix_cache_hits_total{engine="0",model_name="m"} 300.0',
                 'kvloom:kv_connector_hits_total{engine="0",model_name="m",tier="disk"} 100.0',
                 'kvloom:kv_offload_total_blocks_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 8.0',
                 'kvloom:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 8.388608e+06',
                 'kvloom:kv_connector_failed_loads_total{engine="0",model_name="m"} 2.0'):  # fmt: skip
        assert line.replace('"m"', f'"{logger.model_name}"') in text, line
    assert "external_prefix_cache" not in generate_latest(PrometheusStatLogger(make_config()).registry).decode()


def test_the_log_line_part() -> None:
    logger = LoggingStatLogger(make_config())
    assert "External" not in logger.summary()
    logger.record(SchedulerStats(kv_transfer_stats=_stats()), None)
    line = logger.summary()
    assert (
        "External prefix cache hit rate: 75.0%, hits by tier: cpu=100 disk=50, CPU_to_GPU: 4 blocks 2.10 GB/s" in line
    )
    assert "KV load failures: 1" in line
    logger.log()  # a new interval: the counts start again
    assert "External" not in logger.summary()
