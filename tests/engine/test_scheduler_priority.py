"""Exact tests of the scheduling policies (engine/request_queue.py) and what the scheduler does
with them: admission order, and which running request is preempted (no runner, no jax)."""

import functools

import pytest

from jaxllm.config import EngineConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.request_queue import (FCFSRequestQueue, PriorityRequestQueue,
                                         create_request_queue)
from jaxllm.engine.scheduler import Scheduler
from jaxllm.messages import ModelRunnerOutput
from jaxllm.sampling_params import SamplingParams

Params = functools.partial(SamplingParams, max_tokens=16, ignore_eos=True)


def make_scheduler(policy, *, num_blocks=64, max_num_seqs=8, block_size=4,
                   max_num_batched_tokens=64, max_model_len=24) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching=False)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, policy=policy)


def make_request(req_id, prompt_len, priority=0, arrival_time=0.0, **params) -> Request:
    return Request(req_id, [100 + i for i in range(prompt_len)], Params(**params),
                   eos_token_id=2, arrival_time=arrival_time, priority=priority)


def step(sched):
    """Schedule, then sample token 7 for every request whose prefill is complete."""
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
               else [] for r in req_ids]
    outs = sched.update_from_output(out, ModelRunnerOutput(req_ids, sampled))
    return out, outs


def ids(requests) -> list[str]:
    """Ids of Requests or NewRequestData, in order."""
    return [getattr(r, "request_id", None) or r.req_id for r in requests]


# -- the queues -------------------------------------------------------------------------------
def test_priority_queue_orders_by_priority_then_arrival_then_admission():
    sched = make_scheduler("priority")
    for req_id, priority, t in [("a", 1, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 1.0),
                                ("e", -3, 5.0), ("f", 0, 0.5)]:
        sched.add_request(make_request(req_id, 4, priority, t))
    # b and d tie on (priority, arrival): the one added first goes first.
    assert ids(sched.waiting) == ["e", "f", "b", "d", "a", "c"]
    assert sched.waiting.peek_request().request_id == "e"
    sched.finish_requests(["b", "e"], RequestStatus.FINISHED_ABORTED)
    assert ids(sched.waiting) == ["f", "d", "a", "c"]
    assert len(sched.waiting) == 4
    assert [sched.waiting.pop_request().request_id for _ in range(4)] == ["f", "d", "a", "c"]
    assert not sched.waiting


def test_prepend_fcfs_goes_to_the_front_priority_keeps_its_place():
    a, b, c = (make_request(r, 4, priority=p, arrival_time=t)
               for r, p, t in [("a", 0, 0.0), ("b", 1, 1.0), ("c", 0, 2.0)])
    fcfs, prio = FCFSRequestQueue(), PriorityRequestQueue()
    for q in (fcfs, prio):
        q.add_request(a)
        q.add_request(c)
        q.prepend_request(b)  # b was preempted
    assert ids(fcfs) == ["b", "a", "c"]
    assert ids(prio) == ["a", "c", "b"]
    # Victims: the tail of running, or the largest (priority, arrival).
    assert fcfs.preemption_victim([a, b, c]) is c
    assert prio.preemption_victim([a, b, c]) is b
    assert prio.preemption_victim([a, c]) is c


def test_unknown_policy_is_a_value_error():
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', "
                                         r"'priority'\), got 'lifo'"):
        create_request_queue("lifo")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lifo")
    assert EngineConfig().scheduling_policy == "fcfs"


# -- admission --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, first, then", [
    ("fcfs", ["a", "b"], ["c", "d"]),
    ("priority", ["b", "d"], ["a", "e"]),
])
def test_admission_order(policy, first, then):
    sched = make_scheduler(policy, max_num_seqs=2)
    for i, (req_id, priority) in enumerate([("a", 1), ("b", 0), ("c", 2), ("d", 0), ("e", 1)]):
        sched.add_request(make_request(req_id, 4, priority, float(i), max_tokens=1))
    out, _ = step(sched)
    assert ids(out.scheduled_new_reqs) == first
    out, _ = step(sched)  # the first two finished (max_tokens=1); the next two come in
    assert ids(out.scheduled_new_reqs) == then


def test_priority_request_arriving_later_does_not_preempt_running_ones():
    """vLLM v1: priority orders the waiting queue; it never evicts a running request."""
    sched = make_scheduler("priority", max_num_seqs=1)
    sched.add_request(make_request("low", 4, priority=5, max_tokens=3))
    step(sched)
    sched.add_request(make_request("high", 4, priority=-5, arrival_time=1.0))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"low": 1} and out.preempted_req_ids == set()
    step(sched)  # low finishes
    out, _ = step(sched)
    assert ids(out.scheduled_new_reqs) == ["high"]


# -- preemption -------------------------------------------------------------------------------
def _three_running(policy):
    """6 usable blocks of 4. a (prio 0) and b (prio 2) are admitted first with 6-token
    prompts, then c (prio 1, 8 tokens) joins: running [a, b, c], every block held. In the
    third step a and b still fit their two blocks, c needs a third."""
    sched = make_scheduler(policy, num_blocks=7)
    sched.add_request(make_request("a", 6, priority=0, arrival_time=0.0))
    sched.add_request(make_request("b", 6, priority=2, arrival_time=1.0))
    step(sched)
    sched.add_request(make_request("c", 8, priority=1, arrival_time=2.0))
    out, _ = step(sched)
    assert ids(out.scheduled_new_reqs) == ["c"]
    assert ids(sched.running) == ["a", "b", "c"]
    assert sched.kv_cache_manager.num_free_blocks == 0
    return sched


