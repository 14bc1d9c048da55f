"""The periodic stats line: exact text and timing with an injected clock (no sleeping)."""

import logging

from jaxllm.engine.metrics import SchedulerStats
from jaxllm.engine.stat_logger import LoggingStatLogger


def test_one_line_per_interval_with_throughput_since_the_last(caplog):
    now = [100.0]
    stat_logger = LoggingStatLogger(interval=10.0, clock=lambda: now[0])
    calls = []

    def make_stats():
        calls.append(now[0])
        return stats

    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25,
                           num_prompt_tokens=500, num_generation_tokens=120,
                           prefix_cache_queries=400, prefix_cache_hits=100)
    with caplog.at_level(logging.INFO, logger="jaxllm.engine.stat_logger"):
        now[0] = 109.9
        assert not stat_logger.maybe_log(make_stats)
        assert calls == []  # stats are only gathered when a line is due
        now[0] = 110.0
        assert stat_logger.maybe_log(make_stats)
        stats = SchedulerStats(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0,
                               num_prompt_tokens=500, num_generation_tokens=170,
                               prefix_cache_queries=400, prefix_cache_hits=100)
        now[0] = 115.0
        assert not stat_logger.maybe_log(make_stats)
        now[0] = 130.0
        assert stat_logger.maybe_log(make_stats)
    assert [r.getMessage() for r in caplog.records] == [
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 12.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%",
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.5 tokens/s, "
        "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 25.0%",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_no_queries_is_a_zero_hit_rate(caplog):
    stat_logger = LoggingStatLogger(interval=0.0, clock=lambda: 1.0)
    with caplog.at_level(logging.INFO, logger="jaxllm.engine.stat_logger"):
        stat_logger.log(SchedulerStats())
    assert caplog.records[0].getMessage().endswith("Prefix cache hit rate: 0.0%")
