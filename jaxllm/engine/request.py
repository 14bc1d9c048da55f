"""One generation request as the scheduler sees it: token counters, status, and when it stops.

This file owns a request's token list (which only grows through `append_output_token_ids`),
its lifecycle status, and the stopping rules. It never touches blocks or devices, and the
runner never sees a `Request`: it only gets the plain messages of `jaxllm/messages.py`.

Token ranges of a request in the middle of a chunked prefill (prompt of 10, 6 computed):

    token ids:      p0 p1 p2 p3 p4 p5 | p6 p7 p8 p9
                    <-- computed ---> | <-- still to compute -->
    num_computed_tokens = 6, num_tokens = 10, num_output_tokens = 0

and while decoding (one sampled token whose K/V is not in the cache yet):

    p0 ... p9 o0 o1 | o2
    num_computed_tokens = 12, num_tokens = 13, num_output_tokens = 3

With async scheduling a step is scheduled before the previous step's sampled token reaches
the host. That token is a placeholder: counted, scheduled (the runner takes its id from the
device), but not yet in the token list:

    p0 ... p9 o0 o1 o2 | [o3]       num_computed_tokens = 13, num_tokens = 13,
                                    num_output_placeholders = 1, num_tokens_with_placeholders = 14

For prefix caching a request also keeps `block_hashes`, the chained hashes of its full blocks
(engine/block_hash.py). They are a function of the known tokens only, so they grow with the
token list (prompt blocks on arrival, output blocks as they fill), never for placeholders,
and survive preemption.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

from jaxllm.engine.block_hash import BlockHash, extend_block_hashes
from jaxllm.lora.request import cache_extra_keys as lora_cache_keys
from jaxllm.research.requests import cache_extra_keys as research_cache_keys

# The key of SamplingParams.extra_args that holds a request's cache_salt (vLLM's request
# field; the server puts it there): only requests with the same salt share cached blocks.
CACHE_SALT_KEY = "_cache_salt"


class RequestStatus(enum.IntEnum):
    """Ordered so that "finished" is one comparison: everything after PREEMPTED."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the step that computed it raised

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISHED_REASONS.get(status)


# vLLM's finish_reason strings.
_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class SamplingParamsLike(Protocol):
    """The only fields of `jaxllm.sampling_params.SamplingParams` the engine reads."""

    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int] | None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParamsLike,
        eos_token_id: int | None,
        arrival_time: float,
        priority: int = 0,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        # Lower is served first, with the "priority" scheduling policy (vLLM's meaning).
        self.priority = priority
        # Set by the scheduler on admission: breaks ties between equal arrival times (the
        # n > 1 children of one prompt) in the order they were added.
        self.arrival_order = 0
        self.status = RequestStatus.WAITING
        # Token id (stop_token_ids match) or string (stop string, set from outside) that
        # ended the request; None for EOS, length, abort.
        self.stop_reason: int | str | None = None
        # Tokens whose K/V is in the cache (or scheduled to be, this step).
        self.num_computed_tokens = 0
        # Tokens sampled by a dispatched step that the host has not received yet (async
        # scheduling); update_from_output turns each into a real token.
        self.num_output_placeholders = 0
        # After a preemption in async mode, this many in-flight tokens are stale: they are
        # dropped when they arrive and re-sampled after the recompute.
        self.num_stale_outputs = 0
        self.num_preemptions = 0
        self.scheduled_time: float | None = None  # time.time() of its first schedule
        # Prompt tokens taken from the prefix cache when first scheduled (vLLM's
        # num_cached_tokens; a resume after preemption does not change it).
        self.num_cached_tokens = 0
        # Chained hashes of the full blocks whose tokens are all known; grown by
        # `update_block_hashes`, only while prefix caching is on.
        self.block_hashes: list[BlockHash] = []
        # Its grammar and matcher (engine/structured_output.py) when it has
        # structured_outputs; None otherwise, and once it finished.
        self.structured_output_request = None
        self._num_prompt_tokens = len(prompt_token_ids)
        self._all_token_ids: list[int] = list(prompt_token_ids)

    # -- the one way tokens are added --------------------------------------------------
    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            self._all_token_ids.append(token_ids)
        else:
            self._all_token_ids.extend(token_ids)

    def update_block_hashes(self, block_size: int) -> None:
        """Hash the blocks that became full (of known tokens) since the last call."""
        extend_block_hashes(self.block_hashes, self._all_token_ids, block_size,
                            self.cache_extra_keys)

    # -- derived views -----------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> list[int]:
        return self._all_token_ids[: self._num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self._all_token_ids[self._num_prompt_tokens:]

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (the request's own list: read it, never modify it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens the scheduler plans with: known ones plus those still in flight."""
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self._all_token_ids) - self._num_prompt_tokens

    @property
    def cache_extra_keys(self) -> tuple:
        """What besides the tokens a cached block must match: the request's steering
        vectors (jaxllm/research/requests.py), so a steered request's KV never serves a
        plain one, and its cache_salt, so that salted requests share blocks only with the
        same salt, and its LoRA adapter, so an adapter's KV serves only that adapter."""
        salt = (getattr(self.sampling_params, "extra_args", None) or {}).get(CACHE_SALT_KEY)
        keys = (research_cache_keys(self.sampling_params)
                + lora_cache_keys(self.sampling_params))
        return keys if salt is None else (*keys, ("cache_salt", salt))

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Smaller is more important (engine/request_queue.py); unique per scheduler."""
        return (self.priority, self.arrival_time, self.arrival_order)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def last_token_id(self) -> int:
        return self._all_token_ids[-1]

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, "
                f"out={self.num_output_tokens}/{self.max_tokens})")


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether the request's newest token ends it; if so set its status (and
    stop_reason). Checked after every appended token, in this order."""
    params = request.sampling_params
    token = request.last_token_id
    # EOS and stop tokens are masked by the sampler until min_tokens exist; the check is
    # repeated here so a runner that does not mask still cannot stop early.
    may_stop_on_token = request.num_output_tokens >= params.min_tokens
    if may_stop_on_token and not params.ignore_eos and token == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if may_stop_on_token and token in (params.stop_token_ids or ()):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = token
        return True
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
