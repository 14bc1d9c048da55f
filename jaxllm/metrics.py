"""`LLM.get_metrics()`: vLLM-style metric snapshots named `jaxllm:*`.

Owns the user-facing metric types (as in vLLM's metrics reader: Counter, Gauge, Histogram)
and the engine-lifetime figures that the scheduler does not keep: finished requests by
reason, and per-request latency and size histograms (vLLM's names and buckets). Never
exports anything: the server's /metrics renders these snapshots.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter as _Tally

from jaxllm.engine.metrics import METRIC_NAMES, SchedulerStats

_COUNTERS = ("num_preemptions", "num_prompt_tokens", "num_generation_tokens",
             "prefix_cache_queries", "prefix_cache_hits")


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Counter(Metric):
    value: int


@dataclasses.dataclass(frozen=True)
class Gauge(Metric):
    value: float


@dataclasses.dataclass(frozen=True)
class Histogram(Metric):
    buckets: tuple[float, ...]  # upper bounds, increasing; +Inf is implied
    counts: tuple[int, ...]  # observations per bucket, the last one for +Inf
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative_buckets(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), ending with (inf, count)."""
        out, total = [], 0
        for le, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            out.append((le, total))
        return out


class _Observations:
    """A histogram being filled: fixed buckets, counts and a sum."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
HISTOGRAMS = {  # name -> buckets (vLLM's histograms, under jaxllm:)
    "jaxllm:time_to_first_token_seconds": _LATENCY_BUCKETS,
    "jaxllm:inter_token_latency_seconds": _LATENCY_BUCKETS,
    "jaxllm:e2e_request_latency_seconds": _LATENCY_BUCKETS,
    "jaxllm:request_prompt_tokens": _TOKEN_BUCKETS,
    "jaxllm:request_generation_tokens": _TOKEN_BUCKETS,
}


class EngineMetrics:
    def __init__(self, model_name: str, engine_index: int = 0):
        """engine_index: the data-parallel replica, vLLM's `engine` label on every metric."""
        self.labels = {"model_name": model_name, "engine": str(engine_index)}
        self.finished_by_reason: _Tally[str] = _Tally()
        self.histograms = {name: _Observations(b) for name, b in HISTOGRAMS.items()}

    def record_finished(self, finish_reason: str) -> None:
        self.finished_by_reason[finish_reason] += 1

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def record_request(self, metrics, num_prompt_tokens: int, num_generation_tokens: int,
                       finish_reasons: list[str]) -> None:
        """A finished request (its RequestMetrics, sizes, and each completion's reason)."""
        for reason in finish_reasons:
            self.record_finished(reason)
        if metrics.finished_time is not None:
            self.observe("jaxllm:e2e_request_latency_seconds",
                         metrics.finished_time - metrics.arrival_time)
        if metrics.first_token_time is not None:
            self.observe("jaxllm:time_to_first_token_seconds",
                         metrics.first_token_time - metrics.arrival_time)
        self.observe("jaxllm:request_prompt_tokens", num_prompt_tokens)
        self.observe("jaxllm:request_generation_tokens", num_generation_tokens)

    def snapshot(self, stats: SchedulerStats) -> list[Metric]:
        out: list[Metric] = []
        for field, name in METRIC_NAMES.items():
            value = getattr(stats, field)
            kind = Counter if field in _COUNTERS else Gauge
            out.append(kind(name, dict(self.labels), value))
        for reason in ("stop", "length", "abort", "error"):  # vLLM's FinishReason values
            out.append(Counter("jaxllm:request_success_total",
                               {**self.labels, "finished_reason": reason},
                               self.finished_by_reason[reason]))
        for name, h in self.histograms.items():
            out.append(Histogram(name, dict(self.labels), h.buckets, tuple(h.counts), h.sum))
        return out
