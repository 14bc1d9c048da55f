"""/metrics: the engine's metric snapshot as Prometheus text, through prometheus_client.

Owns only the translation of `jaxllm.metrics` objects (Counter, Gauge, Histogram, with
vLLM's names under `jaxllm:`) into Prometheus metric families, collected fresh at every
scrape. Never keeps state of its own: the engine's snapshot is the truth.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from jaxllm.metrics import Counter, Gauge, Histogram, Metric


class _Snapshot:
    def __init__(self, metrics: list[Metric]):
        self.metrics = metrics

    def collect(self):
        families: dict[str, object] = {}
        for m in self.metrics:
            labels = sorted(m.labels)
            family = families.get(m.name)
            if family is None:
                cls = {Counter: CounterMetricFamily, Gauge: GaugeMetricFamily,
                       Histogram: HistogramMetricFamily}[type(m)]
                family = families[m.name] = cls(m.name, m.name, labels=labels)
            values = [m.labels[k] for k in labels]
            if isinstance(m, Histogram):
                buckets = [(str(le), count) for le, count in m.cumulative_buckets()]
                family.add_metric(values, buckets, m.sum)
            else:
                family.add_metric(values, m.value)
        yield from families.values()


def render_metrics(metrics: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(metrics))
    return generate_latest(registry)
