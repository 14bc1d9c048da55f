"""PoolingScheduler: which waiting prompts the next pooling step runs, under the engine's token
budget (max_num_batched_tokens) and max_num_seqs: vLLM's one budget rule, without KV blocks.

Owns the waiting queue (first come, first served) and the step's plain message. A pooling
prompt is never chunked: bidirectional attention needs the whole prompt in one step, so the
engine admits only prompts of at most max_model_len <= max_num_batched_tokens tokens, and a
prompt that does not fit what is left of the budget waits for the next step. Nothing is
cached between steps (no prefix caching), so nothing is ever preempted.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class PoolingRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None
    params: Any  # PoolingParams
    task: str


@dataclasses.dataclass(frozen=True)
class PoolingSchedulerOutput:
    """One step: the requests it pools, in packing order, and their token count."""

    requests: tuple[PoolingRequest, ...]
    total_num_scheduled_tokens: int


class PoolingScheduler:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: collections.deque[PoolingRequest] = collections.deque()

    def add_request(self, request: PoolingRequest) -> None:
        if len(request.prompt_token_ids) > self.max_num_batched_tokens:
            raise ValueError(f"a pooling prompt of {len(request.prompt_token_ids)} tokens "
                             f"exceeds max_num_batched_tokens={self.max_num_batched_tokens}")
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def schedule(self) -> PoolingSchedulerOutput:
        scheduled, budget = [], self.max_num_batched_tokens
        while (self.waiting and len(scheduled) < self.max_num_seqs
               and len(self.waiting[0].prompt_token_ids) <= budget):
            request = self.waiting.popleft()
            budget -= len(request.prompt_token_ids)
            scheduled.append(request)
        total = self.max_num_batched_tokens - budget
        assert total <= self.max_num_batched_tokens and len(scheduled) <= self.max_num_seqs
        assert scheduled or not self.waiting, "a waiting prompt never fits the budget"
        return PoolingSchedulerOutput(tuple(scheduled), total)


__all__ = ["PoolingRequest", "PoolingScheduler", "PoolingSchedulerOutput"]
