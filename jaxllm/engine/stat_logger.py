"""The periodic stats line (vLLM's LoggingStatLogger), on by `disable_log_stats=False`.

    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.3 tokens/s,
    Running: 8 reqs, Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 25.0%

and, with speculative decoding, over the same interval (vLLM's second line):

    SpecDecoding metrics: Mean acceptance length: 2.41, Accepted: 620 tokens, Drafted: 1760
    tokens, Per-position acceptance rate: 0.705, 0.352, ..., Avg Draft acceptance rate: 35.2%

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
from jaxllm.spec_decode.scheduling import SpecDecodingStats

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
        self._last_spec = SpecDecodingStats()  # speculative decoding's counters at the last line

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
        spec, last = stats.spec_decoding, self._last_spec
        if spec is not None and last is not None and spec.num_drafts > last.num_drafts:
            # Over the interval, as vLLM's SpecDecodingLogging.
            drafts = spec.num_drafts - last.num_drafts
            drafted = spec.num_draft_tokens - last.num_draft_tokens
            accepted = spec.num_accepted_tokens - last.num_accepted_tokens
            last_pos = last.num_accepted_tokens_per_pos or (0,) * len(
                spec.num_accepted_tokens_per_pos)
            per_pos = [(a - b) / drafts for a, b in zip(spec.num_accepted_tokens_per_pos,
                                                        last_pos)]
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                "Drafted: %d tokens, Per-position acceptance rate: %s, Avg Draft acceptance "
                "rate: %.1f%%", 1 + accepted / drafts, accepted, drafted,
                ", ".join(f"{r:.3f}" for r in per_pos), 100 * accepted / max(drafted, 1))
        self._last_spec = spec if spec is not None else self._last_spec
        self._last_time = now
        self._last_prompt_tokens = stats.num_prompt_tokens
        self._last_generation_tokens = stats.num_generation_tokens
