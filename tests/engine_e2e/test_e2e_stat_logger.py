"""The stats line of a real engine (disable_log_stats=False), with an injected clock."""

from __future__ import annotations

import logging
import re

import numpy as np

from jaxllm.engine.stat_logger import LoggingStatLogger

from tiny_model import greedy

VOCAB = 49152


def prompts(n, length) -> list[dict]:
    rng = np.random.default_rng(6)
    return [{"prompt_token_ids": rng.integers(3, VOCAB, size=length).tolist()} for _ in range(n)]


def test_stats_line_every_interval_while_working(tiny_llm, make_tiny_llm, caplog):
    assert tiny_llm.llm_engine.stat_logger is None  # LLM's default: disable_log_stats=True
    llm = make_tiny_llm(disable_log_stats=False)
    assert isinstance(llm.llm_engine.stat_logger, LoggingStatLogger)
    now = [0.0]

    def clock():
        now[0] += 1.0  # one second per call: the constructor's, then one per step
        return now[0]

    llm.llm_engine.stat_logger = LoggingStatLogger(interval=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="jaxllm.engine.stat_logger"):
        llm.generate(prompts(2, 8), greedy(30), use_tqdm=False)
    steps = now[0] - 1
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxllm.engine.stat_logger"]
    assert len(lines) == int(steps // 10) >= 2
    pattern = (r"Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: "
               r"\d+\.\d tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, "
               r"KV cache usage: \d+\.\d%, Prefix cache hit rate: \d+\.\d%")
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    # Both prompts (16 tokens) got their first token in the first 10 s; none since.
    assert lines[0].startswith("Avg prompt throughput: 1.6 tokens/s,")
    assert lines[1].startswith("Avg prompt throughput: 0.0 tokens/s,")
    assert ", Running: 2 reqs, Waiting: 0 reqs," in lines[0]
    generated = sum(float(re.search(r"generation throughput: ([\d.]+)", line)[1]) * 10
                    for line in lines)
    assert generated <= 60  # 2 x 30 tokens in all, some after the last line
    # Metrics work either way.
    assert tiny_llm.get_metrics() and llm.get_metrics()
