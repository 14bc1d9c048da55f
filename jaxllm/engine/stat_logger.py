"""The periodic stats line (vLLM's LoggingStatLogger), on by `disable_log_stats=False`.

    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.3 tokens/s,
    Running: 8 reqs, Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 25.0%

The engine calls `maybe_log` after every step, so a line appears at most once per
`interval` seconds and only while there is work. Throughputs are the scheduler's cumulative
token counters' increase over the time since the previous line; the prefix cache hit rate is
over the engine's lifetime (vLLM's is over its last 1,000 requests). Owns only the line and
its timing: the numbers are `Scheduler.make_stats()`'s, which `get_metrics()` reads too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from jaxllm.engine.metrics import SchedulerStats

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL = 10.0  # seconds (vLLM's VLLM_LOG_STATS_INTERVAL)


class LoggingStatLogger:
    def __init__(self, interval: float = LOG_STATS_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last_time = clock()
        self._last_prompt_tokens = 0
        self._last_generation_tokens = 0

    def maybe_log(self, make_stats: Callable[[], SchedulerStats]) -> bool:
        """Log a line if `interval` has passed since the previous one; True if it did."""
        now = self.clock()
        if now - self._last_time < self.interval:
            return False
        self.log(make_stats(), now)
        return True

    def log(self, stats: SchedulerStats, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        elapsed = max(now - self._last_time, 1e-9)
        prompt_throughput = (stats.num_prompt_tokens - self._last_prompt_tokens) / elapsed
        generation_throughput = (
            stats.num_generation_tokens - self._last_generation_tokens) / elapsed
        hit_rate = (stats.prefix_cache_hits / stats.prefix_cache_queries
                    if stats.prefix_cache_queries else 0.0)
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            prompt_throughput, generation_throughput, stats.num_running_reqs,
            stats.num_waiting_reqs, stats.kv_cache_usage * 100, hit_rate * 100)
        self._last_time = now
        self._last_prompt_tokens = stats.num_prompt_tokens
        self._last_generation_tokens = stats.num_generation_tokens
