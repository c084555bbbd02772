"""The built-in stat loggers and the factory that assembles the loggers of an engine.

* ``LoggingStatLogger`` writes vLLM's one-line summary (throughputs, running/waiting,
  KV-cache usage, prefix-cache hit rate; vLLM's metrics design doc) to the INFO log each
  time ``log()`` is called (every ``log_stats_interval`` seconds, 5 by default), and with
  speculative decoding vLLM's "SpecDecoding metrics" line (``kvloom.metrics.spec_decode``).
* ``PrometheusStatLogger`` keeps the v1 metric set under the ``kvloom:`` prefix, each
  labelled with ``model_name``, in its own ``CollectorRegistry`` (``/metrics`` serves it).
* ``build_stat_loggers`` makes the logging logger (unless ``disable_log_stats``), the
  loggers the caller asked for (e.g. ``PrometheusStatLogger`` when serving) and one
  instance of every ``kvloom.stat_logger_plugins`` plugin.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvloom import plugins
from kvloom.metrics.kv_transfer_metrics import KVTransferPrometheus, kv_transfer_summary
from kvloom.metrics.scheduler_stats import KVTransferStats, PrefixCacheStats, SchedulerStats
from kvloom.metrics.spec_decode import SpecDecodingLogging, SpecDecodingProm
from kvloom.metrics.stat_logger_base import StatLoggerBase
from kvloom.metrics.stats import IterationStats
from kvloom.request import FinishReason

if TYPE_CHECKING:
    from kvloom.config import EngineConfig

logger = logging.getLogger(__name__)

METRIC_PREFIX = "kvloom:"

#: A stat logger factory: called with the engine config and the engine index. Every
#: ``StatLoggerBase`` subclass is one.
StatLoggerFactory = Callable[["EngineConfig", int], StatLoggerBase]


def multiprocess_metrics_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR``: set (by the launcher of several API servers) when every
    process writes its metrics there and ``/metrics`` sums them (prometheus_client's
    multiprocess mode)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


# ----------------------------------------------------------------- logging


class PrefixCacheHitRate:
    """Hit rate over the most recent ``max_requests`` prefix-cache lookups (vLLM's logged
    hit rate is over the "most recent 1k queries"): a sliding window of per-step
    (requests, queries, hits)."""

    def __init__(self, max_requests: int = 1000) -> None:
        self.max_requests = max_requests
        self._window: deque[tuple[int, int, int]] = deque()
        self._requests = 0
        self._queries = 0
        self._hits = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self._window.clear()
            self._requests = self._queries = self._hits = 0
        if stats.requests == 0 and stats.queries == 0:
            return
        self._window.append((stats.requests, stats.queries, stats.hits))
        self._requests += stats.requests
        self._queries += stats.queries
        self._hits += stats.hits
        # Drop old steps while the rest still covers max_requests lookups.
        while len(self._window) > 1 and self._requests - self._window[0][0] >= self.max_requests:
            requests, queries, hits = self._window.popleft()
            self._requests -= requests
            self._queries -= queries
            self._hits -= hits

    @property
    def hit_rate(self) -> float:
        return self._hits / self._queries if self._queries else 0.0


class LoggingStatLogger(StatLoggerBase):
    """Logs vLLM's summary line: throughputs since the last line, running and waiting
    requests, KV-cache usage and the recent prefix-cache hit rate."""

    def __init__(self, config: "EngineConfig", engine_index: int = 0) -> None:
        super().__init__(config, engine_index)
        self.prefix_cache = PrefixCacheHitRate()
        #: The latest scheduler stats of each engine core (several with data parallelism).
        self.engine_stats = [SchedulerStats() for _ in range(config.parallel.data_parallel_size)]
        self.spec_decoding = SpecDecodingLogging() if config.speculative is not None else None
        self._reset_interval(time.monotonic())
        self._last_line_idle = False

    def _reset_interval(self, now: float) -> None:
        self.interval_start = now
        self.interval_prompt_tokens = 0
        self.interval_generation_tokens = 0
        self.interval_kv_transfer = KVTransferStats()

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:
            self.interval_prompt_tokens += iteration_stats.num_prompt_tokens
            self.interval_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.engine_stats[engine_idx] = scheduler_stats
            self.prefix_cache.observe(scheduler_stats.prefix_cache_stats)
            if self.spec_decoding is not None and scheduler_stats.spec_decoding_stats is not None:
                self.spec_decoding.observe(scheduler_stats.spec_decoding_stats)
            self.interval_kv_transfer.merge(scheduler_stats.kv_transfer_stats)

    @property
    def last_scheduler_stats(self) -> SchedulerStats:
        """The engine's state: the sum of the engine cores' queues, their mean KV-cache usage."""
        if len(self.engine_stats) == 1:
            return self.engine_stats[0]
        return SchedulerStats(
            num_running_reqs=sum(s.num_running_reqs for s in self.engine_stats),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in self.engine_stats),
            kv_cache_usage=sum(s.kv_cache_usage for s in self.engine_stats) / len(self.engine_stats),
        )

    def summary(self, now: float | None = None) -> str:
        """The summary line for the interval that ends at ``now``."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.interval_start, 1e-9)
        s = self.last_scheduler_stats
        engines = len(self.engine_stats)
        name = f"Engine {self.engine_index:03d}" if engines == 1 else f"Engines 000-{engines - 1:03d}"
        kv_transfer = kv_transfer_summary(self.interval_kv_transfer)
        return (
            f"{name}: "
            f"Avg prompt throughput: {self.interval_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.interval_generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
            f"KV cache usage: {s.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {self.prefix_cache.hit_rate * 100:.1f}%"
            + (f", {kv_transfer}" if kv_transfer else "")
        )

    def log(self) -> None:
        now = time.monotonic()
        s = self.last_scheduler_stats
        idle = (
            self.interval_prompt_tokens == 0
            and self.interval_generation_tokens == 0
            and s.num_running_reqs == 0
            and s.num_waiting_reqs == 0
        )
        # One INFO line when the engine goes idle, then DEBUG until work arrives again,
        # so an idle server does not fill its log with identical lines.
        level = logging.DEBUG if idle and self._last_line_idle else logging.INFO
        logger.log(level, "%s", self.summary(now))
        if self.spec_decoding is not None:
            if (line := self.spec_decoding.line(max(now - self.interval_start, 1e-9))) is not None:
                logger.info("%s", line)
            self.spec_decoding.reset()
        self._last_line_idle = idle
        self._reset_interval(now)

    def log_engine_initialized(self) -> None:
        cache = self.config.cache
        if cache.num_blocks is not None:
            logger.info(
                "Engine %03d: KV cache has %d blocks of %d tokens (%d tokens)",
                self.engine_index,
                cache.num_blocks,
                cache.block_size,
                cache.num_blocks * cache.block_size,
            )


