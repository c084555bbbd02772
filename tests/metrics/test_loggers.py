"""LoggingStatLogger, PrometheusStatLogger and build_stat_loggers."""

from __future__ import annotations

import logging

import pytest
from kvloom_registry import PluginEntry
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvloom import plugins
from kvloom.metrics.loggers import (
    LoggingStatLogger,
    PrefixCacheHitRate,
    PrometheusStatLogger,
    build_stat_loggers,
    token_count_buckets,
)
from kvloom.metrics.stat_logger_base import StatLoggerBase
from kvloom.metrics.scheduler_stats import PrefixCacheStats, SchedulerStats
from kvloom.metrics.stats import FinishedRequestStats, IterationStats
from kvloom.plugins import STAT_LOGGER_PLUGINS
from kvloom.request import FinishReason
from tests.helpers.serve_fakes import make_config


def samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    text = generate_latest(logger.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def finished(reason: FinishReason | str, e2e: float, prompt: int, gen: int) -> FinishedRequestStats:
    return FinishedRequestStats(
        finish_reason=reason,  # type: ignore[arg-type]  # a str only to test the unknown-reason error
        e2e_latency=e2e,
        num_prompt_tokens=prompt,
        num_generation_tokens=gen,
        max_tokens_param=None,
        queued_time=0.5,
        prefill_time=0.25,
        inference_time=e2e - 0.5,
        decode_time=e2e - 0.75,
        mean_time_per_output_token=0.0,
    )


M = (("model_name", "m1"),)
ME = (("engine", "0"), ("model_name", "m1"))  # engine-level metrics: one series per engine core


def test_prometheus_metric_values_and_labels() -> None:
    logger = PrometheusStatLogger(make_config(served_model_name="m1", max_model_len=2048))
    logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.25,
            prefix_cache_stats=PrefixCacheStats(requests=2, queries=64, hits=16),
            num_preemptions=1,
            structured_output_compile_times=[0.003, 0.4],
            structured_output_cache_queries=3,
            structured_output_cache_hits=1,
        ),
        IterationStats(
            num_prompt_tokens=40,
            num_generation_tokens=3,
            time_to_first_tokens_iter=[0.03, 0.7],
            inter_token_latencies_iter=[0.02],
            finished_requests=[finished(FinishReason.STOP, 2.0, 20, 7), finished(FinishReason.LENGTH, 3.0, 20, 16)],
        ),
    )
    logger.record(
        SchedulerStats(num_running_reqs=1, kv_cache_usage=0.125,
                       prefix_cache_stats=PrefixCacheStats(requests=1, queries=16, hits=0)),
        IterationStats(num_generation_tokens=1, inter_token_latencies_iter=[0.05],
                       finished_requests=[finished(FinishReason.ABORT, 1.0, 5, 1)]),
    )
    s = samples(logger)
    assert s[("kvloom:num_requests_running", ME)] == 1
    assert s[("kvloom:num_requests_waiting", ME)] == 0
    assert s[("kvloom:kv_cache_usage_perc", ME)] == 0.125
    assert s[("kvloom:prefix_cache_queries_total", ME)] == 80
    assert s[("kvloom:prefix_cache_hits_total", ME)] == 16
    assert s[("kvloom:num_preemptions_total", ME)] == 1
    assert s[("kvloom:structured_output_cache_queries_total", ME)] == 3
    assert s[("kvloom:structured_output_cache_hits_total", ME)] == 1
    assert s[("kvloom:structured_output_compile_time_seconds_count", M)] == 2
    assert s[("kvloom:structured_output_compile_time_seconds_bucket", (("le", "0.005"), ("model_name", "m1")))] == 1
    assert s[("kvloom:structured_output_compile_time_seconds_sum", M)] == pytest.approx(0.403)
    assert s[("kvloom:prompt_tokens_total", M)] == 40
    assert s[("kvloom:generation_tokens_total", M)] == 4
    for reason in ("stop", "length", "abort"):
        key = ("kvloom:request_success_total", (("finished_reason", reason), ("model_name", "m1")))
        assert s[key] == 1
    # TTFT: 0.03 falls in le=0.04, 0.7 in le=0.75.
    assert s[("kvloom:time_to_first_token_seconds_bucket", (("le", "0.02"), ("model_name", "m1")))] == 0
    assert s[("kvloom:time_to_first_token_seconds_bucket", (("le", "0.04"), ("model_name", "m1")))] == 1
    assert s[("kvloom:time_to_first_token_seconds_bucket", (("le", "0.75"), ("model_name", "m1")))] == 2
    assert s[("kvloom:time_to_first_token_seconds_count", M)] == 2
    assert s[("kvloom:time_to_first_token_seconds_sum", M)] == pytest.approx(0.73)
    assert s[("kvloom:inter_token_latency_seconds_count", M)] == 2
    assert s[("kvloom:inter_token_latency_seconds_sum", M)] == pytest.approx(0.07)
    assert s[("kvloom:e2e_request_latency_seconds_count", M)] == 3
    assert s[("kvloom:e2e_request_latency_seconds_sum", M)] == pytest.approx(6.0)
    assert s[("kvloom:request_queue_time_seconds_sum", M)] == pytest.approx(1.5)
    assert s[("kvloom:request_prefill_time_seconds_sum", M)] == pytest.approx(0.75)
    assert s[("kvloom:request_inference_time_seconds_sum", M)] == pytest.approx(4.5)
    assert s[("kvloom:request_decode_time_seconds_sum", M)] == pytest.approx(3.75)
    assert s[("kvloom:request_prompt_tokens_sum", M)] == 45
    assert s[("kvloom:request_generation_tokens_sum", M)] == 24
    assert s[("kvloom:request_generation_tokens_bucket", (("le", "10.0"), ("model_name", "m1")))] == 2
    assert s[("kvloom:request_generation_tokens_bucket", (("le", "20.0"), ("model_name", "m1")))] == 3
    assert s[("kvloom:request_prompt_tokens_bucket", (("le", "2048.0"), ("model_name", "m1")))] == 3


