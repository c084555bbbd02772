"""A snapshot of an engine's Prometheus metrics as plain objects (``LLM.get_metrics()``,
vLLM's API): one ``Counter``, ``Gauge`` or ``Histogram`` per labelled series of the
registry ``PrometheusStatLogger`` publishes to, named as ``/metrics`` names them
(``kvloom:prompt_tokens``; counters without prometheus_client's ``_total`` suffix)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: float


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: float
    sum: float
    #: upper bound (``le``, as text: "0.5", "+Inf") -> cumulative count
    buckets: dict[str, float] = field(default_factory=dict)


def _series_key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "le"))


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every series of ``registry`` now (info metrics, which carry no value, left out)."""
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type in ("counter", "gauge"):
            cls = Counter if family.type == "counter" else Gauge
            suffix = "_total" if family.type == "counter" else ""
            for sample in family.samples:
                if sample.name == family.name + suffix:
                    metrics.append(cls(name=family.name, labels=dict(sample.labels), value=sample.value))
        elif family.type == "histogram":
            series: dict[tuple[tuple[str, str], ...], Histogram] = {}
            for sample in family.samples:
                key = _series_key(sample.labels)
                hist = series.setdefault(key, Histogram(name=family.name, labels=dict(key), count=0.0, sum=0.0))
                if sample.name.endswith("_bucket"):
                    hist.buckets[sample.labels["le"]] = sample.value
                elif sample.name.endswith("_count"):
                    hist.count = sample.value
                elif sample.name.endswith("_sum"):
                    hist.sum = sample.value
            metrics.extend(series.values())
    return metrics
