"""What every SchedulerOutput must satisfy, checked against the scheduler that made it.

Owns: the assertions on one step's schedule (budget, batch size, blocks covering the computed
tokens, a cache hit never covering a request's last token). Never changes the scheduler.
"""

from __future__ import annotations

from jaxllm.engine.request import RequestStatus
from jaxllm.messages import SchedulerOutput


def check_invariants(scheduler, output: SchedulerOutput) -> None:
    scheduled = output.num_scheduled_tokens
    assert output.total_num_scheduled_tokens == sum(scheduled.values())
    assert output.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(scheduled) <= len(scheduler.running) <= scheduler.max_num_seqs
    kv = scheduler.kv_cache_manager
    for new in output.scheduled_new_reqs:  # a cache hit never covers the last token
        assert new.num_computed_tokens < len(new.prompt_token_ids) + len(
            new.output_token_ids), new.req_id
    assert len(output.blocks_to_copy) <= len(output.scheduled_new_reqs)
    for req_id, num_tokens in scheduled.items():
        request = scheduler.requests[req_id]
        assert num_tokens > 0 and request.status == RequestStatus.RUNNING, request
        num_drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
        assert request.num_computed_tokens <= min(
            request.num_tokens_with_placeholders + num_drafts, scheduler.max_model_len), request
        num_blocks = len(kv.req_to_blocks[req_id])
        assert num_blocks * kv.block_size >= request.num_computed_tokens, (request, num_blocks)
