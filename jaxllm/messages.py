"""The plain messages that the front end, the scheduler and the runner exchange.

    Processor (front end)           -> EngineCoreRequest        -> EngineCore.add_request
    Scheduler.schedule()            -> SchedulerOutput          -> runner
    runner.execute_model(...)       -> ModelRunnerOutput        -> Scheduler.update_from_output
    Scheduler.update_from_output()  -> list[EngineCoreOutput]   -> OutputProcessor (front end)

This module is neutral ground: it imports none of the layers it connects (engine, runner,
front end), so none of them imports the layer beside it. It owns only data: no methods that
change state, no `Request` objects (the runner must never see one), no jax. Field meanings
follow docs/contracts.md.

`num_computed_tokens` in both request messages is the count *before* this step's tokens:
the runner computes positions num_computed_tokens .. num_computed_tokens + n - 1, where
n = SchedulerOutput.num_scheduled_tokens[req_id].
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class LogprobsLists:
    """Host-side logprobs of some rows of one request, trimmed to what it asked for.

    Row r lists the selected token (sampled, or the actual prompt token) first, then the
    request's top-n (ranks 1..n), as vLLM does; the selected token may also be in the top-n.
    """

    logprob_token_ids: list[list[int]]  # [rows][1 + n]
    logprobs: list[list[float]]  # [rows][1 + n]
    sampled_token_ranks: list[int]  # [rows], rank of the selected token


@dataclasses.dataclass(frozen=True)
class EngineCoreRequest:
    """One sequence to generate, validated and tokenized by the front end (after the `n`
    fan-out: each of a parent's children is its own EngineCoreRequest)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # jaxllm.sampling_params.SamplingParams, the child's own copy
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0  # lower is served first (the "priority" scheduling policy)


@dataclasses.dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no state for: first schedule, or resume after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after preemption
    sampling_params: Any  # jaxllm.sampling_params.SamplingParams
    block_ids: list[int]  # the request's whole block table
    num_computed_tokens: int


@dataclasses.dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]  # append to the runner's block table (often empty)
    num_computed_tokens: int
    # Blocks the request held before new_block_ids; fewer than the runner's when blocks were
    # given back (speculative decoding frees blocks that held only rejected drafts): the
    # runner cuts its table to this many first. None: unchanged.
    num_blocks_before: int | None = None


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step (> 0)
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or aborted since the previous step
    preempted_req_ids: set[str]  # preempted this step
    # (source, destination) block ids to copy on the device before this step runs: cached
    # tails continued by new requests (kv_cache_manager.get_cached_tail).
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Structured outputs: the requests that sample this step under a grammar, and row i of
    # grammar_bitmask [k, ceil(V / 32)] int32 (bit v % 32 of word v // 32) is the tokens
    # request i may sample; None when no request is constrained.
    structured_output_request_ids: list[str] = dataclasses.field(default_factory=list)
    grammar_bitmask: Any = None
    # Speculative decoding (jaxllm/spec_decode/): req_id -> the draft tokens it verifies this
    # step, the last len(drafts) of its num_scheduled_tokens; absent: no drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(
        default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclasses.dataclass(frozen=True)
class ModelRunnerOutput:
    """What one step produced, aligned by position with `req_ids`."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # [] while the request's prefill is still partial
    # Opaque per-request sample logprobs (None where not requested); None for the whole
    # list when no request in the batch asked for any.
    logprobs: list[Any | None] | None = None
    prompt_logprobs: dict[str, Any] = dataclasses.field(default_factory=dict)  # opaque
    # req_id -> its captured activations of this step (jaxllm.research.ActivationChunk),
    # for the requests that capture
    activations: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.sampled_token_ids) != len(self.req_ids):
            raise ValueError(f"sampled_token_ids has {len(self.sampled_token_ids)} entries for "
                             f"{len(self.req_ids)} req_ids")
        if self.logprobs is not None and len(self.logprobs) != len(self.req_ids):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for "
                             f"{len(self.req_ids)} req_ids")


@dataclasses.dataclass(frozen=True)
class EngineCoreOutput:
    """New tokens (and maybe the end) of one request after one step."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None  # the stop token id that matched; None otherwise
    new_logprobs: Any | None = None  # copied through from ModelRunnerOutput.logprobs
    new_prompt_logprobs: Any | None = None  # copied through from .prompt_logprobs
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    new_activations: Any | None = None  # copied through from ModelRunnerOutput.activations
    scheduled_time: float | None = None  # time.time() of its first schedule (metrics)
    num_preemptions: int = 0  # times it was preempted so far (metrics)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