# ----------------------------------------------------------------- Prometheus

# Histogram buckets. Latencies span a fast GPU (milliseconds) to a 2-core CPU (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                           15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                           1920.0, 7680.0]  # fmt: skip

#: Grammar compile times: a regex in a millisecond, a large JSON schema in seconds.
COMPILE_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]  # fmt: skip


def token_count_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (and max_model_len itself)."""
    buckets: list[float] = []
    magnitude = 1
    while True:
        for step in (1, 2, 5):
            value = step * magnitude
            if value > max_model_len:
                if not buckets or buckets[-1] < max_model_len:
                    buckets.append(float(max_model_len))
                return buckets
            buckets.append(float(value))
        magnitude *= 10


class PrometheusStatLogger(StatLoggerBase):
    """Publishes the v1 metric set. Metrics live in ``self.registry`` (a fresh
    ``CollectorRegistry`` unless one is given) so several engines or tests in one process
    never collide; the server's ``/metrics`` renders it.

    With several API server processes (prometheus_client's multiprocess mode, see
    ``multiprocess_metrics_dir``) each records its own requests, and ``/metrics`` sums the
    counters and histograms of all. Every API server receives the engine's scheduler
    stats: the gauges they set (running, waiting, KV-cache usage) report the most recent
    value of any process, not the sum, and the counters they feed (prefix cache,
    preemptions) are counted by one API server only (``count_engine_events``)."""

    def __init__(
        self,
        config: "EngineConfig",
        engine_index: int = 0,
        registry: CollectorRegistry | None = None,
        count_engine_events: bool = True,
    ) -> None:
        super().__init__(config, engine_index)
        # No "<counter>_created" series beside every counter and histogram: vLLM turns them
        # off too, and they double the size of /metrics for a timestamp nobody graphs.
        prometheus_client.disable_created_metrics()
        self.count_engine_events = count_engine_events
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = config.model.served_model_name
        model = ["model_name"]
        name = self._name

        # The engine-level metrics (what the scheduler reports) have one series per engine
        # core (data parallelism: label "engine", as in vLLM).
        engines = [str(i) for i in range(config.parallel.data_parallel_size)]
        per_engine = ["model_name", "engine"]

        def gauge(metric: str, doc: str) -> list[Any]:
            family = Gauge(name(metric), doc, per_engine, registry=self.registry, multiprocess_mode="mostrecent")
            return [family.labels(self.model_name, engine) for engine in engines]

        def engine_counter(metric: str, doc: str) -> list[Any]:
            family = Counter(name(metric), doc, per_engine, registry=self.registry)
            return [family.labels(self.model_name, engine) for engine in engines]

        def counter(metric: str, doc: str) -> Any:
            return Counter(name(metric), doc, model, registry=self.registry).labels(self.model_name)

        def histogram(metric: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name(metric), doc, model, buckets=buckets, registry=self.registry).labels(
                self.model_name
            )

        # Server-level: gauges and counters.
        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = engine_counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = engine_counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = engine_counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.structured_output_cache_queries = engine_counter(
            "structured_output_cache_queries", "Structured-output requests that looked up the compiled-grammar cache."
        )
        self.structured_output_cache_hits = engine_counter(
            "structured_output_cache_hits", "Structured-output requests whose grammar was in the cache."
        )
        self.structured_output_compile_time = histogram(
            "structured_output_compile_time_seconds", "Histogram of grammar compile time in seconds.",
            COMPILE_TIME_BUCKETS,
        )
        self.spec_decoding = SpecDecodingProm(name, self.registry, self.model_name, engines,
                                              config.speculative.num_speculative_tokens) \
            if config.speculative is not None else None  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        request_success = Counter(
            name("request_success"),
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # Every reason is exported from the start (at 0) so rate() queries work at once.
        self.request_success = {
            str(reason): request_success.labels(self.model_name, str(reason)) for reason in FinishReason
        }

        # Request-level: histograms.
        token_buckets = token_count_buckets(config.model.max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        # Static information: a gauge fixed at 1 whose labels carry the cache config.
        self._cache_config_info = Gauge(
            name("cache_config_info"),
            "Information of the LLMEngine CacheConfig",
            ["model_name", *sorted(config.cache.model_dump())],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self._cache_labels: dict[str, str] | None = None
        self._publish_cache_config()
        # A KV connector's lookups and transfers (only with one: no empty series otherwise).
        self.kv_transfer = (
            KVTransferPrometheus(self.registry, METRIC_PREFIX, self.model_name, engines)
            if config.kv_transfer is not None else None
        )

    @staticmethod
    def _name(metric: str) -> str:
        return METRIC_PREFIX + metric

    def _publish_cache_config(self) -> None:
        labels = {key: str(value) for key, value in self.config.cache.model_dump().items()}
        if labels == self._cache_labels:
            return
        # (prometheus_client cannot clear labels in multiprocess mode; there the config is
        # complete before the logger is made, so nothing needs clearing.)
        if self._cache_labels is not None and multiprocess_metrics_dir() is None:
            self._cache_config_info.clear()
        self._cache_labels = labels
        self._cache_config_info.labels(model_name=self.model_name, **labels).set(1)

    def log_engine_initialized(self) -> None:
        # The worker sizes the cache after the config is made: num_blocks is known now.
        self._publish_cache_config()

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self.num_requests_running[engine_idx].set(scheduler_stats.num_running_reqs)
            self.num_requests_waiting[engine_idx].set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage_perc[engine_idx].set(scheduler_stats.kv_cache_usage)
            if self.count_engine_events:
                self.prefix_cache_queries[engine_idx].inc(scheduler_stats.prefix_cache_stats.queries)
                self.prefix_cache_hits[engine_idx].inc(scheduler_stats.prefix_cache_stats.hits)
                self.num_preemptions[engine_idx].inc(scheduler_stats.num_preemptions)
                self.structured_output_cache_queries[engine_idx].inc(scheduler_stats.structured_output_cache_queries)
                self.structured_output_cache_hits[engine_idx].inc(scheduler_stats.structured_output_cache_hits)
                for seconds in scheduler_stats.structured_output_compile_times:
                    self.structured_output_compile_time.observe(seconds)
                if self.spec_decoding is not None and scheduler_stats.spec_decoding_stats is not None:
                    self.spec_decoding.observe(scheduler_stats.spec_decoding_stats, engine_idx)
                if self.kv_transfer is not None and scheduler_stats.kv_transfer_stats is not None:
                    self.kv_transfer.record(scheduler_stats.kv_transfer_stats, engine_idx)
        if iteration_stats is None:
            return
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            self.inter_token_latency.observe(itl)
        for req in iteration_stats.finished_requests:
            reason = str(req.finish_reason)
            success = self.request_success.get(reason)
            if success is None:
                raise ValueError(f"finish_reason {reason!r} is not one of {sorted(self.request_success)}")
            success.inc()
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
            self.request_generation_tokens.observe(req.num_generation_tokens)
            self.e2e_request_latency.observe(req.e2e_latency)
            self.request_queue_time.observe(req.queued_time)
            self.request_inference_time.observe(req.inference_time)
            self.request_prefill_time.observe(req.prefill_time)
            self.request_decode_time.observe(req.decode_time)


# ----------------------------------------------------------------- factory


def _checked(instance: object, source: str) -> StatLoggerBase:
    if not isinstance(instance, StatLoggerBase):
        raise TypeError(f"stat logger {source} made a {type(instance).__qualname__}, not a StatLoggerBase")
    return instance


def build_stat_loggers(
    config: "EngineConfig",
    custom_factories: Sequence[StatLoggerFactory] | None = None,
    engine_index: int = 0,
    include_plugins: bool = True,
) -> list[StatLoggerBase]:
    """The stat loggers of one engine: ``LoggingStatLogger`` unless ``disable_log_stats``,
    then one per factory in ``custom_factories`` (``PrometheusStatLogger`` when serving),
    then one per ``kvloom.stat_logger_plugins`` class.

    A plugin entry that is not a ``StatLoggerBase`` subclass is a ``TypeError`` naming it.
    """
    loggers: list[StatLoggerBase] = []
    if not config.observability.disable_log_stats:
        loggers.append(LoggingStatLogger(config, engine_index))
    for factory in custom_factories or ():
        name = getattr(factory, "__qualname__", repr(factory))
        loggers.append(_checked(factory(config, engine_index), name))
    if include_plugins:
        for entry in plugins.stat_logger_plugins():
            name, cls = entry.name, entry.target
            if not (isinstance(cls, type) and issubclass(cls, StatLoggerBase)):
                raise TypeError(
                    f"stat logger plugin {name!r} is {cls!r}; a kvloom.stat_logger_plugins entry point "
                    "must name a subclass of kvloom.interfaces.StatLoggerBase"
                )
            logger.info("Loaded stat logger plugin %s (%s.%s)", name, cls.__module__, cls.__qualname__)
            loggers.append(_checked(cls(config, engine_index), name))
    return loggers