def test_prometheus_every_issue_metric_is_exported_with_help_and_type() -> None:
    logger = PrometheusStatLogger(make_config(served_model_name="m1"))
    text = generate_latest(logger.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "kvloom:num_requests_running": "gauge",
        "kvloom:num_requests_waiting": "gauge",
        "kvloom:kv_cache_usage_perc": "gauge",
        "kvloom:prefix_cache_queries": "counter",
        "kvloom:prefix_cache_hits": "counter",
        "kvloom:prompt_tokens": "counter",
        "kvloom:generation_tokens": "counter",
        "kvloom:request_success": "counter",
        "kvloom:request_prompt_tokens": "histogram",
        "kvloom:request_generation_tokens": "histogram",
        "kvloom:time_to_first_token_seconds": "histogram",
        "kvloom:inter_token_latency_seconds": "histogram",
        "kvloom:e2e_request_latency_seconds": "histogram",
        "kvloom:request_queue_time_seconds": "histogram",
        "kvloom:request_prefill_time_seconds": "histogram",
        "kvloom:request_decode_time_seconds": "histogram",
        "kvloom:cache_config_info": "gauge",
        "kvloom:structured_output_cache_queries": "counter",
        "kvloom:structured_output_cache_hits": "counter",
        "kvloom:structured_output_compile_time_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert name in families, name
        assert families[name].type == kind, name
        assert families[name].documentation, name
        assert all(s.labels.get("model_name") == "m1" for s in families[name].samples), name
    assert "# TYPE kvloom:prompt_tokens_total counter" in text


def test_cache_config_info_carries_cache_config_and_updates_after_init() -> None:
    config = make_config(served_model_name="m1", num_blocks=None)
    logger = PrometheusStatLogger(config)
    (info,) = [k for k in samples(logger) if k[0] == "kvloom:cache_config_info"]
    labels = dict(info[1])
    assert labels["block_size"] == "16"
    assert labels["enable_prefix_caching"] == "True"
    assert labels["num_blocks"] == "None"
    config.cache.num_blocks = 321
    logger.log_engine_initialized()
    infos = [(k, v) for k, v in samples(logger).items() if k[0] == "kvloom:cache_config_info"]
    assert len(infos) == 1  # the old label set is gone
    assert dict(infos[0][0][1])["num_blocks"] == "321" and infos[0][1] == 1


def test_two_loggers_do_not_collide() -> None:
    a = PrometheusStatLogger(make_config(served_model_name="a"))
    b = PrometheusStatLogger(make_config(served_model_name="b"))
    a.record(None, IterationStats(num_prompt_tokens=5))
    assert samples(a)[("kvloom:prompt_tokens_total", (("model_name", "a"),))] == 5
    assert samples(b)[("kvloom:prompt_tokens_total", (("model_name", "b"),))] == 0


def test_unknown_finish_reason_is_an_error() -> None:
    logger = PrometheusStatLogger(make_config())
    with pytest.raises(ValueError, match="finish_reason 'exploded'"):
        logger.record(None, IterationStats(finished_requests=[finished("exploded", 1.0, 1, 1)]))


def test_token_count_buckets() -> None:
    assert token_count_buckets(64) == [1, 2, 5, 10, 20, 50, 64]
    assert token_count_buckets(50) == [1, 2, 5, 10, 20, 50]
    assert token_count_buckets(1) == [1]


def test_prefix_cache_hit_rate_window() -> None:
    rate = PrefixCacheHitRate(max_requests=10)
    rate.observe(PrefixCacheStats(requests=10, queries=100, hits=100))
    assert rate.hit_rate == 1.0
    rate.observe(PrefixCacheStats(requests=10, queries=100, hits=0))
    # The first step fell out of the 10-request window.
    assert rate.hit_rate == 0.0
    rate.observe(PrefixCacheStats(requests=5, queries=100, hits=50))
    assert rate.hit_rate == pytest.approx(50 / 200)
    rate.observe(PrefixCacheStats(reset=True))
    assert rate.hit_rate == 0.0


def test_logging_stat_logger_summary(caplog: pytest.LogCaptureFixture) -> None:
    logger = LoggingStatLogger(make_config(), engine_index=0)
    logger.interval_start = 100.0
    logger.record(
        SchedulerStats(num_running_reqs=4, num_waiting_reqs=1, kv_cache_usage=0.375,
                       prefix_cache_stats=PrefixCacheStats(requests=2, queries=40, hits=10)),
        IterationStats(num_prompt_tokens=100, num_generation_tokens=20),
    )
    logger.record(None, IterationStats(num_generation_tokens=30))
    line = logger.summary(now=105.0)
    assert line == (
        "Engine 000: Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 4 reqs, Waiting: 1 reqs, KV cache usage: 37.5%, Prefix cache hit rate: 25.0%"
    )
    with caplog.at_level(logging.INFO, logger="kvloom.metrics.loggers"):
        logger.log()
    assert any("Running: 4 reqs" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    # The interval restarts: no tokens since the last line.
    assert "Avg prompt throughput: 0.0 tokens/s" in logger.summary()


def test_logging_stat_logger_quiet_when_idle(caplog: pytest.LogCaptureFixture) -> None:
    logger = LoggingStatLogger(make_config())
    with caplog.at_level(logging.DEBUG, logger="kvloom.metrics.loggers"):
        logger.log()
        logger.log()
        logger.record(SchedulerStats(num_running_reqs=1), IterationStats(num_generation_tokens=1))
        logger.log()
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO, logging.DEBUG, logging.INFO]


class _PluginLogger(StatLoggerBase):
    records: list = []

    def record(self, scheduler_stats, iteration_stats, engine_idx=0) -> None:
        self.records.append((scheduler_stats, iteration_stats))


class _NotALogger:
    def __init__(self, config, engine_index=0) -> None:
        pass


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch):
    """The stat logger plugins ``build_stat_loggers`` sees: name -> class."""
    found: dict[str, type] = {}
    monkeypatch.setattr(
        plugins,
        "stat_logger_plugins",
        lambda: [PluginEntry(name, STAT_LOGGER_PLUGINS, "fake", "1.0", "-", cls) for name, cls in found.items()],
    )
    return found


def test_build_stat_loggers_order_and_plugins(fake_registry: dict) -> None:
    fake_registry["probe"] = _PluginLogger
    loggers = build_stat_loggers(make_config(), custom_factories=[PrometheusStatLogger])
    assert [type(x) for x in loggers] == [LoggingStatLogger, PrometheusStatLogger, _PluginLogger]
    loggers = build_stat_loggers(make_config(disable_log_stats=True))
    assert [type(x) for x in loggers] == [_PluginLogger]


def test_build_stat_loggers_rejects_non_stat_logger_plugin(fake_registry: dict) -> None:
    fake_registry["broken"] = _NotALogger
    with pytest.raises(TypeError, match="stat logger plugin 'broken'.*subclass of kvloom.interfaces.StatLoggerBase"):
        build_stat_loggers(make_config())


def test_build_stat_loggers_rejects_bad_factory(fake_registry: dict) -> None:
    with pytest.raises(TypeError, match="not a StatLoggerBase"):
        build_stat_loggers(make_config(), custom_factories=[_NotALogger])
