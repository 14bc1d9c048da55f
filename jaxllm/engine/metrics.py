"""Scheduler statistics: one frozen snapshot per `Scheduler.make_stats()` call.

This file owns the names and meanings of the engine's metrics, not how they are exported.
Gauges describe the moment of the snapshot; counters are cumulative since the scheduler was
created (exporters take differences if they want rates).
"""

from __future__ import annotations

import dataclasses

from jaxllm.spec_decode.scheduling import SpecDecodingStats


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    # Gauges.
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0  # includes preempted requests waiting to resume
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks held, in [0, 1]
    # Counters (cumulative).
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of requests that produced their first token
    num_generation_tokens: int = 0  # output tokens appended (after stop truncation)
    # Prefix cache, in tokens, over requests admitted with a lookup (first schedule or resume
    # after preemption; not prompt_logprobs requests, not with caching off): tokens looked
    # up, and those found cached. hits / queries is the hit rate.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding's counters (spec_decode/scheduling.py); None when it is off.
    spec_decoding: SpecDecodingStats | None = None


# Field -> exported metric name, following vLLM's `vllm:*` names under a `jaxllm:` prefix.
METRIC_NAMES: dict[str, str] = {
    "num_running_reqs": "jaxllm:num_requests_running",
    "num_waiting_reqs": "jaxllm:num_requests_waiting",
    "kv_cache_usage": "jaxllm:kv_cache_usage_perc",
    "num_preemptions": "jaxllm:num_preemptions_total",
    "num_prompt_tokens": "jaxllm:prompt_tokens_total",
    "num_generation_tokens": "jaxllm:generation_tokens_total",
    "prefix_cache_queries": "jaxllm:prefix_cache_queries",
    "prefix_cache_hits": "jaxllm:prefix_cache_hits",
}