def test_fcfs_preempts_the_tail():
    sched = _three_running("fcfs")
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.preempted_req_ids == {"c"}  # the tail preempted itself
    assert ids(sched.running) == ["a", "b"] and ids(sched.waiting) == ["c"]


def test_priority_preempts_the_least_important_even_if_already_scheduled():
    sched = _three_running("priority")
    b = sched.requests["b"]
    out, _ = step(sched)
    # b was scheduled before c asked for a block: it is unscheduled, its token given back
    # to the budget, and its blocks (freed tail first) go to c.
    assert out.num_scheduled_tokens == {"a": 1, "c": 1}
    assert out.total_num_scheduled_tokens == 2
    assert out.preempted_req_ids == {"b"}
    assert [(r.req_id, r.new_block_ids) for r in out.scheduled_cached_reqs] == [
        ("a", []), ("c", [4])]
    assert (b.status, b.num_computed_tokens, b.output_token_ids) == (
        RequestStatus.PREEMPTED, 0, [7, 7])
    assert ids(sched.running) == ["a", "c"] and ids(sched.waiting) == ["b"]
    assert sched.make_stats().num_preemptions == 1


@pytest.mark.parametrize("policy, victim, waiting", [
    ("fcfs", "c", ["c", "d"]),  # the tail; back to the front of the queue
    ("priority", "b", ["d", "b"]),  # the least important; behind d, which is more important
])
def test_victim_not_yet_scheduled_and_resume_order(policy, victim, waiting):
    """7 usable blocks. a (prio 0, 11 tokens: 3 blocks) asks for a 4th block first, while b
    (prio 2, in the middle of running) and c (prio 1, the tail) are not scheduled yet."""
    sched = make_scheduler(policy, num_blocks=8)
    sched.add_request(make_request("a", 11, priority=0, arrival_time=0.0))
    sched.add_request(make_request("b", 4, priority=2, arrival_time=1.0))
    step(sched)  # a: 3 blocks, b: 1
    sched.add_request(make_request("c", 8, priority=1, arrival_time=2.0))
    out, _ = step(sched)  # b takes its 2nd block, c its 2: none left
    assert ids(out.scheduled_new_reqs) == ["c"]
    assert ids(sched.running) == ["a", "b", "c"]
    assert sched.kv_cache_manager.num_free_blocks == 0
    sched.add_request(make_request("d", 4, priority=1, arrival_time=3.0))
    out, _ = step(sched)  # a needs a 4th block
    assert out.preempted_req_ids == {victim}
    survivors = [r for r in "abc" if r != victim]
    assert out.num_scheduled_tokens == {r: 1 for r in survivors}
    assert ids(sched.running) == survivors
    assert ids(sched.waiting) == waiting


def test_uncache_scheduled_drops_only_blocks_not_computed_yet():
    """A block is offered to the prefix cache when the tokens that fill it are scheduled. If
    its request is then preempted in the same step (only the "priority" policy does that),
    those tokens are never computed: such blocks must leave the cache, or a later hit would
    read K/V nobody wrote. Blocks computed in earlier steps stay."""
    kv = KVCacheManager(16, 4, 24, enable_caching=True)
    req = make_request("b", 16)
    kv.update_block_hashes(req)
    assert kv.allocate_slots(req, 8) == [1, 2]
    req.num_computed_tokens = 8  # the first chunk ran
    assert kv.allocate_slots(req, 8) == [3, 4]  # the second is scheduled: offered at once
    cached = kv.block_pool.cached_block_hash_to_block
    assert all(h in cached for h in req.block_hashes)
    kv.uncache_scheduled(req)
    assert [h in cached for h in req.block_hashes] == [True, True, False, False]
    kv.free(req)
    assert kv.num_free_blocks == 15


def test_scheduled_victim_is_preempted_with_a_consistent_cache():
    """b's decode token at position 7 fills its 2nd block (offered to the cache) and is
    scheduled; then c needs a 5th block and b, the least important, is preempted."""
    kv = KVCacheManager(7, 4, 24, enable_caching=True)
    sched = Scheduler(kv, 8, 12, 24, policy="priority")
    sched.add_request(make_request("b", 1, priority=2, max_tokens=10))
    step(sched)
    sched.add_request(make_request("c", 11, priority=0, arrival_time=1.0, max_tokens=10))
    for _ in range(6):  # running [b, c]; b decodes up to position 6, c to 15
        out, _ = step(sched)
        assert out.preempted_req_ids == set()
    b = sched.requests["b"]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"c": 1} and out.preempted_req_ids == {"b"}
    cached = kv.block_pool.cached_block_hash_to_block
    assert b.block_hashes[0] in cached  # computed: it stays
    assert len(b.block_hashes) == 2 and b.block_hashes[1] not in cached
    # b resumes later with a hit on its first block only.
    assert kv.get_computed_blocks(b)[1] == 4
