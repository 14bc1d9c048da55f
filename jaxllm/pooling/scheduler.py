"""PoolingScheduler: which waiting prompts the next pooling step runs, under the engine's token
budget (max_num_batched_tokens) and max_num_seqs: vLLM's one budget rule, without KV blocks.

Owns the waiting queue and the step's plain message. A pooling prompt is never chunked:
bidirectional attention needs the whole prompt in one step, so the engine admits only prompts
of at most max_model_len <= max_num_batched_tokens tokens. The budget is cut into attention
blocks (jaxllm/pooling/attention.py: no prompt crosses a block edge), and a prompt runs in
this step if it fits a block's room, first fit (`BlockPacking`, which the runner replays in
the same order). The head of the queue always runs (the step starts empty); behind it, the
scheduler looks up to LOOKAHEAD prompts further for ones that fill the blocks' gaps, the
ones it passes keeping their order. Nothing is cached between steps (no prefix caching), so
nothing is ever preempted.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jaxllm.pooling.attention import BlockPacking, Tiling

LOOKAHEAD = 256  # waiting prompts examined per step beyond those that fit


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
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int,
                 tiling: Tiling | None = None):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # None: the whole budget is one block (prompts one after another)
        self.tiling = tiling or Tiling(max_num_batched_tokens)
        self.waiting: collections.deque[PoolingRequest] = collections.deque()

    def add_request(self, request: PoolingRequest) -> None:
        if len(request.prompt_token_ids) > self.max_num_batched_tokens:
            raise ValueError(f"a pooling prompt of {len(request.prompt_token_ids)} tokens "
                             f"exceeds max_num_batched_tokens={self.max_num_batched_tokens}")
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def schedule(self) -> PoolingSchedulerOutput:
        packing = BlockPacking.for_budget(self.tiling, self.max_num_batched_tokens)
        scheduled, passed = [], []
        while self.waiting and len(scheduled) < self.max_num_seqs and len(passed) < LOOKAHEAD:
            request = self.waiting.popleft()
            if packing.add(len(request.prompt_token_ids)) is None:
                passed.append(request)
            else:
                scheduled.append(request)
        self.waiting.extendleft(reversed(passed))
        total = sum(len(r.prompt_token_ids) for r in scheduled)
        assert total <= self.max_num_batched_tokens and len(scheduled) <= self.max_num_seqs
        assert scheduled or not self.waiting, "a waiting prompt never fits the budget"
        return PoolingSchedulerOutput(tuple(scheduled), total)


__all__ = ["PoolingRequest", "PoolingScheduler", "PoolingSchedulerOutput"]
