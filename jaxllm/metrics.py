"""`LLM.get_metrics()`: vLLM-style metric snapshots named `jaxllm:*`.

Owns the user-facing metric types (as in vLLM's metrics reader: Counter, Gauge) and the
engine-lifetime counters that the scheduler does not keep (finished requests by reason).
"""

from __future__ import annotations

import dataclasses
from collections import Counter as _Tally

from jaxllm.engine.metrics import METRIC_NAMES, SchedulerStats

_COUNTERS = ("num_preemptions", "num_prompt_tokens", "num_generation_tokens")


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


class EngineMetrics:
    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self.finished_by_reason: _Tally[str] = _Tally()

    def record_finished(self, finish_reason: str) -> None:
        self.finished_by_reason[finish_reason] += 1

    def snapshot(self, stats: SchedulerStats) -> list[Metric]:
        out: list[Metric] = []
        for field, name in METRIC_NAMES.items():
            value = getattr(stats, field)
            kind = Counter if field in _COUNTERS else Gauge
            out.append(kind(name, dict(self.labels), value))
        for reason in ("stop", "length", "abort"):
            out.append(Counter("jaxllm:request_success_total",
                               {**self.labels, "finished_reason": reason},
                               self.finished_by_reason[reason]))
        return out
