"""`LLM.get_metrics()`: vLLM-style metric snapshots named `jaxllm:*`.

Owns the user-facing metric types (as in vLLM's metrics reader: Counter, Gauge, Histogram)
and the engine-lifetime figures that the scheduler does not keep: finished requests by
reason, prompt tokens by source, the sleep state, cache_config_info, and vLLM v1's
per-request and per-iteration histograms (its names, labels and default buckets, from
vllm/v1/metrics/loggers.py and buckets.py). Never exports anything: the server's /metrics
renders these snapshots.
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


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# vLLM v1's bucket families (vllm/v1/metrics/buckets.py), the defaults of each.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
                               2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# Histogram -> its bucket family ("request_tokens" is capped at max_model_len), as vLLM's.
HISTOGRAMS = {
    "jaxllm:request_prompt_tokens": "request_tokens",
    "jaxllm:request_generation_tokens": "request_tokens",
    "jaxllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
    "jaxllm:request_max_num_generation_tokens": "request_tokens",
    "jaxllm:request_params_n": REQUEST_PARAMS_N_BUCKETS,
    "jaxllm:request_params_max_tokens": "request_tokens",
    "jaxllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN_BUCKETS,
    "jaxllm:inter_token_latency_seconds": INTER_TOKEN_LATENCY_BUCKETS,
    "jaxllm:request_time_per_output_token_seconds": INTER_TOKEN_LATENCY_BUCKETS,
    "jaxllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "jaxllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "jaxllm:request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "jaxllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "jaxllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
    "jaxllm:request_num_preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS,
    "jaxllm:request_prefill_kv_computed_tokens": "request_tokens",
}
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # awake, level 1, level 2
# Counters vLLM has that nothing here feeds (no KV connector, no multimodal cache, no queue
# limits): exported at 0 so that dashboards find them.
_ZERO_COUNTERS = ("jaxllm:external_prefix_cache_queries", "jaxllm:external_prefix_cache_hits",
                  "jaxllm:mm_cache_queries", "jaxllm:mm_cache_hits")


# vLLM's CacheConfig.metrics_info() keys (the labels of cache_config_info), with vLLM's
# defaults; cache_config_info() fills in what this engine knows.
_CACHE_CONFIG_DEFAULTS = {
    "block_size": "16", "user_specified_block_size": "False", "kv_cache_layout": "None",
    "prefix_match_unit": "None", "gpu_memory_utilization": "0.92", "cache_dtype": "auto",
    "is_attention_free": "False", "num_gpu_blocks_override": "None", "sliding_window": "None",
    "enable_prefix_caching": "True", "prefix_caching_hash_algo": "sha256",
    "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]",
    "mamba_page_size_padded": "None", "skip_page_size_padded": "None",
    "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto",
    "mamba_cache_mode": "none", "enable_mamba_shared_prefix_checkpoint": "False",
    "replayssm_buffer_len": "16", "use_replayssm": "False", "use_kda_recoverssm": "False",
    "num_gpu_blocks": "None", "num_cpu_blocks": "None",
    "effective_attention_block_size": "None", "kv_cache_size_tokens": "None",
    "kv_cache_max_concurrency": "None", "hash_block_size": "None",
    "cache_hit_alignment_tokens": "None", "kv_sharing_fast_prefill": "False",
    "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None",
    "kv_offloading_size": "None", "kv_offloading_backend": "native",
    "_block_size_resolved": "True",
}


def cache_config_info(config, num_blocks: int) -> dict[str, str]:
    """The labels of jaxllm:cache_config_info for a resolved EngineConfig."""
    return {**_CACHE_CONFIG_DEFAULTS,
            "block_size": str(config.block_size),
            "user_specified_block_size": "True",
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "num_gpu_blocks": str(num_blocks),
            "effective_attention_block_size": str(config.block_size),
            "kv_cache_size_tokens": str(num_blocks * config.block_size),
            "hash_block_size": str(config.block_size),
            "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes)}


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
    """What the histograms read of one finished request (all its `n` completions)."""

    metrics: object  # its RequestMetrics
    num_prompt_tokens: int
    num_generation_tokens: int  # over all completions
    max_num_generation_tokens: int  # of its longest completion
    finish_reasons: list[str]
    n: int
    max_tokens: int | None
    num_cached_tokens: int
    num_preemptions: int


class EngineMetrics:
    def __init__(self, model_name: str, engine_index: int = 0, *, max_model_len: int = 2048,
                 cache_config_info: dict[str, str] | None = None):
        """engine_index: the data-parallel replica, vLLM's `engine` label on every metric;
        cache_config_info: the labels of jaxllm:cache_config_info (vLLM's CacheConfig
        keys)."""
        self.labels = {"model_name": model_name, "engine": str(engine_index)}
        self.finished_by_reason: _Tally[str] = _Tally()
        token_buckets = request_tokens_buckets(max_model_len)
        self.histograms = {name: _Observations(token_buckets if b == "request_tokens" else b)
                           for name, b in HISTOGRAMS.items()}
        self.prompt_tokens_by_source: _Tally[str] = _Tally()
        self.cache_config_info = {**(cache_config_info or {}), "engine": str(engine_index)}
        self.sleep_level = 0  # 0 awake, else the sleep level (engine/sleep.py sets it)

    def record_finished(self, finish_reason: str) -> None:
        self.finished_by_reason[finish_reason] += 1

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def record_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A prompt done (the first token of one of a request's `n` samples, each an engine
        request as in vLLM): where its tokens came from."""
        self.prompt_tokens_by_source["local_compute"] += num_prompt_tokens - num_cached_tokens
        self.prompt_tokens_by_source["local_cache_hit"] += num_cached_tokens

    def record_request(self, r: FinishedRequest) -> None:
        """A finished request: vLLM's per-request histograms. Its phases:

            arrival --queue-- first scheduled --prefill-- first token --decode-- last token
                              |<------------------- inference ------------------->|
        """
        for reason in r.finish_reasons:
            self.record_finished(reason)
        m = r.metrics
        if m.finished_time is not None:
            self.observe("jaxllm:e2e_request_latency_seconds", m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            self.observe("jaxllm:time_to_first_token_seconds",
                         m.first_token_time - m.arrival_time)
        scheduled = m.first_scheduled_time
        if scheduled is not None:
            self.observe("jaxllm:request_queue_time_seconds", scheduled - m.arrival_time)
        if scheduled is not None and m.first_token_time is not None:
            decode = m.last_token_time - m.first_token_time
            self.observe("jaxllm:request_prefill_time_seconds", m.first_token_time - scheduled)
            self.observe("jaxllm:request_decode_time_seconds", decode)
            self.observe("jaxllm:request_inference_time_seconds",
                         m.last_token_time - scheduled)
            if r.max_num_generation_tokens > 1:
                self.observe("jaxllm:request_time_per_output_token_seconds",
                             decode / (r.max_num_generation_tokens - 1))
        self.observe("jaxllm:request_prompt_tokens", r.num_prompt_tokens)
        self.observe("jaxllm:request_generation_tokens", r.num_generation_tokens)
        self.observe("jaxllm:request_max_num_generation_tokens", r.max_num_generation_tokens)
        self.observe("jaxllm:request_params_n", r.n)
        if r.max_tokens is not None:
            self.observe("jaxllm:request_params_max_tokens", r.max_tokens)
        self.observe("jaxllm:request_num_preemptions", r.num_preemptions)
        self.observe("jaxllm:request_prefill_kv_computed_tokens",
                     r.num_prompt_tokens - r.num_cached_tokens)

    def snapshot(self, stats: SchedulerStats) -> list[Metric]:
        labels = self.labels
        out: list[Metric] = []
        for field, name in METRIC_NAMES.items():
            value = getattr(stats, field)
            kind = Counter if field in _COUNTERS else Gauge
            out.append(kind(name, dict(labels), value))
        # Every waiting request waits for capacity (nothing here defers one).
        for reason, value in (("capacity", stats.num_waiting_reqs), ("deferred", 0)):
            out.append(Gauge("jaxllm:num_requests_waiting_by_reason",
                             {**labels, "reason": reason}, value))
        for level, state in enumerate(SLEEP_STATES):
            on = self.sleep_level == level
            out.append(Gauge("jaxllm:engine_sleep_state", {**labels, "sleep_state": state},
                             int(on)))
        out.append(Gauge("jaxllm:cache_config_info", dict(self.cache_config_info), 1))
        for name in _ZERO_COUNTERS:
            out.append(Counter(name, dict(labels), 0))
        for source in PROMPT_SOURCES:
            out.append(Counter("jaxllm:prompt_tokens_by_source", {**labels, "source": source},
                               self.prompt_tokens_by_source[source]))
        cached = self.prompt_tokens_by_source["local_cache_hit"]
        out.append(Counter("jaxllm:prompt_tokens_cached", dict(labels), cached))
        for source in CACHE_HIT_SOURCES:  # every hit is in device memory
            out.append(Counter("jaxllm:prompt_tokens_cached_by_source",
                               {**labels, "source": source}, cached if source == "device" else 0))
        for reason in ADMISSION_REASONS:  # no queue limits here: never rejected
            out.append(Counter("jaxllm:admission_rejections",
                               {"model_name": labels["model_name"], "reason": reason}, 0))
        for reason in FINISH_REASONS:
            out.append(Counter("jaxllm:request_success_total",
                               {**labels, "finished_reason": reason},
                               self.finished_by_reason[reason]))
        for name, h in self.histograms.items():
            out.append(Histogram(name, dict(labels), h.buckets, tuple(h.counts), h.sum))
        out += spec_decode_metrics(stats.spec_decoding, labels)
        return out


def spec_decode_metrics(spec, labels: dict[str, str]) -> list[Metric]:
    """vLLM's spec_decode_* counters (jaxllm/spec_decode/); none while speculation is off."""
    if spec is None:
        return []
    out: list[Metric] = [Counter(f"jaxllm:spec_decode_{field}", dict(labels),
                                 getattr(spec, field))
                         for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")]
    for position, value in enumerate(spec.num_accepted_tokens_per_pos):
        out.append(Counter("jaxllm:spec_decode_num_accepted_tokens_per_pos",
                           {**labels, "position": str(position)}, value))
    return out
